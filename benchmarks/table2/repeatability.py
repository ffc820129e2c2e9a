"""How far two runs of the same Table 2 cells on the emulated network measure apart.

    .venv/bin/python -m benchmarks.table2.repeatability FIRST/table2.json SECOND/table2.json

Runs are matched by (plan, rate, l_out); for each match it prints the four metrics the simulator is
judged on (`benchmarks/scheduling/sim_contended.py`: mean per-token time, mean TTFT, TPOT p50 and p99) in
both runs and how far the second is from the first. A simulator cannot be held to a bound tighter
than the spread between two measurements of the same thing. Where the runs recorded it
(`host_cpu`), how busy the host's cores were and how much of that was the swarm's own processes.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

# the metrics a Table 2 run is judged on (the simulator's too: `benchmarks/scheduling/sim_contended.py`)
METRICS = (
    ("per_token_time_mean", "per-token"),
    ("ttft_mean", "TTFT"),
    ("tpot_p50", "TPOT p50"),
    ("tpot_p99", "TPOT p99"),
)


def runs_by_cell(path: Path) -> dict[tuple, dict]:
    """(plan, rate, l_out) -> the last run of that cell in a table2.json report."""
    report = json.loads(path.read_text())
    return {(run.get("plan") or run["policy"], run["rate"], run["l_out"]): run for run in report["runs"]}


def relative(first: float, second: float) -> float:
    return second / first - 1 if first else float("nan")


def host_use(run: dict) -> str:
    host = run.get("host_cpu")
    if not host:
        return "not recorded"
    return f"{host['busy_cores']:.2f} of {host['cores']} busy, swarm {host['swarm_cores']:.2f}"


def compare(first: Path, second: Path) -> list[str]:
    """Markdown rows: every cell both reports ran."""
    a, b = runs_by_cell(first), runs_by_cell(second)
    names = " / ".join(label for _, label in METRICS)
    rows = [
        f"| cell (plan, req/s, l_out) | first: {names} (s) | second (s) | second vs first (%) "
        "| failed (first / second) | host cores (first; second) |",
        "|---|---|---|---|---|---|",
    ]
    for cell in sorted(a.keys() & b.keys(), key=str):
        one, two = a[cell]["measured"], b[cell]["measured"]
        values = [(one.get(key, float("nan")), two.get(key, float("nan"))) for key, _ in METRICS]
        rows.append(
            f"| {cell[0]}, {cell[1]:g}, {cell[2]} "
            f"| {' / '.join(f'{x:.3f}' for x, _ in values)} "
            f"| {' / '.join(f'{y:.3f}' for _, y in values)} "
            f"| {' / '.join(f'{relative(x, y) * 100:+.0f}' for x, y in values)} "
            f"| {len(a[cell].get('failed', []))} / {len(b[cell].get('failed', []))} "
            f"| {host_use(a[cell])}; {host_use(b[cell])} |"
        )
    return rows


def main() -> int:
    if len(sys.argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    print("\n".join(compare(Path(sys.argv[1]), Path(sys.argv[2]))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
