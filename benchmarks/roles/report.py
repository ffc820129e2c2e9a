"""Tables of `benchmarks/roles/emulated.py`'s raw results, each run beside the contended simulator's
prediction of the same swarm, arrivals and lengths, and the role planner's choice for the swarm.

    .venv/bin/python -m benchmarks.roles.report RAW.json [RAW.json ...] [--slo-ttft 5 --slo-tpot 0.2]
        [--write]

The prediction (`benchmarks/roles/sim.py`) uses the run's own inputs: the client's measured round trip to
each server (`wait-online`'s info-RPC ping), the session set-up measured on the idle swarm, the tiny
block's CPU costs measured before the run, the emulated delays, and the hand-off link at the median
rate the servers' link probes announced (else the configured one).
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

from benchmarks.common import bench_parser
from benchmarks.markdown import read_section, write_section
from benchmarks.roles.sim import (
    OPERATOR_ROLES,
    SERVER_NAMES,
    CpuCosts,
    EmulatedSwarm,
    attainment,
    measured_times,
    percentiles,
    planner_choice,
    rate_goodput,
    simulate_swarm,
    simulated_summary,
    trace_requests,
)
from llm_swarm.scheduler.sim.metrics import Slo
from llm_swarm.scheduler.sim.workload import Request, load_azure_trace
from llm_swarm.swarm.prefill_cost import STREAM_CHUNK_TOKENS
from llm_swarm.swarm.units import parse_bytes

SECTION = "## Prefill/decode roles on the emulated swarm"


def swarm_of(raw: dict, link_bytes_per_s: float | None) -> EmulatedSwarm:
    a = raw["args"]
    link_mbps = link_bytes_per_s * 8 / 1e6 if link_bytes_per_s else a["link_mbps"]
    return EmulatedSwarm(
        compute_delay=a["compute_delay"],
        rich_per_token=a["rich_per_token"],
        slow_per_token=a["slow_per_token"],
        client_rtt_s=a["client_rtt_ms"] / 1e3,
        uplink_mbps=a["uplink"],
        link_rtt_s=0.002,
        link_mbps=link_mbps,
        memory_bytes=parse_bytes(a["memory"]),
        num_blocks=6,
        hidden=512,
        cpu=CpuCosts(**raw["cpu"]),
        prefill_memory_bytes=parse_bytes(a.get("prefill_memory") or a["memory"]),
        rich_compute_delay=a.get("rich_compute_delay"),
    )


def announced_link(result: dict) -> float | None:
    rates = [r for row in result.get("links", {}).values() for r in row.values() if r]
    return statistics.median(rates) if rates else None


def rtts_of(result: dict) -> list[float] | None:
    online = result.get("online", {})
    by_kind = {name.split("-", 1)[1]: info.get("rtt_info_s") for name, info in online.items()}
    rtts = [by_kind.get(name) for name in SERVER_NAMES]
    return None if None in rtts else rtts


def fmt(value: float, digits: int = 2) -> str:
    return "-" if not math.isfinite(value) else f"{value:.{digits}f}"


def announced_roles(announced: dict | None, names: dict[str, str]) -> str | None:
    """`auto`: the roles the servers announced (peer id -> role) as `--roles` text in SERVER_NAMES'
    order (None: every server both, or nothing recorded)."""
    if not announced:
        return None
    by_name = {names.get(peer[-8:], ""): role for peer, role in announced.items()}
    roles = [by_name.get(name, "both") for name in SERVER_NAMES]
    return None if all(role == "both" for role in roles) else ",".join(roles)


def rows_of(raw: dict, slo: Slo) -> tuple[list[dict], dict]:
    """Per (mode, rate): measured and simulated numbers; and per mode the goodputs."""
    rows, goodputs = [], {}
    links = next(
        (
            rate
            for mode in ("roles", "auto", "colocated")
            if (rate := announced_link(raw["modes"].get(mode, {})))
        ),
        None,
    )
    swarm = swarm_of(raw, links)
    disaggregate = "scheduler" if raw["args"].get("scheduler") else "auto"
    spread: dict[str, dict[str, tuple[int, int]]] = {}  # mode -> prefill server -> (measured, simulated)
    for mode, result in raw["modes"].items():
        rtts = rtts_of(result)
        online = result.get("online", {})
        names = {info["peer_id"][-8:]: name.split("-", 1)[1] for name, info in online.items()}
        rates, measured_att, simulated_att = [], [], []
        for entry, batch in zip(result["rates"], raw["batches"], strict=True):
            # `auto`: the roles the scheduler had handed out when the rate's load ended
            roles = {"colocated": None, "roles": OPERATOR_ROLES}.get(mode)
            if mode == "auto":
                roles = announced_roles(entry.get("announced_roles") or result.get("announced_roles"), names)
            requests = [Request(**r) for r in batch["requests"]]
            ttft, tpot, failed = measured_times(entry["requests"])
            # runs before 2026-11-26 handed each prompt's cache off after the prompt, later ones
            # stream it while the prompt runs (the client's log says which)
            streamed = any("streamed" in r.get("prefill", "") for r in entry["requests"])
            records, stats = simulate_swarm(
                swarm,
                roles,
                requests,
                result.get("setup_s", 0.0),
                rtts,
                disaggregate,
                STREAM_CHUNK_TOKENS if streamed else 0,
                bool(raw["args"].get("load_routing")),
                bool(raw["args"].get("early_first_token")),
            )
            counts = spread.setdefault(mode, {})
            for row in entry["requests"]:
                if row.get("prefill_server") and row.get("prefill_server") != row.get("decode_server"):
                    name = names.get(row["prefill_server"], row["prefill_server"])
                    counts[name] = (counts.get(name, (0, 0))[0] + 1, counts.get(name, (0, 0))[1])
            for key, value in stats.items():
                if key.startswith("prompts_on:"):
                    name = key.split(":", 1)[1]
                    counts[name] = (counts.get(name, (0, 0))[0], counts.get(name, (0, 0))[1] + int(value))
            sim = simulated_summary(records, slo)
            handed = sum(r.get("prefill", "").startswith("hand-off") for r in entry["requests"])
            replayed = sum(r.get("prefill", "").startswith("replay") for r in entry["requests"])
            row = {
                "mode": mode if mode != "auto" else f"auto ({roles or 'colocated'})",
                "rate": entry["rate"],
                "done": len(ttft),
                "total": len(entry["requests"]),
                "handed": handed,
                "replayed": replayed,
                "sim_handed": int(stats.get("handoffs", 0)),
                "ttft": percentiles(ttft),
                "tpot": percentiles(tpot),
                "attainment": attainment(ttft, tpot, failed, slo),
                "sim": sim,
            }
            rows.append(row)
            rates.append(entry["rate"])
            measured_att.append(row["attainment"])
            simulated_att.append(sim["attainment"])
        goodputs[mode] = (rate_goodput(rates, measured_att), rate_goodput(rates, simulated_att))
    return rows, {"goodputs": goodputs, "link_bytes_per_s": links, "swarm": swarm, "spread": spread}


def table(raw_files: list[dict], slo: Slo, plans: list[str]) -> list[str]:
    lines = [
        "| links between servers | serving | rate (req/s) | done | prompts handed off (sim) "
        "| TTFT p50 / p99 (s): measured (sim) | TPOT p50 / p99 (s): measured (sim) "
        "| attainment: measured (sim) |",
        "|---|---|---:|---:|---:|---|---|---|",
    ]
    summary = []
    # (link, scheduler) -> colocated goodputs (measured, simulated)
    colocated: dict[tuple[str, bool], tuple[float, float]] = {}
    for raw, plan in zip(raw_files, plans, strict=True):
        rows, extra = rows_of(raw, slo)
        where = f"{raw['args']['link_mbps']:g} Mbit/s"
        a = raw["args"]
        scheduled = bool(a.get("scheduler"))
        memory = (
            f", prefill servers {a['prefill_memory']}"
            if a.get("prefill_memory", a["memory"]) != a["memory"]
            else ""
        )
        routed = ", scheduler" if scheduled else ""
        # every server's announced prefill time measured on this prompt length (default: 20 tokens)
        if a.get("prefill_tokens"):
            routed += f", prefill measured at {a['prefill_tokens']} tokens"
        if a.get("label"):
            routed += f", {a['label']}"
        for row in rows:
            sim = row["sim"]
            handed = f"{row['handed']}" + (f" (+{row['replayed']} replayed)" if row["replayed"] else "")
            label = row["mode"] + (memory if row["mode"] != "colocated" else "") + routed
            lines.append(
                f"| {where} | {label} | {row['rate']:g} | {row['done']}/{row['total']} "
                f"| {handed} ({row['sim_handed']}) "
                f"| {fmt(row['ttft'][0])} / {fmt(row['ttft'][1])} "
                f"({fmt(sim['ttft_p50'])} / {fmt(sim['ttft_p99'])}) "
                f"| {fmt(row['tpot'][0], 3)} / {fmt(row['tpot'][1], 3)} "
                f"({fmt(sim['tpot_p50'], 3)} / {fmt(sim['tpot_p99'], 3)}) "
                f"| {fmt(row['attainment'])} ({fmt(sim['attainment'])}) |"
            )
        goodputs = extra["goodputs"]
        link = extra["link_bytes_per_s"]
        cells = [f"{mode} {g[0]:g} ({g[1]:g}) req/s" for mode, g in goodputs.items()]
        ratio = ""
        if "colocated" in goodputs:
            colocated[where, scheduled] = goodputs["colocated"]
        for other in ("roles", "auto"):
            if (where, scheduled) in colocated and other in goodputs:
                (cm, cs), (rm, rs) = colocated[where, scheduled], goodputs[other]
                name = f"roles{memory}" if other == "roles" else "the scheduler's roles (auto)"
                ratio += f"; {name} / colocated: {_ratio(rm, cm)} measured ({_ratio(rs, cs)} simulated)"
        probed = f"{link * 8 / 1e6:.0f} Mbit/s" if link else "none"
        # runs before the prefill server was recorded per request: measured counts unknown ("-")
        rows_all = [r for m in raw["modes"].values() for e in m["rates"] for r in e["requests"]]
        logged = any("prefill_server" in r for r in rows_all)
        spread = "; ".join(
            f"{mode}: "
            + ", ".join(f"{name} {m if logged else '-'} ({sim})" for name, (m, sim) in sorted(counts.items()))
            for mode, counts in extra["spread"].items()
            if counts
        )
        summary.append(
            f"- {where}{memory}{routed}: goodput measured (simulated) {', '.join(cells)}{ratio}; "
            f"link probes announced (median) {probed}; the role planner chooses {plan}"
            + (f"; prompts per prefill server, all rates, measured (sim): {spread}" if spread else "")
        )
    return lines + [""] + summary


def _ratio(a: float, b: float) -> str:
    if b > 0:
        return f"{a / b:.2f}x"
    return "n/a (colocated 0)" if a > 0 else "n/a (both 0)"


def plan_for(raw: dict, slo: Slo) -> str:
    a = raw["args"]
    _, extra = rows_of(raw, slo)
    trace = load_azure_trace()

    def requests_at(rate: float, seed: int) -> list[Request]:
        count = max(40, round(60 * rate))
        return trace_requests(
            trace, rate, count, a["length_scale"], a["max_l_in"], a["max_l_out"], 100 + seed
        )

    return planner_choice(extra["swarm"], slo, a["max_l_in"], a["max_l_out"], requests_at)


def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("raw", nargs="+")
    parser.add_argument("--slo-ttft", type=float, default=5.0)
    parser.add_argument("--slo-tpot", type=float, default=0.2)
    parser.add_argument("--write", action="store_true", help="replace the table in BENCHMARKS.md's section")
    args = parser.parse_args()
    slo = Slo(args.slo_ttft, args.slo_tpot)
    raws = [json.loads(Path(path).read_text()) for path in args.raw]
    plans = [plan_for(raw, slo) for raw in raws]
    lines = table(raws, slo, plans)
    checked = sum(m.get("checked", 0) for raw in raws for m in raw["modes"].values())
    wrong = sum(len(m.get("wrong", [])) for raw in raws for m in raw["modes"].values())
    lines.append(f"- outputs checked against local transformers: {checked}, differing: {wrong}")
    print("\n".join(lines))
    if args.write:
        _replace_table(lines)


def _replace_table(lines: list[str]) -> None:
    """The section's table and summary lines (from its first `|` line to the line before 'Reading it')."""
    section = read_section(SECTION)
    first = section.index("\n| ") + 1
    last = section.index("\nReading it")
    write_section(SECTION, section[:first] + "\n".join(lines) + "\n" + section[last:])


if __name__ == "__main__":
    main()
