"""`swarm-sim`: run the discrete-event swarm simulator (docs/reference.md 1) and print the metrics of
docs/reference.md 6.

Example:
    swarm-sim --scenario clustered --policy cg-bp --client-cluster 0 --rate 0.5 \\
        --l-in 20 --l-out 128 --requests 100 --seeds 20 --json
    swarm-sim --scenario abovenet --sweep l-out --seeds 5 --out results/sweeps
    swarm-sim --scenario clustered --setup none --slo-ttft 5 --slo-tpot 1 --goodput --seeds 3
    swarm-sim --scenario ripe --arrivals azure --l-in 2048 --l-out 128 --requests 1000 --policy chains
    swarm-sim --scenario ripe --arrivals azure --l-in 8192 --requests 1000 --length-info predicted
    swarm-sim --scenario clustered --setup none --contended serial --json
    swarm-sim --scenario hetero --arrivals azure-lengths --l-in 2048 --max-l-in 2048 --max-l-out 128 \
        --setup none --contended serial --roles prefill*2,decode*6 --link-mbps 1000 --rate 0.3
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

from tqdm import tqdm

from llm_swarm.scheduler.sim.discrete_events import SimulationError
from llm_swarm.scheduler.sim.goodput import cell_goodput
from llm_swarm.scheduler.sim.length_info import LENGTH_INFO, TRACE_MAX_NEW_TOKENS
from llm_swarm.scheduler.sim.metrics import goodput
from llm_swarm.scheduler.sim.monte_carlo import SCENARIOS, CellConfig, run_cell
from llm_swarm.scheduler.sim.policies import POLICIES
from llm_swarm.scheduler.sim.sweeps import SWEEP_POLICIES, SWEEPS, sweep, sweep_points, write_csv
from llm_swarm.swarm.cli.dataclass_args import add_field_options, dataclass_from_args


class _OneLineParser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line on stderr, exit 2 (no usage dump)
        print(f"swarm-sim: error: {message}", file=sys.stderr)
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    parser = _OneLineParser(
        prog="swarm-sim",
        fromfile_prefix_chars="@",  # arguments from a file: swarm-sim @args.txt
        description="Simulate a PETALS-style swarm (placement + routing policy) and report per-request "
        "metrics averaged over Monte Carlo seeds.",
        epilog="example: swarm-sim --scenario clustered --policy cg-bp --client-cluster 0 --rate 0.5 "
        "--l-in 20 --l-out 128 --requests 100 --seeds 20 --json",
    )
    parser.add_argument("--scenario", choices=SCENARIOS, default="clustered")
    parser.add_argument("--policy", choices=POLICIES, default="cg-bp")
    parser.add_argument("--client-cluster", type=int, choices=(0, 1, 2), default=0, help="clustered only")
    parser.add_argument("--rate", type=float, default=0.5, help="Poisson arrival rate (requests/s)")
    parser.add_argument(
        "--l-in", type=int, default=20, help="input tokens (trace replay: nominal, sizes the cache s_c)"
    )
    parser.add_argument(
        "--l-out", type=int, default=128, help="output tokens (trace replay: nominal, sizes the cache s_c)"
    )
    parser.add_argument("--max-l-in", type=int, default=None, help="trace replay: cap on l_in per request")
    parser.add_argument("--max-l-out", type=int, default=None, help="trace replay: cap on l_out per request")
    parser.add_argument("--requests", type=int, default=100)
    parser.add_argument("--seeds", type=int, default=20, help="Monte Carlo runs to average")
    parser.add_argument("--servers", type=int, default=None, help="topology scenarios: #servers C")
    parser.add_argument("--eta", type=float, default=None, help="topology scenarios: fraction of A100s")
    parser.add_argument(
        "--arrivals",
        choices=("poisson", "azure", "azure-lengths"),
        default="poisson",
        help="azure: the trace's arrivals and lengths; azure-lengths: Poisson at --rate, the trace's lengths",
    )
    parser.add_argument(
        "--setup",
        choices=("paper", "none"),
        default=None,
        help="session set-up delay: Sun et al.'s calibration (default for BLOOM scenarios) or none",
    )
    parser.add_argument(
        "--compute-scale", type=float, default=1.0, help="multiply every per-block time (sensitivity)"
    )
    parser.add_argument(
        "--length-info",
        default="oracle",
        metavar="|".join(LENGTH_INFO),
        help="the output length WS-RR (cg-bp, opt-rr) routes and estimates waits by: each request's true "
        "one (oracle), a constant, the declared cap (--max-l-out, trace replay default "
        f"{TRACE_MAX_NEW_TOKENS}) or the online length predictor (docs/simulator.md)",
    )
    contended = parser.add_argument_group(
        "contended servers (docs/simulator.md; default: Sun et al.'s model)"
    )
    contended.add_argument(
        "--contended",
        choices=("serial", "overlap"),
        default=None,
        help="run every server's iteration loop, its accelerator one iteration at a time (serial) or "
        "each session's step in its own time (overlap)",
    )
    # the defaults are CellConfig's, so the command line and a config built in code agree
    add_field_options(
        contended,
        CellConfig,
        {
            "--batch-wait-ms": "the servers' decode batching window",
            "--prefill-chunk": "prompts run in chunks of this; 0: whole",
        },
    )
    contended.add_argument(
        "--roles",
        default=None,
        help="per server: prefill, decode or both, ROLE*N repeats (e.g. prefill*2,both*7)",
    )
    contended.add_argument(
        "--link-mbps", type=float, default=None, help="bandwidth between every two servers"
    )
    add_field_options(contended, CellConfig, {"--link-rtt-ms": "round trip between every two servers"})
    contended.add_argument(
        "--disaggregate",
        choices=("auto", "always", "never", "scheduler"),
        default="auto",
        help="when a session's prompt goes to a prefill server (the client's rule, swarm/prefill_cost.py; "
        "scheduler: the live scheduler's plan, which also counts the prompts each server was given)",
    )
    parser.add_argument("--slo-ttft", type=float, default=None, help="TTFT SLO (s): adds slo_attainment")
    parser.add_argument("--slo-tpot", type=float, default=None, help="TPOT SLO (s): adds slo_attainment")
    parser.add_argument(
        "--goodput",
        action="store_true",
        help="search the max Poisson rate (from --rate up) at which >= 90%% of requests meet the SLOs",
    )
    parser.add_argument("--sweep", choices=SWEEPS, default=None, help="run a figure sweep (CSV + PNG)")
    parser.add_argument("--out", type=Path, default=Path("results/sweeps"), help="sweep output folder")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    return parser


def _config(args: argparse.Namespace) -> CellConfig:
    if args.seeds <= 0:  # the other values are CellConfig's to check
        raise ValueError("--seeds must be positive")
    if args.goodput and args.slo_ttft is None and args.slo_tpot is None:
        raise ValueError("--goodput needs --slo-ttft and/or --slo-tpot")
    setup = args.setup or ("none" if args.scenario == "ripe" else "paper")
    # --servers and --eta name what the figures call C and eta; the other flags are CellConfig's fields
    return dataclass_from_args(
        CellConfig, args, num_servers=args.servers, fast_fraction=args.eta, setup=setup
    )


def _run_sweep(args: argparse.Namespace, config: CellConfig) -> dict:
    from llm_swarm.scheduler.sim.plots import plot_sweep  # matplotlib only when plotting

    total = len(sweep_points(args.sweep, config)) * len(SWEEP_POLICIES)
    with tqdm(total=total, desc=f"sweep {args.sweep}", file=sys.stderr) as bar:
        rows = sweep(args.sweep, config, args.seeds, progress=bar.update)
    stem = f"{config.scenario}_{args.sweep}"
    write_csv(rows, args.out / f"{stem}.csv")
    plot_sweep(
        rows, args.sweep, f"{config.scenario}: per-token time vs {args.sweep}", args.out / f"{stem}.png"
    )
    result = {"csv": str(args.out / f"{stem}.csv"), "png": str(args.out / f"{stem}.png"), "rows": rows}
    # goodput (docs/reference.md 6) on the sweep's grid
    if args.sweep == "rate" and "slo_attainment" in rows[0]:
        result["goodput"] = {
            policy: goodput(
                [row["x"] for row in rows if row["policy"] == policy],
                [row["slo_attainment"] for row in rows if row["policy"] == policy],
            )
            for policy in dict.fromkeys(row["policy"] for row in rows)
        }
    return result


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        config = _config(args)
        started = time.perf_counter()
        if args.sweep:
            result = _run_sweep(args, config)
        elif args.goodput:
            found = cell_goodput(config, args.seeds)
            result = {"config": asdict(config), "goodput": found.goodput, "probes": found.probes}
        else:
            with tqdm(total=args.seeds, desc=f"{config.policy} seeds", file=sys.stderr) as bar:
                summary = run_cell(config, args.seeds, progress=bar.update)
            result = {"config": asdict(config), "seeds": args.seeds, "summary": summary}
        result["wall_s"] = round(time.perf_counter() - started, 3)
    except (ValueError, SimulationError, OSError) as exc:
        print(f"swarm-sim: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result, indent=2))
    elif args.sweep:
        print(f"wrote {result['csv']} and {result['png']}")
        for policy, rate in result.get("goodput", {}).items():
            print(f"goodput {policy:10s} {rate:.3f} req/s (highest swept rate with >= 90% SLO attainment)")
    elif args.goodput:
        for rate, attained in result["probes"]:
            print(f"rate {rate:8.4f} req/s  SLO attainment {attained:.3f}")
        print(f"goodput {result['goodput']:.4f} req/s")
    else:
        summary = result["summary"]
        for key in ("per_token_time", "ttft", "tpot", "waiting"):
            print(
                f"{key:15s} mean {summary[key + '_mean']:9.3f}  p50 {summary[key + '_p50']:9.3f}  "
                f"p95 {summary[key + '_p95']:9.3f}  p99 {summary[key + '_p99']:9.3f}  (s)"
            )
        print(f"throughput      {summary['throughput_tokens_per_s']:.2f} tokens/s")
        if "slo_attainment" in summary:
            print(f"SLO attainment  {summary['slo_attainment']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
