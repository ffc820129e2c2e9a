"""Regenerate Sun et al., Tables 4-5 and Sun, He and Hou, Table 1 with the simulator, side by side with
the papers.

Writes `results/table4.md`, `results/table5.md`, `results/table1_paper001.md` and one PNG per table.
Usage: .venv/bin/python -m benchmarks.scheduling.paper_tables [--seeds 20] [--out results]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from tqdm import tqdm

from llm_swarm.scheduler.sim.monte_carlo import CellConfig, run_cell
from llm_swarm.scheduler.sim.plots import plot_comparison

CELLS = [(0.1, 64), (0.1, 128), (0.5, 64), (0.5, 128)]  # (rate, l_out) columns of Tables 4-5
# Sun et al., Table 4 / Table 5: (experiment, MATLAB simulator) per cell, in CELLS order.
TABLE4 = {
    (0, "petals"): [(6.23, 5.33), (4.76, 4.74), (6.28, 5.33), (5.14, 4.74)],
    (0, "cg-bp"): [(1.92, 1.59), (1.43, 0.92), (2.00, 1.59), (1.34, 0.92)],
    (1, "petals"): [(5.44, 5.17), (4.60, 4.58), (5.56, 5.17), (4.79, 4.58)],
    (1, "cg-bp"): [(1.78, 1.65), (1.04, 0.83), (1.88, 1.65), (1.11, 0.83)],
    (2, "petals"): [(5.30, 4.85), (4.85, 4.07), (5.34, 4.85), (5.25, 4.07)],
    (2, "cg-bp"): [(1.79, 1.59), (1.31, 0.92), (1.94, 1.59), (1.37, 0.92)],
}
TABLE5 = {
    ("abovenet", "petals"): [(4.98, 4.75), (4.03, 3.88), (5.26, 5.11), (4.58, 4.10)],
    ("abovenet", "cg-bp"): [(1.86, 1.63), (1.44, 1.36), (1.97, 1.83), (1.35, 1.05)],
    ("bellcanada", "petals"): [(6.31, 6.03), (3.82, 3.49), (6.74, 6.19), (4.16, 3.41)],
    ("bellcanada", "cg-bp"): [(1.33, 1.41), (1.26, 0.92), (1.49, 1.41), (1.11, 0.92)],
    ("gtsce", "petals"): [(7.05, 6.12), (4.69, 3.47), (6.89, 5.97), (4.89, 3.37)],
    ("gtsce", "cg-bp"): [(1.38, 1.41), (0.95, 0.91), (1.35, 1.40), (1.07, 0.91)],
}
# Sun, He and Hou, Table 1: mean response time (s), LLaMA-2-7B, 1000 Azure-trace requests.
TABLE1 = {"petals": 31.4, "cg-bp": 19.8, "jffc-only": 10.0, "chains": 7.3}
TABLE1_NAMES = {
    "petals": "PETALS",
    "cg-bp": "BPRR (CG-BP + WS-RR)",
    "jffc-only": "JFFC only",
    "chains": "GBP-CR + GCA + JFFC",
}
# Sun, He and Hou, Table 1 set-up: caches sized for 2048 + 128 tokens (with 40/20 GB slices this gives
# footnote 13's 24/12 blocks at c = 35); every request replays its own trace lengths (no caps).
TABLE1_CONFIG = {"scenario": "ripe", "arrivals": "azure", "requests": 1000, "l_in": 2048, "l_out": 128}
# Per-block time factors: 1 = Sun, He and Hou footnote 11 profile; 8 = brings our mean service time to
# the ~7 s Sun, He and Hou measures (Table 1), i.e. the testbed's runtime overheads (see BENCHMARKS.md).
TABLE1_COMPUTE_SCALES = (1.0, 8.0)
DEVIATION = 0.30


def deviation_mark(ours: float, paper: float) -> str:
    return " **!**" if abs(ours - paper) > DEVIATION * paper else ""


def per_token_table(rows: dict, configs: dict, seeds: int, bar: tqdm, label: str) -> tuple[list[str], dict]:
    """Markdown rows `paper exp (paper sim) | ours` for every cell, plus the reductions vs PETALS."""
    ours: dict = {}
    for key, config in configs.items():
        ours[key] = []
        for rate, l_out in CELLS:
            summary = run_cell(CellConfig(**config, rate=rate, l_out=l_out), seeds)
            ours[key].append(summary["per_token_time_mean"])
            bar.update()
    lines = [
        f"| {label} | algorithm | " + " | ".join(f"{r} req/s, l_out {n}" for r, n in CELLS) + " |",
        "|---|---|" + "---|" * len(CELLS),
    ]
    for key, paper in rows.items():
        cells = [
            f"{e:.2f} ({s:.2f}) / **{o:.2f}**{deviation_mark(o, e)}"
            for (e, s), o in zip(paper, ours[key], strict=True)
        ]
        lines.append(f"| {key[0]} | {key[1]} | " + " | ".join(cells) + " |")
    lines += ["", "Reduction of cg-bp vs PETALS (ours / paper experiment):", ""]
    for group in dict.fromkeys(k[0] for k in rows):
        reductions = []
        for i in range(len(CELLS)):
            mine = 1 - ours[(group, "cg-bp")][i] / ours[(group, "petals")][i]
            paper = 1 - rows[(group, "cg-bp")][i][0] / rows[(group, "petals")][i][0]
            reductions.append(f"{mine:.0%} / {paper:.0%}")
        lines.append(f"- {group}: " + ", ".join(reductions))
    return lines, ours


def save_plot(rows: dict, ours: dict, title: str, path: Path) -> None:
    labels = [f"{k[0]} {k[1]} {r}/{n}" for k in rows for r, n in CELLS]
    series = {
        "paper experiment": [e for k in rows for e, _ in rows[k]],
        "paper simulator": [s for k in rows for _, s in rows[k]],
        "ours": [v for k in rows for v in ours[k]],
    }
    plot_comparison(labels, series, "avg per-token time (s)", title, path)


HEADER = (
    "Cells: paper experiment (paper MATLAB simulator) / **ours**; **!** marks a deviation of more "
    "than 30% from the paper's experiment (explained in BENCHMARKS.md)."
)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=20)
    parser.add_argument("--table1-seeds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path("results"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    t4 = {key: {"scenario": "clustered", "policy": key[1], "client_cluster": key[0]} for key in TABLE4}
    t5 = {key: {"scenario": key[0], "policy": key[1]} for key in TABLE5}
    total = (len(t4) + len(t5)) * len(CELLS) + len(TABLE1) * len(TABLE1_COMPUTE_SCALES)
    with tqdm(total=total, desc="cells", file=sys.stderr) as bar:
        started = time.perf_counter()
        lines, ours4 = per_token_table(TABLE4, t4, args.seeds, bar, "client cluster")
        t4_s = time.perf_counter() - started
        (args.out / "table4.md").write_text(
            f"# Sun et al., Table 4 (clustered, {args.seeds} seeds, {t4_s:.1f} s)\n\n{HEADER}\n\n"
            + "\n".join(lines)
            + "\n"
        )
        save_plot(TABLE4, ours4, "Table 4: clustered scenario", args.out / "table4.png")
        lines, ours5 = per_token_table(TABLE5, t5, args.seeds, bar, "topology")
        (args.out / "table5.md").write_text(
            f"# Sun et al., Table 5 (scattered, {args.seeds} seeds)\n\n{HEADER}\n\n" + "\n".join(lines) + "\n"
        )
        save_plot(TABLE5, ours5, "Table 5: scattered scenario", args.out / "table5.png")
        ours1 = {}
        for scale in TABLE1_COMPUTE_SCALES:
            for policy in TABLE1:
                config = CellConfig(**TABLE1_CONFIG, policy=policy, setup="none", compute_scale=scale)
                summary = run_cell(config, args.table1_seeds)
                ours1[scale, policy] = tuple(summary[f"{k}_mean"] for k in ("total", "waiting", "service"))
                bar.update()
    sections = []
    for scale in TABLE1_COMPUTE_SCALES:
        lines = [
            f"## per-block times x {scale:g}",
            "",
            "| algorithm | paper mean response (s) | ours: mean response / waiting / service (s) |",
            "|---|---|---|",
        ]
        for policy, paper in TABLE1.items():
            total_s, wait_s, service_s = ours1[scale, policy]
            mark = deviation_mark(total_s, paper)
            lines.append(
                f"| {TABLE1_NAMES[policy]} | {paper:.1f} | **{total_s:.2f}**{mark} / "
                f"{wait_s:.2f} / {service_s:.2f} |"
            )
        sections.append("\n".join(lines))
    (args.out / "table1_paper001.md").write_text(
        f"# Sun, He and Hou, Table 1 (RIPE Atlas + Azure trace, 1000 requests, {args.table1_seeds} seeds)\n\n"
        "x 1: Sun, He and Hou footnote 11 profile; x 8: per-block times scaled to the paper's measured ~7 s "
        "mean service time.\n\n" + "\n\n".join(sections) + "\n"
    )
    plot_comparison(
        [TABLE1_NAMES[p] for p in TABLE1],
        {"paper": list(TABLE1.values())}
        | {f"ours x{k:g}": [ours1[k, p][0] for p in TABLE1] for k in TABLE1_COMPUTE_SCALES},
        "mean response time (s)",
        "Sun, He and Hou, Table 1",
        args.out / "table1_paper001.png",
    )
    print(f"Table 4: {t4_s:.1f} s for {len(t4) * len(CELLS) // 2} cells x 2 policies x {args.seeds} seeds")
    return 0


if __name__ == "__main__":
    sys.exit(main())
