"""The scheduler's predicted wait against the measured one, on requests of varied lengths (a window of
the Azure LLM trace), before and after clients tell routing their real lengths.

Over netem: a client site (DHT, scheduler, load generator) `--rtt` ms from two server sites; each
server holds every block of a tiny LLaMA, emulates a GPU (`--compute-delay`, launch-bound;
`--compute-delay-per-token`, compute-bound prefill) and has cache room for `--slots` sessions of the
scheduler's slot size, so requests queue in the scheduler's WS-RR admission. The requests are
`--requests` consecutive records of `data/azure_llm_inference_trace_code_2023.csv` (arrivals as
recorded, stretched by `--stretch`; prompts divided by `--prompt-divisor`, answers capped at
`--max-answer`). Each round replays them twice, in alternating order:

- `fixed`: every session tells routing l_in = 20, l_out = 128 (what a client says that knows neither length);
- `real`: every session tells routing its own prompt and answer lengths.

Each run has its own swarm and scheduler (what a scheduler learns of sessions' run times stays
in its run). For every request the load generator records the scheduler's WS-RR wait estimate
when it routed the session and the wait measured from routing to admission.

    sudo .venv/bin/python -m benchmarks.scheduling.wait_prediction [--requests 80] [--write]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.common import add_mig_slice_delays, add_report_options, bench_parser, publish_table

SCHEDULER_L_IN, SCHEDULER_L_OUT = 20, 128  # the scheduler's (and formerly every client's) lengths
MODES = ("fixed", "real")


def trace_requests(args: argparse.Namespace) -> list[dict]:
    import numpy as np

    from llm_swarm.scheduler.sim import workload

    records = workload.load_azure_trace()
    window = workload.trace_replay(records, args.requests, None, None, np.random.default_rng(args.seed))
    return [
        {
            "id": request.id,
            "arrival": request.arrival * args.stretch,
            "l_in": max(1, min(request.l_in // args.prompt_divisor, args.max_prompt)),
            "l_out": max(1, min(request.l_out, args.max_answer)),
        }
        for request in window
    ]


def run(args: argparse.Namespace, work: Path) -> list[dict]:
    from benchmarks.netem.emulator import Emulation
    from benchmarks.netem.scenario import equidistant_scenario
    from llm_swarm.swarm.models import load_span
    from llm_swarm.swarm.models.tiny import TinyModelSpec, build_tiny_model

    model_dir = build_tiny_model(
        work / "tiny-llama", TinyModelSpec(family="llama", num_layers=args.layers, num_kv_heads=2)
    )
    span, _ = load_span(str(model_dir), 0, args.layers, dtype="float32")
    slot_tokens = SCHEDULER_L_IN + SCHEDULER_L_OUT
    memory = args.layers * (span.block_bytes + args.slots * slot_tokens * span.cache_bytes(num_tokens=1))
    servers = ("s0", "s1")
    scenario = equidistant_scenario("bench_wait_prediction", ("client", *servers), args.rtt)
    requests = trace_requests(args)
    rows = []
    for round_index in range(args.rounds):
        for mode in MODES if round_index % 2 == 0 else MODES[::-1]:
            label = f"{mode}-{round_index}"
            # a fresh swarm and scheduler per run: what the scheduler learns of run times in one
            # mode must not carry over into the other
            with Emulation(scenario, work / f"netem-{label}") as emulation:
                emulation.start_dht("client")
                emulation.start_scheduler(
                    "client", model_dir, "--policy", "cg-bp", "--l-in", str(SCHEDULER_L_IN),
                    "--l-out", str(SCHEDULER_L_OUT), "--lease", "600",
                )  # fmt: skip
                for name in servers:
                    emulation.start_server(
                        name, name, model_dir, f"0:{args.layers}", memory, args.compute_delay,
                        "--compute-delay-per-token", repr(args.compute_delay_per_token),
                        "--slot-tokens", str(slot_tokens), "--session-timeout", "600", "--torch-threads", "1",
                    )  # fmt: skip
                emulation.wait_online("client", model_dir, list(servers))
                spec = {
                    "model_dir": str(model_dir),
                    "initial_peers": emulation.initial_peers,
                    "scheduler_key": emulation.scheduler_key,
                    "policy": "cg-bp",
                    "time_scale": 1.0,
                    "seed": args.seed,
                    "requests": requests,
                    **({"route_lengths": [SCHEDULER_L_IN, SCHEDULER_L_OUT]} if mode == "fixed" else {}),
                }
                spec_path, out_path = work / f"{label}.json", work / f"{label}.results.json"
                spec_path.write_text(json.dumps(spec))
                loadgen = emulation.python("benchmarks.netem.loadgen", str(spec_path), str(out_path))
                process = emulation.start(f"loadgen-{label}", "client", loadgen)
                while process.poll() is None:
                    emulation.check_alive(["dht", "scheduler", *servers])
                    time.sleep(1.0)
                if not out_path.exists():
                    log = emulation.log(f"loadgen-{label}")[-3000:]
                    raise SystemExit(f"{label}: the load generator failed:\n{log}")
            measured = json.loads(out_path.read_text())["requests"]
            failed = [r for r in measured if "error" in r]
            if failed:
                raise SystemExit(f"{label}: {len(failed)} requests failed, e.g. {failed[0]['error']}")
            for record in measured:
                rows.append({"mode": mode, "round": round_index, **record})
            print(f"{label}: {summary_line(rows, mode, round_index)}", flush=True)
    return rows


def waits(rows: list[dict], mode: str, round_index: int | None = None) -> list[tuple[float, float]]:
    return [
        (row["predicted_wait"], row["measured_wait"])
        for row in rows
        if row["mode"] == mode
        and (round_index is None or row["round"] == round_index)
        and "predicted_wait" in row
        and "measured_wait" in row
    ]


def summary_line(rows: list[dict], mode: str, round_index: int) -> str:
    pairs = waits(rows, mode, round_index)
    error = statistics.mean(abs(p - m) for p, m in pairs) if pairs else math.nan
    return f"{len(pairs)} requests, mean |predicted - measured| wait {error:.2f} s"


def table(rows: list[dict]) -> list[str]:
    lines = [
        "| sessions tell routing | requests | waited > 0.5 s | mean measured wait (s) "
        "| mean predicted wait (s) | mean abs. error (s) | error of the waiting ones (median) "
        "| predicted / measured, total |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for mode in MODES:
        pairs = waits(rows, mode)
        waited = [(p, m) for p, m in pairs if m > 0.5]
        relative = statistics.median(abs(p - m) / m for p, m in waited) if waited else math.nan
        total_measured = sum(m for _, m in pairs)
        ratio = sum(p for p, _ in pairs) / total_measured if total_measured else math.nan
        label = "fixed l_in 20, l_out 128" if mode == "fixed" else "real prompt and answer lengths"
        measured_mean = statistics.mean(m for _, m in pairs)
        predicted_mean = statistics.mean(p for p, _ in pairs)
        error = statistics.mean(abs(p - m) for p, m in pairs)
        lines.append(
            f"| {label} | {len(pairs)} | {len(waited)} | {measured_mean:.2f} | {predicted_mean:.2f} "
            f"| {error:.2f} | {relative * 100:.0f}% | {ratio:.2f} |"
        )
    return lines


def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--requests", type=int, default=80, help="consecutive trace records")
    parser.add_argument("--seed", type=int, default=0, help="where the trace window starts")
    parser.add_argument("--stretch", type=float, default=1.0, help="multiply the trace's arrival times")
    parser.add_argument("--prompt-divisor", type=int, default=8, help="divide each prompt's length")
    parser.add_argument(
        "--max-prompt", type=int, default=512, help="cap on a prompt's length (after dividing)"
    )
    parser.add_argument("--max-answer", type=int, default=64, help="cap on an answer's length")
    parser.add_argument("--slots", type=int, default=8, help="cache slots per block on each server")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rtt", type=float, default=50.0, help="ms between the client site and each server")
    add_mig_slice_delays(parser)
    add_report_options(parser)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-wait-") as work:
        rows = run(args, Path(work))
    requests = [row for row in rows if row["mode"] == "real" and row["round"] == 0]
    text = (
        f"netem: a client site (DHT, scheduler with WS-RR admission, load generator) {args.rtt:.0f} ms from "
        f"two server sites, 100 Mbit/s; each server holds all {args.layers} blocks of a tiny LLaMA with room "
        f"for {args.slots} slots of {SCHEDULER_L_IN + SCHEDULER_L_OUT} tokens per block, and charges a "
        f"forward max({args.compute_delay * 1e3:g} ms, {args.compute_delay_per_token * 1e6:g} us x tokens) "
        f"per block. {args.requests} consecutive requests of the Azure code trace (seed {args.seed}), "
        f"arrivals as recorded x {args.stretch:g}, prompts / {args.prompt_divisor} capped at "
        f"{args.max_prompt} (here {min(r['l_in'] for r in requests)}..{max(r['l_in'] for r in requests)} "
        f"tokens), answers capped at {args.max_answer} ({min(r['l_out'] for r in requests)}.."
        f"{max(r['l_out'] for r in requests)}). {args.rounds} rounds, the two modes alternating. The "
        "predicted wait is the scheduler's WS-RR estimate (eq. 20) when it routed the session; the "
        "measured one runs from that answer to admission. 'error of the waiting ones' is the median of "
        "|predicted - measured| / measured over requests that waited more than 0.5 s."
    )
    header = "## The scheduler's predicted wait on varied lengths, over emulated links"
    publish_table(__file__, args, table(rows), header, text)


if __name__ == "__main__":
    main()
