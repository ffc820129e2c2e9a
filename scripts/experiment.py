"""Paper 000's Table 2 experiment on the emulated geo-distributed network: measured vs simulated.

For every (arrival rate, l_out) cell and every policy, on one emulated network (scripts/netem,
scenario `table2.json`: 3 clusters, 5 ms / 1 Gbit/s inside, 100 ms / 100 Mbit/s across):

1. place the 70 blocks with `swarm-plan place --algo cg-bp|petals|gbp-cr` on the *paper's* memory budgets
   (A100 79.13 GiB, MIG 8.2 GiB, BLOOM-176B NF4 blocks): PETALS gets its 53 / 4 blocks, CG-BP what
   SPEC 3.1 gives for the cell's R;
2. start a DHT, a scheduler (`--policy cg-bp`: WS-RR routing and admission; `--policy petals`:
   PETALS' router, clients back off when refused; `--policy chains`: paper 001's GBP-CR placement
   with c tuned for the rate, GCA chains and a JFFC queue) and 9 servers with those `--blocks`, a tiny
   BLOOM (70 blocks, hidden 64) and `--compute-delay` so that each block costs what it costs on the
   paper's GPU (tau 3.22 ms A100, 16.25 ms MIG, minus the CPU time the tiny block takes), and
   `--memory` = the tiny model's real block bytes x blocks + its real s_c x the paper's number of
   cache slots (so eq. 2 admits exactly as many sessions as on the paper's GPUs);
3. run N Poisson requests (l_in, l_out, rate) from a client in the chosen cluster (`netem/loadgen.py`);
4. simulate the same swarm (same spans, the servers' announced tau / tau_prefill, the client's
   measured round trips, the same arrival times, and as per-session set-up the time a session open
   took on the idle swarm just before the run, as paper 000 calibrates its simulator's set-up
   delay) with `scheduler.sim` and put the prediction beside the measurement (SPEC 6 metrics of
   both through `scheduler.sim.metrics.summarize`).

`--time-scale k` multiplies every delay (link RTTs, per-block times, PETALS' backoff) by k and
divides the arrival rate by k: the same queueing at k times the speed. Reported values are at the
emulation's scale; `/k` gives the paper-scale equivalent (`k = 1`: none needed).

    sudo .venv/bin/python scripts/experiment.py --requests 0.1:20,0.5:40 --write-benchmarks

Needs root (network namespaces). Results: `results/netem/table2.{json,md}` and per-run logs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

from benchmarks_md import write_section  # noqa: E402
from netem.cli import prepare_model  # noqa: E402
from netem.emulator import Emulation  # noqa: E402
from netem.scenario import Scenario, parse_scenario  # noqa: E402
from netem.system import netns_works  # noqa: E402

from scheduler.algorithms import petals  # noqa: E402
from scheduler.algorithms.cgbp import choose_num_requests  # noqa: E402
from scheduler.algorithms.chains import gca, request_times  # noqa: E402
from scheduler.algorithms.problem import ModelSpec, ServerSpec, Span, cache_slots  # noqa: E402
from scheduler.algorithms.wsrr import RoutingState  # noqa: E402
from scheduler.plan_io import dumps, parse_problem  # noqa: E402
from scheduler.sim import workload  # noqa: E402
from scheduler.sim.engine import CLIENT, RequestRecord, RetryAt, simulate  # noqa: E402
from scheduler.sim.metrics import summarize  # noqa: E402
from scheduler.sim.policies import JffcRouting, PetalsRouting, WsRrRouting  # noqa: E402
from scheduler.sim.profiles import GIB  # noqa: E402
from swarm.cost import cache_bytes_per_block  # noqa: E402

SCENARIO = ROOT / "scripts" / "netem" / "scenarios" / "table2.json"
POLICY_ALGO = {"proposed": "cg-bp", "petals": "petals", "chains": "chains"}  # experiment -> scheduler
BATCH_WAIT_S = 0.002  # the servers' default --batch-wait-ms: a decode step may wait this long to batch
PLANNING_OVERHEAD_S = 0.004  # per-hop software overhead assumed when placing (measured later)
HEADER = "## Emulated geo-distributed swarm: paper 000 Table 2 (issue 8)"
ORDER = ["petals", "proposed", "chains"]  # table rows per cell


# --- inputs -------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Cell:
    rate: float  # paper-scale requests/s
    l_out: int
    requests: int


def scaled_scenario(raw: dict, scale: float) -> Scenario:
    """Every RTT (and jitter) times `scale`; bandwidths unchanged (hidden states are 256 bytes here)."""
    raw = json.loads(json.dumps(raw))
    links = raw.get("links", {})
    for spec in [links.get("within_group"), links.get("between_groups"), *links.get("pairs", [])]:
        if spec:
            spec["rtt_ms"] = spec["rtt_ms"] * scale
            if "jitter_ms" in spec:
                spec["jitter_ms"] = spec["jitter_ms"] * scale
    return parse_scenario(raw, f"table2 x{scale:g}")


@dataclasses.dataclass(frozen=True)
class TinyCosts:
    """What one block of the emulation's tiny model really costs on this CPU."""

    block_bytes: int
    cache_token_bytes: int
    tau_cpu: float  # decode, per block per token
    tau_prefill_cpu: float  # prefill of l_in tokens, per block


def measure_tiny(model_dir: Path, l_in: int) -> TinyCosts:
    """Per-block CPU costs of the tiny model, best of 3 (the least disturbed by other jobs)."""
    import torch

    from server.throughput import measure_block_timings
    from swarm.models import load_span

    torch.set_num_threads(1)
    span, _ = load_span(str(model_dir), 0, 8, dtype="float32")
    timings = [measure_block_timings(span, l_in) for _ in range(3)]
    return TinyCosts(
        block_bytes=span.block_bytes,
        cache_token_bytes=span.cache_bytes(num_tokens=1),
        tau_cpu=min(t.tau for t in timings),
        tau_prefill_cpu=min(t.tau_prefill for t in timings),
    )


PREFILL_TOKENS = 20  # what servers time their prefill on (ServerConfig.prefill_tokens)


def write_block_timings(model_dir: Path, tiny: TinyCosts, delays: set[float], cache_dir: Path) -> None:
    """The servers' timing cache (`server.throughput`), filled with this idle profile.

    Nine servers starting at once on two cores would each time their blocks while the others load
    theirs, and announce a tau up to 3x too high (and cache it). With the profile taken here, each
    announces `CPU time of an idle block + compute delay` = the paper GPU's tau x the time scale.
    """
    import torch

    from server.throughput import timings_cache_key
    from swarm.models import load_span

    torch.set_num_threads(1)  # the servers run with --torch-threads 1: part of the key
    span, _ = load_span(str(model_dir), 0, 1, dtype="float32")
    if PREFILL_TOKENS != 20:
        raise AssertionError("the prefill profile below is for 20 tokens")
    entries = {
        timings_cache_key(span, PREFILL_TOKENS, delay): {
            "tau": tiny.tau_cpu + delay,
            "tau_prefill": tiny.tau_prefill_cpu + delay,
            "prefill_tokens": PREFILL_TOKENS,
        }
        for delay in delays
    }
    cache_dir.mkdir(parents=True, exist_ok=True)
    (cache_dir / "block_timings.json").write_text(json.dumps(entries, indent=1))


@dataclasses.dataclass(frozen=True)
class ServerPlan:
    name: str
    site: str
    kind: str
    memory_paper: float  # bytes
    tau_paper: float  # seconds per block per token on the paper's GPU
    compute_delay: float  # seconds per block per step, at the emulation's scale


def paper_model(scenario_raw: dict, l_in: int, l_out: int) -> ModelSpec:
    model = scenario_raw["paper_model"]
    return ModelSpec(
        num_blocks=model["num_blocks"],
        block_bytes=model["block_bytes"],
        cache_bytes=cache_bytes_per_block(model["kv_dim"], l_in + l_out, model["dtype_bytes"]),
        hidden_size=model["hidden_size"],
        kv_dim=model["kv_dim"],
        dtype_bytes=model["dtype_bytes"],
    )


def server_plans(scenario: Scenario, raw: dict, scale: float, tiny: TinyCosts) -> list[ServerPlan]:
    kinds = raw["server_kinds"]
    plans = []
    for proc in scenario.processes_of("server"):
        kind = kinds[proc.options["kind"]]
        tau = kind["tau_ms"] / 1e3
        plans.append(
            ServerPlan(
                name=proc.name,
                site=proc.site,
                kind=proc.options["kind"],
                memory_paper=kind["memory_gib"] * GIB,
                tau_paper=tau,
                compute_delay=round(max(tau * scale - tiny.tau_cpu, 0.0), 6),
            )
        )
    return plans


# --- placement ------------------------------------------------------------------------------------------


def problem_document(
    plans: list[ServerPlan],
    model: ModelSpec,
    scenario: Scenario,
    client_site: str,
    scale: float,
    tiny: TinyCosts,
) -> dict:
    """SPEC 4 problem.json at the paper's memory scale with the emulation's times."""
    servers = []
    for plan in plans:
        rtt = scenario.link(client_site, plan.site).rtt_ms / 1e3 + PLANNING_OVERHEAD_S
        servers.append(
            {
                "name": plan.name,
                "memory_bytes": plan.memory_paper,
                "tau": tiny.tau_cpu + plan.compute_delay,
                "tau_prefill": tiny.tau_prefill_cpu + plan.compute_delay,
                "rtt": {CLIENT: rtt},
                "rtt_prefill": {CLIENT: rtt},
            }
        )
    return {"model": dataclasses.asdict(model), "servers": servers}


def swarm_plan(algo: str, document: dict) -> tuple[int, dict]:
    """`swarm-plan place --algo ALGO` on `document` (the CLI itself: the same path a user takes)."""
    result = subprocess.run(
        [sys.executable, "-m", "scheduler.plan_cli", "place", "--algo", algo],
        input=json.dumps(document),
        capture_output=True,
        text=True,
    )
    return result.returncode, json.loads(result.stdout) if result.stdout.strip() else {"error": result.stderr}


def with_chain_times(document: dict, l_out: int) -> dict:
    """Paper 001's per-request times on every server, so that a chain's eq. 2 time is eq. 1's."""
    servers = []
    for server in document["servers"]:
        (rtt,), (rtt_prefill,) = server["rtt"].values(), server["rtt_prefill"].values()
        tau_c, tau_p = request_times(rtt_prefill, rtt, server["tau_prefill"], server["tau"], l_out)
        servers.append({**server, "tau_c": tau_c, "tau_p": tau_p})
    return {**document, "servers": servers}


def place(policy: str, document: dict, model: ModelSpec, rate: float, l_out: int) -> dict:
    if policy in ("petals", "chains"):
        algo, problem = "petals", document
        if policy == "chains":  # GBP-CR with c tuned for this rate (Theorem 3.7's lower bound)
            algo, problem = "gbp-cr", {**with_chain_times(document, l_out), "c": "auto", "arrival_rate": rate}
        code, output = swarm_plan(algo, problem)
        if code != 0:
            raise RuntimeError(f"swarm-plan place --algo {algo} failed: {output}")
        return output
    problem = parse_problem(dumps(document))
    requests = choose_num_requests(problem.servers, model, rate, l_out) or 1
    while True:  # like the scheduler: the largest R <= the chosen one that CG-BP can place
        code, output = swarm_plan("cg-bp", {**document, "num_requests": requests})
        if code == 0:
            return output
        if code != 3 or requests == 1:
            raise RuntimeError(f"swarm-plan place --algo cg-bp failed: {output}")
        requests -= 1


def cache_slot_counts(
    policy: str, plans: list[ServerPlan], model: ModelSpec, spans: list[Span | None]
) -> list[int]:
    """Sessions' cache slots per server on the paper's GPUs: eq. 2's `n_j` (proposed) or PETALS'
    fixed 4096-token cache (SPEC 3.3)."""
    counts = []
    for plan, span in zip(plans, spans, strict=True):
        spec = ServerSpec(plan.name, plan.memory_paper)
        blocks = span.length if span else 0
        if policy == "petals":
            counts.append(petals.cache_capacity_slots(spec, model, blocks))
        else:
            counts.append(cache_slots(spec, model, blocks))
    return counts


# --- one run ----------------------------------------------------------------------------------------------


def run_policy(
    emulation: Emulation,
    policy: str,
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
    scale, l_in = args.time_scale, args.l_in
    model = paper_model(raw, l_in, cell.l_out)
    ordered = [plans[j] for j in join_order] if policy == "petals" else list(plans)
    document = problem_document(ordered, model, emulation.scenario, client_site, scale, tiny)
    placed = place(policy, document, model, cell.rate / scale, cell.l_out)
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
    label = f"{policy}-r{cell.rate:g}-l{cell.l_out}"
    print(
        f"[{label}] placement: "
        + ", ".join(f"{p.name}={s.start}:{s.end}" for p, s in zip(plans, spans, strict=True) if s)
    )
    emulation.start_dht(control_site)
    num_requests = placed.get("num_requests") or placed.get("c") or 1
    emulation.start_scheduler(
        control_site, model_dir,
        "--policy", POLICY_ALGO[policy], "--l-in", str(l_in), "--l-out", str(cell.l_out),
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
    spec = {
        "model_dir": str(model_dir),
        "initial_peers": emulation.initial_peers,
        "policy": policy,
        "time_scale": scale,
        "seed": args.seed,
        "requests": [dataclasses.asdict(r) for r in requests],
    }
    spec_path = emulation.run_dir / f"{label}.loadgen.json"
    out_path = emulation.run_dir / f"{label}.results.json"
    spec_path.write_text(json.dumps(spec))
    out_path.unlink(missing_ok=True)
    started = time.monotonic()
    process = emulation.start(
        f"loadgen-{label}", client_site, emulation.python("netem.loadgen", str(spec_path), str(out_path))
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
    cpu = emulation.cpu_seconds()  # live processes only: the load generator has exited (see below)
    cpu[f"loadgen-{label}"] = measured.get("cpu_s", 0.0)
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
    predicted = predict(policy, plans, spans, slots, online, model, requests, l_in, cell.l_out, scale, setup)
    print(
        f"[{label}] measured per-token {measured_summary.get('per_token_time_mean', math.nan):.3f} s, "
        f"simulated {predicted['per_token_time_mean']:.3f} s; {len(failed)} failed; {wall:.0f} s"
    )
    return {
        "policy": policy,
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
        "wall_s": wall,
        "cpu_s": cpu,
        "stop_problems": problems,
    }


# --- the simulator's prediction ---------------------------------------------------------------------------


class ScaledPetalsRouting(PetalsRouting):
    """PETALS' client with the experiment's time scale applied to its backoff."""

    def __init__(self, *args, scale: float = 1.0, **kwargs):
        super().__init__(*args, **kwargs)
        self.scale = scale

    def on_arrival(self, request, now, attempt, free_slots):
        decision = super().on_arrival(request, now, attempt, free_slots)
        if isinstance(decision, RetryAt) and self.scale != 1.0:
            return RetryAt(now + (decision.time - now) * self.scale)
        return decision


def predict(
    policy: str,
    plans: list[ServerPlan],
    spans: list[Span | None],
    slots: list[int],
    online: dict,
    model: ModelSpec,
    requests: list[workload.Request],
    l_in: int,
    l_out: int,
    scale: float,
    setup: float,
) -> dict:
    """The simulator on this very swarm: spans and cache slots as emulated, tau/tau_prefill as the
    servers announced them, t_cj = the client's measured info-RPC round trip + the batching wait,
    a per-session set-up of `setup` seconds (the idle probe), PETALS' backoff x the time scale;
    `chains`: GCA's chains on the emulated spans (times as the live scheduler computes them), JFFC."""
    servers = []
    for plan in plans:
        info = online.get(plan.name)
        if info is None:  # not started (no blocks): never on a route
            servers.append(
                ServerSpec(
                    plan.name,
                    plan.memory_paper,
                    tau=1.0,
                    tau_prefill=1.0,
                    rtt={CLIENT: 1.0},
                    rtt_prefill={CLIENT: 1.0},
                )
            )
            continue
        rtt = info["rtt_info_s"] + BATCH_WAIT_S
        tau_prefill = (
            info["tau_prefill"] * l_in / info["prefill_tokens"] if info["prefill_tokens"] else info["tau"]
        )
        tau_c, tau_p = request_times(rtt, rtt, tau_prefill, info["tau"], l_out)
        servers.append(
            ServerSpec(
                plan.name,
                plan.memory_paper,
                tau=info["tau"],
                tau_prefill=tau_prefill,
                rtt={CLIENT: rtt},
                rtt_prefill={CLIENT: rtt},
                tau_c=tau_c,
                tau_p=tau_p,
            )
        )
    if policy == "petals":  # PETALS' router, fed the same measured round trips as the scheduler's
        dispatcher = ScaledPetalsRouting(servers, model, spans, slots, setup, scale=scale)
    elif policy == "chains":
        dispatcher = JffcRouting(gca(servers, model, spans), spans, setup)
    else:
        dispatcher = WsRrRouting(RoutingState(servers, model, spans), spans, setup)
    result = simulate(servers, model, dispatcher, requests)
    summary = summarize(result.records)
    summary["hops_mean"] = float(np.mean([r.num_hops for r in result.records]))
    return summary


# --- output -----------------------------------------------------------------------------------------------


def _fmt(value: float | None) -> str:
    return "-" if value is None or not math.isfinite(value) else f"{value:.3f}"


def markdown(report: dict) -> str:
    scale = report["config"]["time_scale"]
    lines = [
        "| rate (req/s), l_out, N | policy | per-token, measured | simulated | TTFT, measured | simulated "
        "| TPOT, measured | simulated | waiting, measured | simulated | hops, measured | sim |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    ordered = sorted(
        report["runs"],
        key=lambda r: (r["rate"], r["l_out"], ORDER.index(r["policy"]) if r["policy"] in ORDER else 9),
    )
    for run in ordered:
        m, s = run["measured"], run["simulated"]
        hops = [len(r["hops"]) for r in run["per_request"] if "hops" in r]
        lines.append(
            f"| {run['rate']:g}, {run['l_out']}, {run['requests']} | {run['policy']} "
            f"| {_fmt(m.get('per_token_time_mean'))} | {_fmt(s.get('per_token_time_mean'))} "
            f"| {_fmt(m.get('ttft_mean'))} | {_fmt(s.get('ttft_mean'))} "
            f"| {_fmt(m.get('tpot_mean'))} | {_fmt(s.get('tpot_mean'))} "
            f"| {_fmt(m.get('waiting_mean'))} | {_fmt(s.get('waiting_mean'))} "
            f"| {np.mean(hops) if hops else math.nan:.2f} | {s.get('hops_mean', math.nan):.2f} |"
        )
    lines.append("")
    lines.append("| rate, l_out | policy | per-token vs petals, measured | simulated | sim error |")
    lines.append("|---|---|---:|---:|---:|")
    cells = sorted({(run["rate"], run["l_out"]) for run in report["runs"]})
    for rate, l_out in cells:
        runs = {run["policy"]: run for run in report["runs"] if (run["rate"], run["l_out"]) == (rate, l_out)}
        base = runs.get("petals")
        for policy in sorted(runs, key=lambda p: ORDER.index(p) if p in ORDER else len(ORDER)):
            measured, simulated = runs[policy]["measured"], runs[policy]["simulated"]
            if not measured:
                continue
            error = simulated["per_token_time_mean"] / measured["per_token_time_mean"] - 1
            gains = ["-", "-"]
            if base is not None and base["measured"] and policy != "petals":
                gains = [
                    f"{1 - ours['per_token_time_mean'] / theirs['per_token_time_mean']:.0%} faster"
                    for ours, theirs in ((measured, base["measured"]), (simulated, base["simulated"]))
                ]
            lines.append(f"| {rate:g}, {l_out} | {policy} | {gains[0]} | {gains[1]} | {error:+.0%} |")
    if scale != 1:
        lines.append(f"\nTimes at the emulation's scale k = {scale:g}; divide by k for paper-scale seconds.")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scenario", type=Path, default=SCENARIO)
    parser.add_argument(
        "--policies", default="petals,proposed", help="comma-separated: petals, proposed, chains"
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
        "time whatever else runs (paper 000's model; swarm-server --compute-delay-overlap); serial = "
        "one step (or batched decode) at a time",
    )
    parser.add_argument(
        "--run-timeout", type=float, default=900.0, help="seconds allowed after the last arrival"
    )
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "netem")
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/lsw-experiment"), help="model and logs")
    parser.add_argument("--write-benchmarks", action="store_true", help="put the table into BENCHMARKS.md")
    parser.add_argument(
        "--merge",
        action="store_true",
        help="keep the runs already in OUT/table2.json for other (policy, rate, l_out) and add these "
        "(e.g. a later `--policies chains` beside an earlier petals/proposed run)",
    )
    args = parser.parse_args(argv)
    reason = netns_works()
    if reason is not None:
        print(f"experiment: {reason}", file=sys.stderr)
        return 2
    policies = [p for p in args.policies.split(",") if p]
    unknown = set(policies) - set(POLICY_ALGO)
    if unknown:
        parser.error(f"unknown policies {sorted(unknown)} (known: {', '.join(POLICY_ALGO)})")
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
        fresh = {(p, c.rate, c.l_out) for p in policies for c in cells}
        earlier = [r for r in previous["runs"] if (r["policy"], r["rate"], r["l_out"]) not in fresh]
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
            for policy in policies:
                run = run_policy(
                    emulation, policy, cell, args, raw, plans, tiny, model_dir, requests, join_order,
                    client_site, control_site,
                )  # fmt: skip
                run["join_order"] = [plans[j].name for j in join_order] if policy == "petals" else None
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


def command_of(config: dict) -> str:
    policies = "" if config["policies"] == "petals,proposed" else f" --policies {config['policies']}"
    return (
        f".venv/bin/python scripts/experiment.py{policies} --rates {config['rates']} "
        f"--l-out {config['l_out']} --requests {config['requests']} --time-scale {config['time_scale']:g} "
        f"--client-cluster {config['client_cluster']} --seed {config['seed']} "
        f"--gpu-model {config['gpu_model']}{' --merge' if config.get('merge') else ''} --write-benchmarks"
    )


def benchmarks_section(report: dict, table: str) -> str:
    """The BENCHMARKS.md section: the commands, the table; the analysis lives in the hand-written part."""
    runs = [*report.get("merged", []), {"config": report["config"], "wall_s": report["wall_s"]}]
    commands = "\n".join(
        f"{command_of(run['config'])}   # {(run['wall_s'] or 0) / 60:.0f} min" for run in runs
    )
    pings = report.get("pings", [])
    worst = max(
        (p["measured_ms"] / p["configured_ms"] - 1 for p in pings if p["configured_ms"]), default=0.0, key=abs
    )
    delayer = report.get("delayer") or {}
    notes = NOTES_PATH.read_text() if NOTES_PATH.exists() else ""
    latest = " (the latest run)" if report.get("merged") else ""
    return (
        f"{HEADER}\n\nCommands (as root, wall time on this 2-core machine; later ones add their runs "
        f"to the earlier ones' with `--merge`):\n\n"
        f"```\n{commands}\n```\n\n"
        f"Network{latest}: {len(pings)} site pairs, delay by `{report.get('delay_mode')}`; "
        f"every pair's ping RTT within {abs(worst):.1%} of the scenario; "
        f"delayer: {delayer.get('released', 0):,} packets, "
        f"mean release {delayer.get('lateness_mean_ms', 0):+.2f} ms from due, "
        f"{delayer.get('released_over_1ms_late', 0):,} released > 1 ms late, "
        f"{delayer.get('dropped', 0)} dropped. "
        f"Averages in seconds; `simulated` is `scheduler.sim` on the same swarm and arrivals "
        f"(see `scripts/experiment.py`).\n\n"
        f"{table}\n{notes}"
    )


NOTES_PATH = ROOT / "results" / "netem" / "notes.md"

if __name__ == "__main__":
    sys.exit(main())
