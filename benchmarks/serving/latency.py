"""Per-token latency through 2- and 3-server chains on loopback, against the same blocks run locally.

The per-hop overhead is what the swarm adds per server per token: serialization, the P2P round
trip through two p2pd daemons, and the server's validation and scheduling.

    .venv/bin/python -m benchmarks.serving.latency [--tokens 64] [--runs 3] [--hidden 64] [--layers 6]

Prints p50/p95 per-token latency for each setting and the overhead per hop; `--write` puts the
table into BENCHMARKS.md.
"""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path

import torch

from benchmarks.common import parse_bench_args, publish_table
from benchmarks.serving.timing import TokenClock, percentile
from harness.local_swarm import LocalSwarm
from llm_swarm.client.backend import LocalSpans
from llm_swarm.client.model import DistributedModelForCausalLM
from llm_swarm.swarm.dht_keys import default_prefix
from llm_swarm.swarm.models import load_span
from llm_swarm.swarm.models.tiny import TinyModelSpec, build_tiny_model

CHAINS = {2: ["0:3", "3:6"], 3: ["0:2", "2:4", "4:6"]}


def decode_latencies(model: DistributedModelForCausalLM, tokens: int, runs: int) -> list[float]:
    prompt = torch.tensor([[5, 17, 99, 200, 33, 41, 7]])
    model.generate(prompt, max_new_tokens=4, do_sample=False)  # warm-up: connections, routing, caches
    samples: list[float] = []
    for _ in range(runs):
        clock = TokenClock()
        model.generate(prompt, max_new_tokens=tokens, do_sample=False, streamer=clock)
        samples.extend(clock.intervals())
    return samples


def main() -> None:
    args = parse_bench_args(__doc__, tokens=64, runs=3, hidden=64, layers=6)
    torch.set_num_threads(1)

    with tempfile.TemporaryDirectory() as scratch:
        model_dir = Path(scratch) / "bench-llama"
        spec = TinyModelSpec(family="llama", num_layers=args.layers, hidden_size=args.hidden, num_kv_heads=2)
        build_tiny_model(model_dir, spec)
        local = DistributedModelForCausalLM.from_local_parts(
            model_dir, LocalSpans([load_span(model_dir, 0, args.layers)[0]])
        )
        results = {"local": decode_latencies(local, args.tokens, args.runs)}
        for hops, spans in CHAINS.items():
            log_dir = Path(scratch) / f"swarm-{hops}"
            log_dir.mkdir()
            swarm = LocalSwarm(log_dir)
            try:
                swarm.start_dht()
                names = [f"bench{hops}-{i}" for i in range(hops)]
                for name, span in zip(names, spans, strict=True):
                    swarm.start_server(name, model_dir, span)
                swarm.wait_online(default_prefix(str(model_dir)), args.layers, names)
                remote = DistributedModelForCausalLM.from_pretrained(model_dir, swarm.initial_peers)
                try:
                    results[f"{hops} servers"] = decode_latencies(remote, args.tokens, args.runs)
                finally:
                    remote.shutdown()
            finally:
                swarm.close()

    local_p50 = statistics.median(results["local"])
    lines = [
        "| setting | per-token p50 (ms) | p95 (ms) | overhead per hop, p50 (ms) |",
        "|---|---|---|---|",
    ]
    for name, samples in results.items():
        p50, p95 = statistics.median(samples), percentile(samples, 95)
        hops = int(name.split()[0]) if name != "local" else 0
        overhead = f"{(p50 - local_p50) / hops * 1e3:.2f}" if hops else "-"
        lines.append(f"| {name} | {p50 * 1e3:.2f} | {p95 * 1e3:.2f} | {overhead} |")
    publish_table(
        __file__,
        args,
        lines,
        "## Per-token latency through a chain",
        f"Tiny LLaMA-GQA ({args.layers} blocks, hidden {args.hidden}), "
        "greedy decoding, servers and client on loopback on this 2-core machine, one torch thread each. "
        "`local` runs the same blocks in-process through the same client code; the overhead per hop is "
        "(chain p50 - local p50) / servers. Target: <= 3 ms per hop per token (PETALS budgets 18 ms).",
    )


if __name__ == "__main__":
    main()
