"""Per-token latency through 2- and 3-server chains on loopback, against the same blocks run locally,
with every stream over libp2p and with direct streams, side by side.

The per-hop overhead is what the swarm adds per server per token: serialization, the round trip
(through two p2p daemons over libp2p; one TLS connection over a direct stream) and the server's
validation and scheduling. For each chain length two swarms run at once, one whose servers serve
libp2p only (`--no-direct-streams`), one with direct streams, and generations alternate between
them. The tail is the worst token of each generation over that generation's median.

    .venv/bin/python -m benchmarks.serving.latency [--tokens 64] [--runs 3] [--hidden 64] [--layers 6]

Prints p50/p95 per-token latency for each setting, the overhead per hop and the tail; `--write` puts
the table into BENCHMARKS.md.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import parse_bench_args, publish_table
from benchmarks.serving.timing import TokenClock, percentile
from harness.local_swarm import LocalSwarm
from llm_swarm.client import ClientOptions
from llm_swarm.client.backend import LocalSpans
from llm_swarm.client.model import DistributedModelForCausalLM
from llm_swarm.swarm.dht_keys import default_prefix
from llm_swarm.swarm.models import load_span
from llm_swarm.swarm.models.tiny import TinyModelSpec, build_tiny_model

CHAINS = {2: ["0:3", "3:6"], 3: ["0:2", "2:4", "4:6"]}
# a loaded machine's loopback pings may take tens of ms: in the direct swarm every peer counts as near
PATHS = {"libp2p": ("--no-direct-streams",), "direct": ("--direct-max-rtt", "1")}
PING_ROUND_WAIT = 3.0  # servers learn the next servers' direct addresses in a ping round 2 s after start


def generation_intervals(model: DistributedModelForCausalLM, tokens: int) -> list[float]:
    clock = TokenClock()
    model.generate(PROMPT, max_new_tokens=tokens, do_sample=False, streamer=clock)
    return clock.intervals()


PROMPT = torch.tensor([[5, 17, 99, 200, 33, 41, 7]])


def start_swarm(scratch: Path, model_dir: Path, layers: int, hops: int, path: str) -> LocalSwarm:
    log_dir = scratch / f"swarm-{hops}-{path}"
    log_dir.mkdir()
    swarm = LocalSwarm(log_dir)
    swarm.start_dht()
    names = [f"bench{hops}-{path}-{i}" for i in range(hops)]
    for name, span in zip(names, CHAINS[hops], strict=True):
        swarm.start_server(name, model_dir, span, "1GB", *PATHS[path])
    swarm.wait_online(default_prefix(str(model_dir)), layers, names)
    return swarm


def main() -> None:
    args = parse_bench_args(__doc__, tokens=64, runs=3, hidden=64, layers=6)
    torch.set_num_threads(1)
    results: dict[str, list[float]] = {}
    tails: dict[str, list[float]] = {}

    with tempfile.TemporaryDirectory() as scratch:
        model_dir = Path(scratch) / "bench-llama"
        spec = TinyModelSpec(family="llama", num_layers=args.layers, hidden_size=args.hidden, num_kv_heads=2)
        build_tiny_model(model_dir, spec)
        local = DistributedModelForCausalLM.from_local_parts(
            model_dir, LocalSpans([load_span(model_dir, 0, args.layers)[0]])
        )
        generation_intervals(local, 4)
        results["local"] = [x for _ in range(args.runs) for x in generation_intervals(local, args.tokens)]
        for hops in CHAINS:
            swarms, models = {}, {}
            try:
                for path in PATHS:
                    swarms[path] = start_swarm(Path(scratch), model_dir, args.layers, hops, path)
                    models[path] = DistributedModelForCausalLM.from_pretrained(
                        model_dir, swarms[path].initial_peers, options=ClientOptions(direct_max_rtt=1.0)
                    )
                    generation_intervals(models[path], 4)  # warm-up: connections, routing, caches
                time.sleep(PING_ROUND_WAIT)
                for run in range(args.runs):
                    for path in list(PATHS)[:: 1 if run % 2 == 0 else -1]:  # who goes first alternates
                        intervals = generation_intervals(models[path], args.tokens)
                        results.setdefault(f"{hops} servers, {path}", []).extend(intervals)
                        tails.setdefault(f"{hops} servers, {path}", []).append(
                            max(intervals) / statistics.median(intervals)
                        )
            finally:
                for model in models.values():
                    model.shutdown()
                for swarm in swarms.values():
                    swarm.close()

    local_p50 = statistics.median(results["local"])
    lines = [
        "| setting | per-token p50 (ms) | p95 (ms) | overhead per hop, p50 (ms) | worst token / median, "
        "per generation |",
        "|---|---|---|---|---|",
    ]
    for name, samples in results.items():
        p50, p95 = statistics.median(samples), percentile(samples, 95)
        hops = int(name.split()[0]) if name != "local" else 0
        overhead = f"{(p50 - local_p50) / hops * 1e3:.2f}" if hops else "-"
        tail = ", ".join(f"{ratio:.1f}x" for ratio in tails[name]) if name in tails else "-"
        lines.append(f"| {name} | {p50 * 1e3:.2f} | {p95 * 1e3:.2f} | {overhead} | {tail} |")
    publish_table(
        __file__,
        args,
        lines,
        "## Per-token latency through a chain",
        f"Tiny LLaMA-GQA ({args.layers} blocks, hidden {args.hidden}), greedy decoding, chain sessions "
        "(servers push each token on), servers and client on loopback on this 2-core machine, one torch "
        "thread each. `local` runs the same blocks in-process through the same client code; the "
        "overhead per hop is (chain p50 - local p50) / servers. For each chain length a swarm serving "
        "libp2p only and one with direct streams run at once, their generations alternating "
        f"({args.runs} of {args.tokens} tokens each). Target: <= 0.5 ms per hop per token over the "
        "transport's floor (`Where a hop's time goes on one host`); worst token <= 2x the median.",
    )


if __name__ == "__main__":
    main()
