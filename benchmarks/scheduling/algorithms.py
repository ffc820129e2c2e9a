"""Time the placement and routing algorithms on synthetic swarms, print a Markdown report.

    .venv/bin/python -m benchmarks.scheduling.algorithms [--seed 0] [--quick]

Swarms: L = 80 blocks of BLOOM-176B's size in NF4 (s_m = 1.32 GB; s_c = 8.5 MB, the cache of
l_in + l_out = 148 tokens at d = 14336), so no server holds the whole model and chains have several
hops; servers are 20 % A100-80GB-like (tau 3.2 ms) and 80 % 24/40 GB cards (tau 8-16 ms), with
per-token RTTs of 5-200 ms to 10 clients. Targets: CG-BP on 1,000
servers < 50 ms; a WS-RR query < 5 ms (p50) with 1,000 servers and 5,000 active sessions; GCA on
200 servers < 1 s.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable

from benchmarks.common import bench_parser
from llm_swarm.scheduler.algorithms.cgbp import cg_bp
from llm_swarm.scheduler.algorithms.chains import gbp_cr, gca
from llm_swarm.scheduler.algorithms.problem import ModelSpec, ServerSpec
from llm_swarm.scheduler.algorithms.wsrr import RoutingState

MODEL = ModelSpec(num_blocks=80, block_bytes=1.3234e9, cache_bytes=2 * 14336 * 148 * 2)
CLIENTS = [f"c{k}" for k in range(10)]
REQUESTS = 16  # CG-BP's R
CAPACITY = 8  # GBP-CR's c
L_OUT = 128


def make_servers(count: int, rng: random.Random) -> list[ServerSpec]:
    servers = []
    for j in range(count):
        fast = rng.random() < 0.2
        memory = 80e9 if fast else rng.choice([24e9, 40e9])
        tau = 0.0032 if fast else rng.uniform(0.008, 0.016)
        rtt = {client: rng.uniform(0.005, 0.2) for client in CLIENTS}
        servers.append(
            ServerSpec(
                f"s{j}",
                memory,
                tau=tau,
                tau_prefill=3 * tau,
                rtt=rtt,
                rtt_prefill={c: 1.2 * t for c, t in rtt.items()},
                tau_c=L_OUT * rtt[CLIENTS[0]],  # Sun, He and Hou: the orchestrator relays every token
                tau_p=L_OUT * tau,
            )
        )
    return servers


def timed(function: Callable[[], object], repeats: int) -> tuple[float, object]:
    """Median wall time (seconds) over `repeats` runs, and the last result."""
    times, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = function()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def against(seconds: float, target: float, unit: str, scale: float) -> str:
    """`22.3 ms / 50 ms = 0.45 (met)`: a measurement as a fraction of its target."""
    verdict = "met" if seconds < target else "MISSED"
    return f"{seconds * scale:.3g} {unit} / {target * scale:g} {unit} = {seconds / target:.2f} ({verdict})"


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(int(fraction * len(ordered)), len(ordered) - 1)]


def bench_cg_bp(sizes: list[int], rng: random.Random) -> list[str]:
    rows = ["| servers | CG-BP time (ms) | x previous size | target |", "|---:|---:|---:|---|"]
    previous = None
    for size in sizes:
        servers = make_servers(size, rng)
        seconds, result = timed(lambda s=servers: cg_bp(s, MODEL, REQUESTS), repeats=5 if size <= 1000 else 1)
        assert result.feasible, f"bench swarm of {size} servers is infeasible"
        ratio = f"{seconds / previous:.1f}" if previous else "-"
        target = against(seconds, 0.05, "ms", 1e3) if size == 1000 else ""
        rows.append(f"| {size:,} | {seconds * 1e3:.2f} | {ratio} | {target} |")
        previous = seconds
    return rows


def bench_ws_rr(sizes: list[int], rng: random.Random, queries: int) -> list[str]:
    columns = [
        "servers",
        "active sessions",
        "query p50 (ms)",
        "query p95 (ms)",
        "admit p50 (ms)",
        "routes that wait",
    ]
    rows = ["| " + " | ".join(columns) + " | target |", "|---:|---:|---:|---:|---:|---:|---|"]
    for size in sizes:
        servers = make_servers(size, rng)
        placement = cg_bp(servers, MODEL, REQUESTS).spans
        state = RoutingState(servers, MODEL, placement)
        sessions = min(5 * size, 5000)
        now, admit_times = 0.0, []
        for session in range(sessions):  # the sessions arrive one by one and are routed by WS-RR
            now += rng.expovariate(sessions / 60.0)
            route = state.route(rng.choice(CLIENTS), L_OUT, now)
            start = time.perf_counter()
            state.admit(session, route, now)
            admit_times.append(time.perf_counter() - start)
        query_times, waiting = [], 0
        for _ in range(queries):
            start = time.perf_counter()
            route = state.route(rng.choice(CLIENTS), L_OUT, now)
            query_times.append(time.perf_counter() - start)
            waiting += route.wait > 0
        p50, p95 = percentile(query_times, 0.5), percentile(query_times, 0.95)
        target = "p50 " + against(p50, 0.005, "ms", 1e3) if size == 1000 else ""
        rows.append(
            f"| {size:,} | {sessions:,} | {p50 * 1e3:.2f} | {p95 * 1e3:.2f} | "
            f"{percentile(admit_times, 0.5) * 1e3:.3f} | {waiting}/{queries} | {target} |"
        )
    return rows


def bench_gca(sizes: list[int], rng: random.Random) -> list[str]:
    rows = ["| servers | GCA time (s) | chains | x previous size | target |", "|---:|---:|---:|---:|---|"]
    previous = None
    for size in sizes:
        servers = make_servers(size, rng)
        placement = gbp_cr(servers, MODEL, CAPACITY).spans
        repeats = 3 if size <= 200 else 1
        seconds, chains = timed(lambda s=servers, p=placement: gca(s, MODEL, p), repeats)
        ratio = f"{seconds / previous:.1f}" if previous else "-"
        target = against(seconds, 1.0, "s", 1) if size == 200 else ""
        rows.append(f"| {size:,} | {seconds:.3f} | {len(chains):,} | {ratio} | {target} |")
        previous = seconds
    return rows


def main() -> None:
    parser = bench_parser(__doc__, seed=0)
    parser.add_argument("--quick", action="store_true", help="skip the largest sizes")
    args = parser.parse_args()
    big = [] if args.quick else [10_000]

    print(f"L = {MODEL.num_blocks}, R = {REQUESTS} (CG-BP), c = {CAPACITY} (GBP-CR), l_out = {L_OUT}\n")
    print("### CG-BP placement\n")
    print("\n".join(bench_cg_bp([10, 100, 1000, *big], random.Random(args.seed))))
    print("\n### WS-RR routing query (sessions = 5 x servers, at most 5,000)\n")
    print("\n".join(bench_ws_rr([10, 100, 1000, *big], random.Random(args.seed), queries=500)))
    print("\n### GCA cache allocation (on a GBP-CR placement using every server)\n")
    print("\n".join(bench_gca([10, 100, 200] + ([] if args.quick else [1000]), random.Random(args.seed))))


if __name__ == "__main__":
    main()
