"""Recovery time after a server is SIGKILLed mid-session: kill -> next token, on loopback.

A session runs through A(0:3) -> B(3:6) with a standby A2(0:3) online; after `--before` tokens
A is killed, and the time until the next token arrives is measured (it includes detecting the
broken stream, banning A, routing to A2, opening a stream and replaying the history).

    .venv/bin/python -m benchmarks.serving.failover [--runs 5] [--before 20] [--write]
"""

from __future__ import annotations

import argparse
import signal
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.markdown import write_section
from benchmarks.serving.timing import TokenClock
from harness.local_swarm import LocalSwarm
from llm_swarm.client import AutoDistributedModelForCausalLM
from llm_swarm.swarm.dht_keys import default_prefix
from llm_swarm.swarm.models.tiny import TinyModelSpec, build_tiny_model

LAYERS = 6


def one_run(model_dir: Path, log_dir: Path, before: int) -> tuple[float, float]:
    prefix = default_prefix(str(model_dir))
    swarm = LocalSwarm(log_dir)
    try:
        swarm.start_dht()
        swarm.start_server("a", model_dir, "0:3")
        swarm.start_server("b", model_dir, "3:6")
        swarm.wait_online(prefix, LAYERS, ["a", "b"])
        model = AutoDistributedModelForCausalLM.from_pretrained(model_dir, swarm.initial_peers)
        try:
            prompt = torch.tensor([[5, 17, 99, 200, 33, 41, 7]])
            with model.inference_session(max_length=before + 32) as session:
                sequence = model.generate(prompt, max_new_tokens=before, do_sample=False, session=session)
                swarm.start_server("a2", model_dir, "0:3")
                swarm.wait_online(prefix, LAYERS, ["a2"])
                clock = TokenClock()
                started = time.perf_counter()
                sequence = model.generate(
                    sequence, max_new_tokens=1, do_sample=False, session=session, streamer=clock
                )
                normal = clock.first - started  # one token with every server alive
                swarm.stop("a", signal.SIGKILL)
                killed_at = time.perf_counter()
                clock = TokenClock()
                model.generate(sequence, max_new_tokens=1, do_sample=False, session=session, streamer=clock)
                return clock.first - killed_at, normal
        finally:
            model.shutdown()
    finally:
        swarm.close()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--before", type=int, default=20, help="tokens generated before the kill")
    parser.add_argument("--write", action="store_true", help="write the result into BENCHMARKS.md")
    args = parser.parse_args()
    recoveries, normals = [], []
    with tempfile.TemporaryDirectory() as scratch:
        model_dir = Path(scratch) / "failover-llama"
        build_tiny_model(model_dir, TinyModelSpec(family="llama", num_layers=LAYERS, num_kv_heads=2))
        for run in range(args.runs):
            log_dir = Path(scratch) / f"run{run}"
            log_dir.mkdir()
            recovery, normal = one_run(model_dir, log_dir, args.before)
            recoveries.append(recovery)
            normals.append(normal)
            print(
                f"run {run}: kill -> next token {recovery * 1e3:.1f} ms (a token without failure: "
                f"{normal * 1e3:.1f} ms)",
                flush=True,
            )
    summary = (
        f"kill -> next token over {args.runs} runs (after {args.before} tokens, replaying them): "
        f"p50 {statistics.median(recoveries) * 1e3:.1f} ms, max {max(recoveries) * 1e3:.1f} ms; "
        f"a token without failure: p50 {statistics.median(normals) * 1e3:.1f} ms"
    )
    print(summary)
    if args.write:
        header = "## Failover recovery time"
        body = (
            f"{header}\n\nCommand: `.venv/bin/python -m benchmarks.serving.failover --runs {args.runs} "
            f"--before {args.before} --write`\n\nA session through A(0:3) -> B(3:6) with a standby A2(0:3) "
            "online; A is SIGKILLed between two tokens. The recovery includes detecting the broken stream, "
            "banning A, routing to A2, opening a stream there and replaying every step A had received, "
            "step by step (bit-identical caches).\n\n"
            f"{summary}\n"
        )
        write_section(header, body)


if __name__ == "__main__":
    main()
