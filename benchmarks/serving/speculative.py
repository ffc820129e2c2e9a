"""Speculative decoding through the swarm: tokens/s of plain greedy decoding against assisted decoding.

A tiny LLaMA (6 blocks) is served by three servers of two blocks each; the client runs, side by side
in one process and interleaved over `--repeats` rounds:

- plain greedy decoding (one token per round trip through the three hops);
- (a) a perfect draft: the full model run locally (the mechanism's ceiling);
- (b) a draft that agrees with the target about 70% of the time: the target with its weights
  perturbed by Gaussian noise, its scale calibrated here (the measured acceptance is reported);
- (c) prompt lookup (no draft model) on an input that repeats itself;
- (d) a draft that never agrees: the target with its LM head negated (it proposes the least likely
  token), which the adaptive draft length must turn off;
- batch 4: plain batched greedy against batched speculation with draft (b).

Every variant decodes `--tokens` new tokens greedily inside an already opened session (the time is
the `generate()` call: prompt, drafts and verification; the session's opening is excluded), and is
checked to produce exactly the plain greedy tokens. `--where netem` runs the swarm over emulated
links (root: network namespaces; a client site and three server sites, 40/50/60 ms round trips
between the client and the servers, 100 Mbit/s), `loopback` on this machine's loopback.

    sudo .venv/bin/python -m benchmarks.serving.speculative [--where both] [--tokens 64] [--repeats 3] \\
        [--write]
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import (
    add_report_options,
    measuring_parser,
    publish_table,
    run_measuring,
    run_measuring_client,
)

LAYERS = 6
SPANS = ("0:2", "2:4", "4:6")
PROMPT = [5, 17, 99, 200, 33, 41, 7, 250, 300, 12]
REPEATING = [257, 394] * 6  # an input that repeats itself (and a continuation that does too)
BATCH_PROMPTS = [PROMPT, [3, 9, 27, 81, 243, 11, 33, 99, 297, 380], [8] * 10, [100 + i for i in range(10)]]
RTTS_MS = {"s0": 40, "s1": 50, "s2": 60}  # client <-> each server site
COMPUTE_DELAY = 0.001  # seconds per block per step: a GPU's step, emulated
VARIANTS = ("plain", "perfect", "agrees_70", "prompt_lookup", "never_agrees")


# --- the measuring client (runs in the client's site) ---------------------------------------------------
def build_drafts(model_dir: Path, target_agreement: float = 0.7) -> dict:
    """The local draft models of variants (a), (b) and (d), and (b)'s measured agreement."""
    import torch
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    never = copy.deepcopy(reference)
    with torch.no_grad():
        never.lm_head.weight.neg_()
    sequence = reference.generate(torch.tensor([PROMPT]), max_new_tokens=128, do_sample=False)

    def agreement(model) -> float:
        with torch.no_grad():
            ours = model(sequence).logits.argmax(-1)[0, len(PROMPT) - 1 : -1]
            theirs = reference(sequence).logits.argmax(-1)[0, len(PROMPT) - 1 : -1]
        return float((ours == theirs).float().mean())

    def perturbed(scale: float):
        model = copy.deepcopy(reference)
        generator = torch.Generator().manual_seed(7)
        with torch.no_grad():
            for parameter in model.parameters():
                noise = torch.randn(parameter.shape, generator=generator) * parameter.std() * scale
                parameter.add_(noise)
        return model.eval()

    low, high = 0.0, 2.0  # bisect the noise scale for the wanted agreement
    for _ in range(14):
        middle = (low + high) / 2
        if agreement(perturbed(middle)) > target_agreement:
            low = middle
        else:
            high = middle
    agrees = perturbed((low + high) / 2)
    return {
        "reference": reference,
        "agrees_70": agrees,
        "agrees_70_agreement": agreement(agrees),
        "never_agrees": never,
        "never_agreement": agreement(never),
    }


def timed_generate(model, prompt, extra: dict, tokens: int):
    import torch

    input_ids = torch.tensor(prompt)
    room = input_ids.shape[1] + 3 * tokens  # batched speculation leaves masked positions behind
    with model.inference_session(max_length=room, batch_size=input_ids.shape[0]) as session:
        started = time.perf_counter()
        output = model.generate(input_ids, max_new_tokens=tokens, do_sample=False, pad_token_id=0, **extra)
        seconds = time.perf_counter() - started
        stats = session.draft_stats
    new = output.shape[1] - input_ids.shape[1]
    acceptance = stats.token_acceptance if stats is not None else None
    rounds = stats.rounds if stats is not None else 0
    return output, input_ids.shape[0] * new / seconds, acceptance, rounds


def measure(args: argparse.Namespace) -> None:
    import torch

    from llm_swarm.client import AutoDistributedModelForCausalLM

    torch.set_num_threads(1)
    drafts = build_drafts(Path(args.model_dir))
    model = AutoDistributedModelForCausalLM.from_pretrained(args.model_dir, args.initial_peers)
    extras = {
        "plain": {},
        "perfect": {"assistant_model": drafts["reference"]},
        "agrees_70": {"assistant_model": drafts["agrees_70"]},
        "prompt_lookup": {"prompt_lookup_num_tokens": 8},
        "never_agrees": {"assistant_model": drafts["never_agrees"]},
    }
    results: dict[str, list] = {}
    try:
        expected = {}
        for prompt in ([PROMPT], [REPEATING], BATCH_PROMPTS):  # warm up; the plain outputs to compare with
            expected[str(prompt)] = timed_generate(model, prompt, {}, args.tokens)[0]
        for _ in range(args.repeats):  # interleaved: every variant sees the same moments of the host
            for name in VARIANTS:
                prompt = [REPEATING] if name == "prompt_lookup" else [PROMPT]
                plain_key = "plain_repeating" if name == "prompt_lookup" else "plain"
                if name == "prompt_lookup":
                    output, rate, _, _ = timed_generate(model, prompt, {}, args.tokens)
                    results.setdefault(plain_key, []).append({"rate": rate})
                output, rate, acceptance, rounds = timed_generate(model, prompt, extras[name], args.tokens)
                if not torch.equal(output, expected[str(prompt)]):
                    raise SystemExit(f"{name}: the output differs from plain greedy decoding")
                results.setdefault(name, []).append(
                    {"rate": rate, "acceptance": acceptance, "rounds": rounds}
                )
            for name, extra in (("batch_plain", {}), ("batch_agrees_70", extras["agrees_70"])):
                output, rate, acceptance, rounds = timed_generate(model, BATCH_PROMPTS, extra, args.tokens)
                if not torch.equal(output, expected[str(BATCH_PROMPTS)]):
                    raise SystemExit(f"{name}: the output differs from plain batched greedy decoding")
                results.setdefault(name, []).append(
                    {"rate": rate, "acceptance": acceptance, "rounds": rounds}
                )
    finally:
        model.shutdown()
    results["calibration"] = {
        "agrees_70_teacher_forced": drafts["agrees_70_agreement"],
        "never_agrees_teacher_forced": drafts["never_agreement"],
    }
    Path(args.out).write_text(json.dumps(results))


# --- the swarms ---------------------------------------------------------------------------------------------
def build_model(work: Path) -> Path:
    from llm_swarm.swarm.models.tiny import TinyModelSpec, build_tiny_model

    return build_tiny_model(
        work / "tiny-llama", TinyModelSpec(family="llama", num_layers=LAYERS, num_kv_heads=2)
    )


def measure_argv(model_dir: Path, peers: list[str], out: Path, args: argparse.Namespace) -> list[str]:
    return [
        sys.executable, str(Path(__file__).resolve()), "measure", "--model-dir", str(model_dir),
        "--initial-peers", *peers, "--out", str(out), "--tokens", str(args.tokens),
        "--repeats", str(args.repeats),
    ]  # fmt: skip


def run_loopback(work: Path, model_dir: Path, args: argparse.Namespace) -> dict:
    from harness.local_swarm import LocalSwarm
    from llm_swarm.swarm.dht_keys import default_prefix

    (work / "loopback").mkdir()
    swarm = LocalSwarm(work / "loopback")
    try:
        swarm.start_dht()
        names = [f"server-{span}" for span in SPANS]
        for name, span in zip(names, SPANS, strict=True):
            swarm.start_server(name, model_dir, span, "1GB", "--compute-delay", repr(COMPUTE_DELAY))
        swarm.wait_online(default_prefix(str(model_dir)), LAYERS, names)
        out = work / "loopback.json"
        subprocess.run(measure_argv(model_dir, swarm.initial_peers, out, args), check=True)
        return json.loads(out.read_text())
    finally:
        swarm.close()


def netem_scenario() -> dict:
    pairs = [
        {"sites": ["client", site], "rtt_ms": rtt, "bandwidth_mbit": 100} for site, rtt in RTTS_MS.items()
    ]
    pairs += [
        {"sites": ["s0", "s1"], "rtt_ms": 45, "bandwidth_mbit": 100},
        {"sites": ["s0", "s2"], "rtt_ms": 55, "bandwidth_mbit": 100},
        {"sites": ["s1", "s2"], "rtt_ms": 50, "bandwidth_mbit": 100},
    ]
    return {
        "name": "speculative",
        "description": "a client and three server sites, 40-60 ms apart",
        "links": {"pairs": pairs},
        "model": {"family": "llama", "layers": LAYERS, "hidden": 64, "heads": 4, "kv_heads": 2},
        "sites": [
            {"name": "client", "group": "c", "processes": [{"role": "dht", "name": "dht"}]},
            *({"name": site, "group": site, "processes": []} for site in RTTS_MS),
        ],
    }


def run_netem(work: Path, model_dir: Path, args: argparse.Namespace) -> dict:
    from benchmarks.netem.emulator import Emulation
    from benchmarks.netem.scenario import parse_scenario

    scenario = parse_scenario(netem_scenario(), "bench_speculative")
    with Emulation(scenario, work / "netem") as emulation:
        emulation.start_dht("client")
        names = []
        for site, span in zip(RTTS_MS, SPANS, strict=True):
            names.append(f"server-{site}")
            emulation.start_server(names[-1], site, model_dir, span, "1GB", COMPUTE_DELAY)
        emulation.wait_online("client", model_dir, names)
        out = work / "netem.json"
        return run_measuring_client(
            emulation, measure_argv(model_dir, emulation.initial_peers, out, args), out
        )


# --- the report ---------------------------------------------------------------------------------------------
LABELS = {
    "perfect": "(a) perfect draft (the full model, local)",
    "agrees_70": "(b) draft agreeing ~70% (perturbed weights)",
    "prompt_lookup": "(c) prompt lookup, repeating input",
    "never_agrees": "(d) draft that never agrees",
    "batch_agrees_70": "batch 4, draft (b)",
}
BASELINE = {"prompt_lookup": "plain_repeating", "batch_agrees_70": "batch_plain"}


def table(results: dict[str, dict]) -> list[str]:
    lines = [
        "| variant | where | plain tokens/s | speculative tokens/s | ratio | per-token acceptance | rounds |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, label in LABELS.items():
        for where, runs in results.items():
            base = statistics.median(run["rate"] for run in runs[BASELINE.get(name, "plain")])
            rate = statistics.median(run["rate"] for run in runs[name])
            acceptance = [run["acceptance"] for run in runs[name] if run["acceptance"] is not None]
            accepted = f"{statistics.median(acceptance):.0%}" if acceptance else "-"
            rounds = statistics.median(run["rounds"] for run in runs[name])
            cells = [
                label,
                where,
                f"{base:.1f}",
                f"{rate:.1f}",
                f"{rate / base:.2f}x",
                accepted,
                f"{rounds:.0f}",
            ]
            lines.append("| " + " | ".join(cells) + " |")
    return lines


def shared_options(options: argparse.ArgumentParser) -> None:
    """The options the benchmark passes on to its measuring client."""
    options.add_argument("--tokens", type=int, default=64)
    options.add_argument("--repeats", type=int, default=3)


def main() -> None:
    parser = measuring_parser(__doc__, "--model-dir", "--out", shared=shared_options)
    parser.add_argument("--where", choices=("both", "netem", "loopback"), default="both")
    add_report_options(parser)
    run_measuring(parser, measure, benchmark)


def benchmark(args: argparse.Namespace) -> None:
    results = {}
    with tempfile.TemporaryDirectory(prefix="bench-speculative-") as work:
        model_dir = build_model(Path(work))
        if args.where in ("both", "netem"):
            results["netem"] = run_netem(Path(work), model_dir, args)
        if args.where in ("both", "loopback"):
            results["loopback"] = run_loopback(Path(work), model_dir, args)
    calibration = {where: runs.pop("calibration") for where, runs in results.items()}
    text = (
        f"A tiny LLaMA ({LAYERS} blocks) on three servers of two blocks each ({COMPUTE_DELAY * 1e3:.0f} ms "
        f"emulated compute per block per step); {args.tokens} new tokens per generation, greedy, in an "
        "opened session; the median of "
        f"{args.repeats} interleaved runs. netem: client-to-server round trips of "
        f"{', '.join(f'{rtt} ms' for rtt in RTTS_MS.values())}, 100 Mbit/s. Every speculative output was "
        "checked equal to plain greedy decoding. Draft (b)'s teacher-forced agreement with the target: "
        + ", ".join(
            f"{where} {values['agrees_70_teacher_forced']:.0%}" for where, values in calibration.items()
        )
        + "; draft (d)'s: "
        + ", ".join(
            f"{where} {values['never_agrees_teacher_forced']:.0%}" for where, values in calibration.items()
        )
        + ". 'per-token acceptance' is accepted draft tokens over those compared with the target's choice "
        "(a round's drafts after its first rejection are not compared); 'rounds' counts verification "
        "rounds that carried drafts (the rest were plain steps chosen by the adaptive draft length). On "
        "loopback a round trip costs about what the servers' compute costs, so speculation gains less; "
        "there the adaptive draft length keeps a useless draft (d), and a batch whose verification steps "
        "run as prefills rather than batched decodes, near 1x."
    )
    options = argparse.Namespace(where=args.where, tokens=args.tokens, repeats=args.repeats, write=args.write)
    publish_table(__file__, options, table(results), "## Speculative decoding", text)


if __name__ == "__main__":
    main()
