"""`swarm-generate` proves itself: the text streams as it is generated, then it prints the
chain its session used, the speed, and with `--check` whether plain transformers generation on the same
checkpoint gives the same token ids (exit status 1 if not)."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, TextStreamer

from llm_swarm.client import cli as client_cli
from llm_swarm.client.backend import LocalSpans
from llm_swarm.client.generate_report import ChainHop, TokenCheck, chain_lines, speed_line
from llm_swarm.client.model import DistributedModelForCausalLM
from llm_swarm.swarm.dht_keys import default_prefix
from llm_swarm.swarm.models import load_span
from tests.conftest import NUM_BLOCKS

PEER_A = "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"
PEER_B = "QmTzQ1JRkWErjk39mryYw2WVaphAZNAREyMchXzYQ7c15n"
PEER_C = "QmSoLnSGccFuZQJzRadHn95W2CrSFmZuTdDWP8HXaHca9z"


def run_cli(model_dir, *argv: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "llm_swarm.client.cli", str(model_dir), *argv]
    return subprocess.run(command, capture_output=True, text=True, timeout=180)


# --- against a real swarm -------------------------------------------------------------------------------
@pytest.mark.swarm
def test_check_against_a_real_swarm_prints_chain_speed_and_verdict(swarm, llama_dir, capsys):
    prefix = default_prefix(str(llama_dir))
    swarm.start_server("front", llama_dir, "0:3")
    swarm.start_server("back", llama_dir, f"3:{NUM_BLOCKS}")
    swarm.wait_online(prefix, NUM_BLOCKS, ["front", "back"])
    generate = ("--initial-peers", *swarm.initial_peers, "--prompt", "Once upon", "--max-new-tokens", "8")
    greedy = run_cli(llama_dir, *generate, "--check")
    assert greedy.returncode == 0, greedy.stderr
    assert greedy.stdout.startswith("Once upon")  # the streamed text comes first
    lines = greedy.stdout.splitlines()
    report = lines[lines.index("chain: 2 hops") :]
    peer = r"\(\w{6}\.\.\.\w{6}\)"
    assert re.fullmatch(rf"  blocks 0:3  front {peer}", report[1]), report
    assert re.fullmatch(rf"  blocks 3:6  back {peer}", report[2]), report
    assert re.fullmatch(r"speed: 8 new tokens in [\d.]+ s = [\d.]+ tokens/s \(.*\)", report[3]), report
    assert (
        report[4]
        == "check: the swarm generated the same 8 new tokens as local transformers (float32, greedy)"
    )
    assert len(report) == 5
    # sampling is checked too (the swarm run and the local one seed the RNG alike); in this process, which
    # has paid for its imports already: the entry point itself, without a new interpreter's start
    client_cli.main(
        [str(llama_dir), *generate, "--check", "--do-sample", "--temperature", "0.8", "--seed", "3"]
    )
    verdict = capsys.readouterr().out.splitlines()[-1]
    assert verdict == (
        "check: the swarm generated the same 8 new tokens as local transformers (float32, sampling, seed 3)"
    )


# --- pure: the verdict, the exit status, the chain lines ------------------------------------------------
def test_token_check_verdicts():
    equal = TokenCheck((5, 6, 7), (5, 6, 7))
    assert equal.equal and equal.first_difference is None
    assert equal.verdict(how="float32, greedy") == (
        "check: the swarm generated the same 3 new tokens as local transformers (float32, greedy)"
    )
    differ = TokenCheck((5, 6, 7, 8), (5, 6, 9, 8))
    assert not differ.equal and differ.first_difference == 2
    assert differ.verdict(decode=lambda token: f"t{token}") == (
        "check FAILED: tokens differ from position 2 of the new tokens (the swarm 7 't7' vs local 9 't9')"
    )
    ended = TokenCheck((5, 6), (5, 6, 7))  # one side stopped early (an end-of-sequence token)
    assert ended.first_difference == 2
    assert ended.verdict() == (
        "check FAILED: tokens differ from position 2 of the new tokens (the swarm <ended> vs local 7); "
        "the swarm made 2 new tokens, local transformers 3"
    )


def test_a_failed_check_exits_with_status_1(capsys):
    client_cli.report_check(TokenCheck((1, 2), (1, 2)), str)
    assert capsys.readouterr().out.startswith("check: the swarm generated the same 2 new tokens")
    with pytest.raises(SystemExit) as exit_info:
        client_cli.report_check(TokenCheck((1, 2), (1, 3)), str, "float32, greedy")
    assert exit_info.value.code == 1
    out = capsys.readouterr().out
    assert out.startswith("check FAILED: tokens differ from position 1") and out.count("\n") == 1


def short(peer_id: str) -> str:
    return f"{peer_id[:6]}...{peer_id[-6:]}"


def test_chain_lines_name_servers_and_mark_failover_replacements():
    initial = [ChainHop(0, 3, PEER_A, "front"), ChainHop(3, 6, PEER_B, "")]
    assert chain_lines(initial, initial) == [
        "chain: 2 hops",
        f"  blocks 0:3  front ({short(PEER_A)})",
        f"  blocks 3:6  {short(PEER_B)}",  # no public name announced: the peer id alone
    ]
    final = [initial[0], ChainHop(3, 6, PEER_C, "spare\x1b[2J")]  # a name with a terminal escape
    assert chain_lines(initial, final) == [
        f"chain: 2 hops, after failover replaced blocks 3:6  {short(PEER_B)}",
        f"  blocks 0:3  front ({short(PEER_A)})",
        f"  blocks 3:6  spare?[2J ({short(PEER_C)})  (replacement)",
    ]
    assert chain_lines([ChainHop(0, 6)], [ChainHop(0, 6)]) == [
        "chain: 1 hop",
        "  blocks 0:6  this process (--local-spans)",
    ]


def test_speed_line():
    assert speed_line(24, 0.5, 0.25) == (
        "speed: 24 new tokens in 0.50 s = 48.0 tokens/s (prefill included; opening the session took 0.25 s)"
    )


def test_check_refuses_sampling_with_speculation(llama_dir, capsys):
    """Speculative sampling draws other random numbers than plain sampling: no token-exact check."""
    argv = [str(llama_dir), "--local-spans", "0:3,3:6", "--prompt", "hi", "--check", "--do-sample"]
    with pytest.raises(SystemExit) as exit_info:
        client_cli.main([*argv, "--prompt-lookup", "3"])
    assert exit_info.value.code == 2
    assert "--check with --do-sample cannot be exact" in capsys.readouterr().err


# --- streaming: transformers' TextStreamer gets the tokens as they are generated ------------------------
class RecordingStreamer(TextStreamer):
    """transformers' TextStreamer, also remembering each batch of token ids it was handed."""

    def __init__(self, tokenizer):
        super().__init__(tokenizer)
        self.puts: list[list[int]] = []

    def put(self, value: torch.Tensor) -> None:
        self.puts.append(value.reshape(-1).tolist())
        super().put(value)


@pytest.mark.parametrize("speculation", ["none", "lookup", "draft"])
def test_text_streams_while_generating(llama_dir, speculation, capsys):
    """The distributed model hands the streamer the prompt, then the new tokens step by step (speculation:
    round by round), and it prints exactly the generated text."""
    tokenizer = AutoTokenizer.from_pretrained(llama_dir)
    backend = LocalSpans([load_span(llama_dir, 0, 3)[0], load_span(llama_dir, 3, NUM_BLOCKS)[0]])
    model = DistributedModelForCausalLM.from_local_parts(llama_dir, backend)
    extra = {
        "none": {},
        "lookup": {"prompt_lookup_num_tokens": 3},
        "draft": {"assistant_model": AutoModelForCausalLM.from_pretrained(llama_dir).eval()},
    }[speculation]
    prompt = tokenizer("a b c a b c a b", return_tensors="pt").input_ids
    streamer = RecordingStreamer(tokenizer)
    output = model.generate(prompt, max_new_tokens=12, do_sample=False, streamer=streamer, **extra)
    assert streamer.puts[0] == prompt[0].tolist()
    assert len(streamer.puts) >= 3  # the prompt, then new tokens in more than one piece
    assert sum(streamer.puts[1:], []) == output[0, prompt.shape[1] :].tolist()
    assert capsys.readouterr().out == tokenizer.decode(output[0]) + "\n"
