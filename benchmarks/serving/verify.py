"""What replica verification costs: per-token latency and throughput with verify 0, 0.1, 1.0.

    .venv/bin/python -m benchmarks.serving.verify [--rounds 2] [--tokens 64] [--sessions 4] [--write]

One swarm on loopback: a DHT and two replicas of each of two spans (0:3 twice, 3:6 twice) of a tiny
LLaMA-GQA, so that every hop has a verifier. Each round runs every level with a fresh client, in a
rotating order, so that load from elsewhere on this shared machine hits all levels alike:
- latency: one session, greedy, `--tokens` decode steps, per-token p50/p95;
- throughput: `--sessions` concurrent sessions of one client, decode tokens per second of the whole
  run (what the swarm delivers; verification work on the replicas comes out of it).
"""

from __future__ import annotations

import functools
import statistics
import tempfile
from pathlib import Path

import torch
from tqdm import tqdm

from benchmarks.common import parse_bench_args, publish_table, run_concurrently, serving_swarm
from benchmarks.serving.timing import TokenClock, percentile
from harness.local_swarm import LocalSwarm
from llm_swarm.client import AutoDistributedModelForCausalLM, ClientOptions
from llm_swarm.swarm.models.tiny import TinyModelSpec, build_tiny_model

LEVELS = (0.0, 0.1, 1.0)
SERVERS = {"a1": "0:3", "a2": "0:3", "b1": "3:6", "b2": "3:6"}
PROMPT = torch.tensor([[5, 17, 99, 200, 33, 41, 7]])


def latency(model, tokens: int) -> list[float]:
    model.generate(PROMPT, max_new_tokens=4, do_sample=False)  # warm-up: connections, replicas
    clock = TokenClock()
    model.generate(PROMPT, max_new_tokens=tokens, do_sample=False, streamer=clock)
    return clock.intervals()


def throughput(model, sessions: int, tokens: int) -> float:
    def run(seed: int) -> None:
        prompt = torch.tensor([[5 + seed, 17, 99, 200]])
        model.generate(prompt, max_new_tokens=tokens, do_sample=False)

    seconds = run_concurrently([functools.partial(run, index) for index in range(sessions)])
    return sessions * (tokens - 1) / seconds


def main() -> None:
    args = parse_bench_args(__doc__, rounds=2, tokens=64, sessions=4)
    torch.set_num_threads(1)
    steps = {level: [] for level in LEVELS}
    rates = {level: [] for level in LEVELS}
    with tempfile.TemporaryDirectory() as scratch:
        model_dir = Path(scratch) / "bench-llama"
        build_tiny_model(model_dir, TinyModelSpec(family="llama", num_layers=6, num_kv_heads=2))
        with serving_swarm(LocalSwarm(Path(scratch)), model_dir, SERVERS, 6) as swarm:
            with tqdm(total=args.rounds * len(LEVELS), desc="verify levels", unit="run") as progress:
                for round_index in range(args.rounds):
                    shift = round_index % len(LEVELS)
                    for level in LEVELS[shift:] + LEVELS[:shift]:
                        options = ClientOptions(verify_fraction=level)
                        model = AutoDistributedModelForCausalLM.from_pretrained(
                            model_dir, swarm.initial_peers, options=options
                        )
                        try:
                            steps[level] += latency(model, args.tokens)
                            rates[level].append(throughput(model, args.sessions, args.tokens // 2))
                            if model.backend.connection.bans.caught:
                                raise RuntimeError(f"an honest server was outvoted at verify {level}")
                        finally:
                            model.shutdown()
                        progress.update()

    base_p50, base_rate = statistics.median(steps[0.0]), statistics.median(rates[0.0])
    lines = [
        "| verify fraction | per-token p50 (ms) | p95 (ms) | p50 vs 0 | "
        f"throughput, {args.sessions} sessions (tok/s) | vs 0 |",
        "|---|---|---|---|---|---|",
    ]
    for level in LEVELS:
        p50, p95, rate = (
            statistics.median(steps[level]),
            percentile(steps[level], 95),
            statistics.median(rates[level]),
        )
        lines.append(
            f"| {level:g} | {p50 * 1e3:.2f} | {p95 * 1e3:.2f} | {p50 / base_p50:.2f}x | {rate:.1f} | "
            f"{rate / base_rate:.2f}x |"
        )
    publish_table(
        __file__,
        args,
        lines,
        "## What replica verification costs",
        "One swarm on loopback on this shared 2-core machine: a DHT and two replicas of each of two spans "
        "(0:3, 0:3, 3:6, 3:6) of a tiny LLaMA-GQA (6 blocks, hidden 64), one torch thread each. Each of "
        f"{args.rounds} rounds runs every level with a fresh client, in a rotating order. Latency: one "
        "session, greedy, per decode step. Throughput: "
        f"{args.sessions} concurrent sessions of {args.tokens // 2} tokens; the replicas' extra work "
        "comes out of the same CPU, as it would out of the same swarm. A verified step waits for both "
        "replicas (they run in parallel), so its latency is the slower of the two.",
    )


if __name__ == "__main__":
    main()
