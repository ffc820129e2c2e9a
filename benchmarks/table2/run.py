"""Sun et al.'s Table 2 experiment on the emulated geo-distributed network: measured vs simulated.

For every (arrival rate, l_out) cell and every policy, on one emulated network (benchmarks/netem,
scenario `table2.json`: 3 clusters, 5 ms / 1 Gbit/s inside, 100 ms / 100 Mbit/s across):

1. place the 70 blocks with `swarm-plan place --algo cg-bp|petals|gbp-cr` on the *paper's* memory budgets
   (A100 79.13 GiB, MIG 8.2 GiB, BLOOM-176B NF4 blocks): PETALS gets its 53 / 4 blocks, CG-BP what
   docs/reference.md 3.1 gives for the cell's R;
2. start a DHT, a scheduler (`--policy cg-bp`: WS-RR routing and admission; `--policy petals`:
   PETALS' router, clients back off when refused; `--policy chains`: Sun, He and Hou's GBP-CR placement
   with c tuned for the rate, GCA chains and a JFFC queue) and 9 servers with those `--blocks`, a tiny
   BLOOM (70 blocks, hidden 64) and `--compute-delay` so that each block costs what it costs on the
   paper's GPU (tau 3.22 ms A100, 16.25 ms MIG, minus the CPU time the tiny block takes), and
   `--memory` = the tiny model's real block bytes x blocks + its real s_c x the paper's number of
   cache slots (so eq. 2 admits exactly as many sessions as on the paper's GPUs);
3. run N Poisson requests (l_in, l_out, rate) from a client in the chosen cluster (`netem/loadgen.py`);
4. simulate the same swarm (same spans, the servers' announced tau / tau_prefill, the client's
   measured round trips, the same arrival times, and as per-session set-up the time a session open
   took on the idle swarm just before the run, as Sun et al. calibrates its simulator's set-up
   delay) with `scheduler.sim` and put the prediction beside the measurement (the metrics of
   docs/reference.md 6 for both through `scheduler.sim.metrics.summarize`).

`--time-scale k` multiplies every delay (link RTTs, per-block times, PETALS' backoff) by k and
divides the arrival rate by k: the same queueing at k times the speed. Reported values are at the
emulation's scale; `/k` gives the paper-scale equivalent (`k = 1`: none needed).

    sudo .venv/bin/python -m benchmarks.table2.run --requests 0.1:20,0.5:40 --write-benchmarks

A goodput plan runs the same way: `--write-problem P.json` writes the emulated swarm as a
`swarm-plan` problem (no root), `swarm-plan goodput ... < P.json` chooses the plan, and
`--policies 'cg-bp:R=128'` (or `chains:c=16`, or a default policy) runs it with that parameter fixed
in the placement and the scheduler. `--slo-ttft/--slo-tpot` (seconds) add SLO attainment (failed
requests count as misses) measured vs simulated on the same arrivals, and at tighter targets from
the same requests.

Needs root (network namespaces). Results: `results/netem/table2.{json,md}` and per-run logs.
This file runs the cells; `benchmarks/table2/` holds the parts: inputs (scenario, tiny-model costs,
server plans), placement, the simulator's prediction and the report.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks.markdown import write_section
from benchmarks.netem.cli import prepare_model
from benchmarks.netem.emulator import Emulation
from benchmarks.netem.system import busy_cores, host_cpu_ticks, netns_works
from benchmarks.table2.inputs import (
    PREFILL_TOKENS,
    Cell,
    ServerPlan,
    TinyCosts,
    measure_tiny,
    paper_model,
    scaled_scenario,
    server_plans,
    write_block_timings,
)
from benchmarks.table2.placement import cache_slot_counts, place, problem_document
from benchmarks.table2.plans import PlanSpec, attainment, check_slo, measured_times, parse_plans
from benchmarks.table2.prediction import predict
from benchmarks.table2.report import HEADER, benchmarks_section, markdown
from llm_swarm.scheduler.algorithms.problem import Span
from llm_swarm.scheduler.sim import workload
from llm_swarm.scheduler.sim.discrete_events import RequestRecord
from llm_swarm.scheduler.sim.metrics import Slo, summarize

ROOT = Path(__file__).resolve().parents[2]

SCENARIO = ROOT / "benchmarks" / "netem" / "scenarios" / "table2.json"


def run_policy(
    emulation: Emulation,
    spec: PlanSpec,
    cell: Cell,
    args: argparse.Namespace,
    raw: dict,
    plans: list[ServerPlan],
    tiny: TinyCosts,
    model_dir: Path,
    requests: list[workload.Request],
    join_order: list[int],
    client_site: str,
    control_site: str,
) -> dict:

    scale, l_in, policy = args.time_scale, args.l_in, spec.policy
    model = paper_model(raw, l_in, cell.l_out)
    ordered = [plans[j] for j in join_order] if policy == "petals" else list(plans)
    document = problem_document(ordered, model, emulation.scenario, client_site, scale, tiny)
    placed = place(policy, document, model, cell.rate / scale, cell.l_out, spec.parameter)
    by_name = {entry["name"]: entry for entry in placed["placement"]}
    spans = [
        Span(by_name[p.name]["start"], by_name[p.name]["end"])
        if by_name[p.name]["start"] is not None
        else None
        for p in plans
    ]
    slots = cache_slot_counts(policy, plans, model, spans)
    slot_tokens = l_in + cell.l_out
    s_c = tiny.cache_token_bytes * slot_tokens
    memory = [
        tiny.block_bytes * (span.length if span else 0) + s_c * n + s_c // 2
        for span, n in zip(spans, slots, strict=True)
    ]
    label = f"{spec.slug}-r{cell.rate:g}-l{cell.l_out}"
    print(
        f"[{label}] placement: "
        + ", ".join(f"{p.name}={s.start}:{s.end}" for p, s in zip(plans, spans, strict=True) if s)
    )
    emulation.start_dht(control_site)
    num_requests = placed.get("num_requests") or placed.get("c") or 1
    emulation.start_scheduler(
        control_site, model_dir,
        "--policy", policy, "--l-in", str(l_in), "--l-out", str(cell.l_out),
        "--num-requests", str(num_requests), "--period", "3600", "--arrival-rate", repr(cell.rate / scale),
        "--lease", "600",
    )  # fmt: skip
    names = []
    for plan, span, budget in zip(plans, spans, memory, strict=True):
        if span is None:
            continue
        emulation.start_server(
            plan.name, plan.site, model_dir, f"{span.start}:{span.end}", budget, plan.compute_delay,
            "--slot-tokens", str(slot_tokens), "--session-timeout", "900", "--drain-timeout", "1",
            *(["--compute-delay-overlap"] if args.gpu_model == "overlap" else []),
        )  # fmt: skip
        names.append(plan.name)
    online = emulation.wait_online(client_site, model_dir, names, timeout=300)
    loadgen_spec = {
        "model_dir": str(model_dir),
        "initial_peers": emulation.initial_peers,
        "scheduler_key": emulation.scheduler_key,
        "policy": policy,
        "time_scale": scale,
        "seed": args.seed,
        "requests": [dataclasses.asdict(r) for r in requests],
    }
    spec_path = emulation.run_dir / f"{label}.loadgen.json"
    out_path = emulation.run_dir / f"{label}.results.json"
    spec_path.write_text(json.dumps(loadgen_spec))
    out_path.unlink(missing_ok=True)
    swarm_cpu_before, host_before = emulation.cpu_seconds(), host_cpu_ticks()
    started = time.monotonic()
    process = emulation.start(
        f"loadgen-{label}",
        client_site,
        emulation.python("benchmarks.netem.loadgen", str(spec_path), str(out_path)),
    )
    limit = requests[-1].arrival + args.run_timeout
    while process.poll() is None:
        emulation.check_alive([n for n in emulation.processes if not n.startswith("loadgen")])
        if time.monotonic() - started > limit:
            raise TimeoutError(f"{label}: the load generator did not finish in {limit:.0f} s")
        time.sleep(1)
    wall = time.monotonic() - started
    if not out_path.exists():
        raise RuntimeError(
            f"{label}: the load generator failed:\n{emulation.log(f'loadgen-{label}')[-3000:]}"
        )
    measured = json.loads(out_path.read_text())
    host_busy = busy_cores(host_before, host_cpu_ticks())
    cpu = emulation.cpu_seconds()  # live processes only: the load generator has exited (see below)
    cpu[f"loadgen-{label}"] = measured.get("cpu_s", 0.0)
    # what the run's own processes used of the host, against everything the host did meanwhile
    swarm_cores = sum(cpu[name] - swarm_cpu_before.get(name, 0.0) for name in cpu) / max(wall, 1e-9)
    problems = emulation.stop_all()
    failed = [r for r in measured["requests"] if "error" in r]
    records = [
        RequestRecord(
            r["id"],
            r["arrival"],
            0.0,
            r["opened"],
            r["first_token"],
            r["finish"],
            r["l_out"],
            len(r["hops"]),
            r["retries"],
        )  # fmt: skip
        for r in measured["requests"]
        if "error" not in r
    ]
    measured_summary = summarize(records) if records else {}
    setup = float(measured.get("setup_probe_s", 0.0))
    slo = Slo(args.slo_ttft, args.slo_tpot)
    predicted = predict(
        policy, plans, spans, slots, online, model, requests, l_in, cell.l_out, scale, setup,
        slo=slo if slo.active else None, keep_requests=True,
    )  # fmt: skip
    simulated_per_request = predicted.pop("per_request")
    if slo.active:  # every request counts: one that failed missed its SLOs
        ttft, tpot, failures = measured_times(measured["requests"])
        measured_summary["slo_attainment"] = attainment(ttft, tpot, failures, slo.ttft_s, slo.tpot_s)
    print(
        f"[{label}] measured per-token {measured_summary.get('per_token_time_mean', math.nan):.3f} s, "
        f"simulated {predicted['per_token_time_mean']:.3f} s; {len(failed)} failed; {wall:.0f} s; host "
        f"{host_busy:.2f} of {os.cpu_count()} cores busy, the swarm's processes {swarm_cores:.2f}"
        + (
            f"; SLO attainment measured {measured_summary['slo_attainment']:.1%}, "
            f"simulated {predicted['slo_attainment']:.1%}"
            if slo.active
            else ""
        )
    )
    return {
        "policy": policy,
        "plan": spec.label,
        "parameter": spec.parameter,
        "slo": {"ttft_s": args.slo_ttft, "tpot_s": args.slo_tpot} if slo.active else None,
        "rate": cell.rate,
        "l_out": cell.l_out,
        "requests": cell.requests,
        "placement": {p.name: [s.start, s.end] if s else None for p, s in zip(plans, spans, strict=True)},
        "num_requests_R": placed.get("num_requests"),
        "capacity_c": placed.get("c"),
        "cache_slots": dict(zip([p.name for p in plans], slots, strict=True)),
        "memory_bytes": dict(zip([p.name for p in plans], memory, strict=True)),
        "compute_delay_s": {p.name: p.compute_delay for p in plans},
        "servers_announced": online,
        "measured": measured_summary,
        "simulated": predicted,
        "setup_probe_s": setup,
        "failed": [{k: r[k] for k in ("id", "error")} for r in failed],
        "no_cache_room_refusals": measured.get("refusals_no_cache_room"),
        "per_request": measured["requests"],
        "simulated_per_request": simulated_per_request,
        "wall_s": wall,
        "cpu_s": cpu,
        "host_cpu": {"busy_cores": host_busy, "swarm_cores": swarm_cores, "cores": os.cpu_count()},
        "stop_problems": problems,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scenario", type=Path, default=SCENARIO)
    parser.add_argument(
        "--policies",
        default="petals,cg-bp",
        help="comma-separated: petals, cg-bp, chains, or a plan with its parameter fixed as "
        "`swarm-plan goodput` prints it, e.g. cg-bp:R=128, chains:c=16",
    )
    parser.add_argument("--rates", default="0.1,0.5", help="paper-scale arrival rates, requests/s")
    parser.add_argument("--l-out", default="64,128")
    parser.add_argument("--l-in", type=int, default=20)
    parser.add_argument(
        "--requests", default="100", help="requests per run: a number, or per rate as RATE:N,RATE:N"
    )
    parser.add_argument("--client-cluster", type=int, default=0, choices=[0, 1, 2])
    parser.add_argument("--time-scale", type=float, default=1.0, help="multiply every delay by k (see above)")
    parser.add_argument(
        "--seed", type=int, default=0, help="arrivals and PETALS' join order (as swarm-sim seed)"
    )
    parser.add_argument("--delay", choices=["auto", "netem", "nfqueue"], default="auto")
    parser.add_argument(
        "--gpu-model",
        choices=["overlap", "serial"],
        default="overlap",
        help="how an emulated GPU serves concurrent sessions: overlap = each step takes its per-block "
        "time whatever else runs (Sun et al.'s model; swarm-server --compute-delay-overlap); serial = "
        "one step (or batched decode) at a time",
    )
    parser.add_argument(
        "--run-timeout", type=float, default=900.0, help="seconds allowed after the last arrival"
    )
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "netem")
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/lsw-experiment"), help="model and logs")
    parser.add_argument(
        "--slo-ttft", type=float, help="TTFT target, seconds at the emulation's scale: report SLO attainment"
    )
    parser.add_argument("--slo-tpot", type=float, help="TPOT target, seconds at the emulation's scale")
    parser.add_argument(
        "--write-problem",
        type=Path,
        help="only write the swarm-plan problem document of the first cell (the emulated servers' times "
        "and round trips, the cell's rate and l_out: what `swarm-plan goodput` plans on) and exit; no root",
    )
    parser.add_argument("--write-benchmarks", action="store_true", help="put the table into BENCHMARKS.md")
    parser.add_argument(
        "--merge",
        action="store_true",
        help="keep the runs already in OUT/table2.json for other (policy, rate, l_out) and add these "
        "(e.g. a later `--policies chains` beside an earlier petals/cg-bp run)",
    )
    args = parser.parse_args(argv)
    try:
        policies = parse_plans(args.policies)
        check_slo(args.slo_ttft, "--slo-ttft")
        check_slo(args.slo_tpot, "--slo-tpot")
    except ValueError as error:
        parser.error(str(error))
    if args.write_problem is None:
        reason = netns_works()
        if reason is not None:
            print(f"experiment: {reason}", file=sys.stderr)
            return 2
    rates = [float(r) for r in args.rates.split(",")]
    per_rate = dict(item.split(":") for item in args.requests.split(",")) if ":" in args.requests else {}
    cells = [
        Cell(rate, int(l_out), int(per_rate.get(f"{rate:g}", per_rate.get(str(rate), 0)) or args.requests))
        for rate in rates
        for l_out in args.l_out.split(",")
    ]
    raw = json.loads(args.scenario.read_text())
    scenario = scaled_scenario(raw, args.time_scale)
    client_site = next(
        p.site
        for p in scenario.processes_of("client")
        if scenario.site(p.site).group == f"cluster{args.client_cluster}"
    )
    control_site = scenario.processes_of("dht")[0].site
    args.work_dir.mkdir(parents=True, exist_ok=True)
    model_dir = args.work_dir / f"model-{scenario.name.split()[0]}"
    if not (model_dir / "config.json").exists():
        model_dir = prepare_model(scenario, args.work_dir)
    if args.l_in != PREFILL_TOKENS:
        parser.error(f"--l-in must be {PREFILL_TOKENS} (the servers' prefill profile length)")
    tiny = measure_tiny(model_dir, args.l_in)
    plans = server_plans(scenario, raw, args.time_scale, tiny)
    print(
        f"tiny block: {tiny}; compute delays: "
        + ", ".join(f"{p.name}={p.compute_delay * 1e3:.3f} ms" for p in plans)
    )
    if args.write_problem is not None:
        cell = cells[0]
        document = problem_document(
            plans, paper_model(raw, args.l_in, cell.l_out), scenario, client_site, args.time_scale, tiny
        )
        document.update(arrival_rate=cell.rate / args.time_scale, l_out=cell.l_out)
        args.write_problem.parent.mkdir(parents=True, exist_ok=True)
        args.write_problem.write_text(json.dumps(document, indent=1))
        print(f"wrote {args.write_problem}")
        return 0
    run_dir = args.work_dir / time.strftime("run-%Y%m%d-%H%M%S")
    write_block_timings(model_dir, tiny, {p.compute_delay for p in plans}, run_dir / "cache")
    os.environ["SWARM_CACHE_DIR"] = str(run_dir / "cache")  # the servers' environment (Emulation.env)
    report: dict = {
        "config": {
            **{k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "cells": [dataclasses.asdict(c) for c in cells],
            "client_site": client_site,
        },
        "tiny_model": dataclasses.asdict(tiny),
        "runs": [],
    }
    args.out.mkdir(parents=True, exist_ok=True)
    earlier: list[dict] = []
    if args.merge and (args.out / "table2.json").exists():
        previous = json.loads((args.out / "table2.json").read_text())
        fresh = {(p.label, c.rate, c.l_out) for p in policies for c in cells}
        earlier = [
            r for r in previous["runs"] if (r.get("plan", r["policy"]), r["rate"], r["l_out"]) not in fresh
        ]
        report["merged"] = previous.get("merged", []) + [
            {"config": previous["config"], "wall_s": previous.get("wall_s"), "runs": len(earlier)}
        ]
        report["runs"] = list(earlier)
    started = time.monotonic()
    with Emulation(scenario, run_dir, args.delay) as emulation:
        report["delay_mode"] = emulation.network.mode
        report["pings"] = [dataclasses.asdict(p) for p in emulation.check_rtts()]
        for cell in cells:
            rng = np.random.default_rng(args.seed)  # as swarm-sim's seed: arrivals, then the join order
            requests = workload.poisson(
                cell.rate / args.time_scale, cell.requests, args.l_in, cell.l_out, rng
            )
            join_order = [int(j) for j in rng.permutation(len(plans))]
            for spec in policies:
                run = run_policy(
                    emulation, spec, cell, args, raw, plans, tiny, model_dir, requests, join_order,
                    client_site, control_site,
                )  # fmt: skip
                run["join_order"] = [plans[j].name for j in join_order] if spec.policy == "petals" else None
                report["runs"].append(run)
                (args.out / "table2.json").write_text(json.dumps(report, indent=1))
    report["delayer"] = emulation.network.delayer_stats()
    report["teardown_problems"] = emulation.teardown_report
    report["wall_s"] = time.monotonic() - started
    (args.out / "table2.json").write_text(json.dumps(report, indent=1))
    table = markdown(report)
    (args.out / "table2.md").write_text(table)
    print(table)
    if args.write_benchmarks:
        write_section(HEADER, benchmarks_section(report, table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
