"""The experiment's report: the markdown table (measured beside simulated), the command lines that
produced it, and its BENCHMARKS.md section."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
HEADER = "## Emulated geo-distributed swarm: paper 000 Table 2 (issue 8)"
ORDER = ["petals", "cg-bp", "chains"]  # table rows per cell
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


def command_of(config: dict) -> str:
    policies = "" if config["policies"] == "petals,cg-bp" else f" --policies {config['policies']}"
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
