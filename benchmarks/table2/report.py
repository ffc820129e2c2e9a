"""The experiment's report: the markdown table (measured beside simulated), the command lines that
produced it, and its BENCHMARKS.md section."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from .plans import run_attainment

ROOT = Path(__file__).resolve().parents[2]

HEADER = "## Emulated geo-distributed swarm: Sun et al., Table 2"
ORDER = ["petals", "cg-bp", "chains"]  # table rows per cell
DEFAULT_OUT = "results/netem"  # benchmarks/table2/run.py's --out
NOTES_PATH = ROOT / "results" / "netem" / "notes.md"  # the hand-written analysis, appended


def _fmt(value: float | None) -> str:
    return "-" if value is None or not math.isfinite(value) else f"{value:.3f}"


def markdown(report: dict) -> str:
    scale = report["config"]["time_scale"]
    lines = [
        "| rate (req/s), l_out, N | policy | per-token, measured | simulated | TTFT, measured | simulated "
        "| TPOT, measured | simulated | waiting, measured | simulated | hops, measured | sim |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    ordered = sorted(report["runs"], key=lambda r: (r["rate"], r["l_out"], *_rank(r)))
    for run in ordered:
        m, s = run["measured"], run["simulated"]
        hops = [len(r["hops"]) for r in run["per_request"] if "hops" in r]
        lines.append(
            f"| {run['rate']:g}, {run['l_out']}, {run['requests']} | {_plan(run)} "
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
        runs = {_plan(run): run for run in report["runs"] if (run["rate"], run["l_out"]) == (rate, l_out)}
        base = runs.get("petals")
        for policy in sorted(runs, key=lambda p: _rank(runs[p])):
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
    lines.extend(slo_table(ordered))
    if scale != 1:
        lines.append(f"\nTimes at the emulation's scale k = {scale:g}; divide by k for paper-scale seconds.")
    return "\n".join(lines) + "\n"


def _plan(run: dict) -> str:
    """The run's plan: the policy, or `cg-bp R=128` for a fixed parameter (older reports: the policy)."""
    return run.get("plan") or run["policy"]


def _rank(run: dict) -> tuple[int, int]:
    """Table order: by policy (ORDER), a policy's default before its fixed-parameter plans."""
    policy = run["policy"]
    return (ORDER.index(policy) if policy in ORDER else len(ORDER), run.get("parameter") or 0)


def slo_table(runs: list[dict]) -> list[str]:
    """SLO attainment (fraction of requests within both targets; failed requests miss) measured vs
    simulated, and TTFT / TPOT p50 and p99 beside the simulator's, for the runs that had SLOs."""
    with_slo = [run for run in runs if run.get("slo") and "slo_attainment" in run["simulated"]]
    if not with_slo:
        return []
    lines = [
        "",
        "| rate, l_out | plan | SLOs: TTFT, TPOT (s) | attainment, measured | simulated "
        "| difference (points) | TTFT p50 / p99, measured | simulated "
        "| TPOT p50 / p99, measured | simulated |",
        "|---|---|---|---:|---:|---:|---|---|---|---|",
    ]
    for run in with_slo:
        m, s, slo = run["measured"], run["simulated"], run["slo"]
        measured = m.get("slo_attainment", math.nan)
        simulated = s["slo_attainment"]
        targets = ", ".join("-" if slo.get(k) is None else f"{slo[k]:g}" for k in ("ttft_s", "tpot_s"))
        lines.append(
            f"| {run['rate']:g}, {run['l_out']} | {_plan(run)} | {targets} "
            f"| {measured:.1%} | {simulated:.1%} | {100 * (measured - simulated):+.1f} "
            f"| {_fmt(m.get('ttft_p50'))} / {_fmt(m.get('ttft_p99'))} "
            f"| {_fmt(s.get('ttft_p50'))} / {_fmt(s.get('ttft_p99'))} "
            f"| {_fmt(m.get('tpot_p50'))} / {_fmt(m.get('tpot_p99'))} "
            f"| {_fmt(s.get('tpot_p50'))} / {_fmt(s.get('tpot_p99'))} |"
        )
    lines.extend(slo_sweep(with_slo))
    return lines


SWEEP = ((1.0, 1.0), (0.5, 1.0), (0.25, 1.0), (1.0, 0.85), (0.5, 0.85))  # (TTFT x, TPOT x) the targets


def slo_sweep(runs: list[dict], factors: tuple[tuple[float, float], ...] = SWEEP) -> list[str]:
    """Attainment at tighter targets from the same requests (measured / simulated): where the
    prediction starts to part from the measurement."""
    runs = [run for run in runs if "simulated_per_request" in run]
    if not runs:
        return []
    lines = [
        "",
        "| rate, l_out | plan | "
        + " | ".join(f"TTFT x{a:g}, TPOT x{b:g}: measured / simulated" for a, b in factors)
        + " |",
        "|---|---|" + "---:|" * len(factors),
    ]
    for run in runs:
        slo = run["slo"]
        cells = []
        for a, b in factors:
            ttft = None if slo.get("ttft_s") is None else a * slo["ttft_s"]
            tpot = None if slo.get("tpot_s") is None else b * slo["tpot_s"]
            measured, simulated = run_attainment(run, ttft, tpot)
            cells.append(f"{measured:.0%} / {simulated:.0%}")
        lines.append(f"| {run['rate']:g}, {run['l_out']} | {_plan(run)} | " + " | ".join(cells) + " |")
    return lines


def command_of(config: dict) -> str:
    policies = "" if config["policies"] == "petals,cg-bp" else f" --policies {_quoted(config['policies'])}"
    slos = "".join(
        f" --{flag} {config[key]:g}"
        for key, flag in (("slo_ttft", "slo-ttft"), ("slo_tpot", "slo-tpot"))
        if config.get(key) is not None
    )
    folder = _relative(config.get("out"))
    out = f" --out {folder}" if folder not in (None, DEFAULT_OUT) else ""
    return (
        f".venv/bin/python -m benchmarks.table2.run{policies} --rates {config['rates']} "
        f"--l-out {config['l_out']} --requests {config['requests']} --time-scale {config['time_scale']:g} "
        f"--client-cluster {config['client_cluster']} --seed {config['seed']} "
        f"--gpu-model {config['gpu_model']}{slos}{out}{' --merge' if config.get('merge') else ''}"
        f"{' --write-benchmarks' if config.get('write_benchmarks', True) else ''}"
    )


def _quoted(text: str) -> str:
    return f"'{text}'" if " " in text else text


def _relative(path: str | None) -> str | None:
    """A results folder as the command gives it: relative to the repository when inside it."""
    if path is None:
        return None
    resolved = Path(path).resolve()
    return str(resolved.relative_to(ROOT)) if resolved.is_relative_to(ROOT) else str(path)


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
        f"(see `benchmarks/table2/run.py`).\n\n"
        f"{table}\n{notes}"
    )
