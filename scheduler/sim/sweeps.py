"""Figure sweeps of paper 000 (Fig. 6-9): per-token time vs #servers, eta, rate or l_out, per policy.

`sweep` is pure (returns rows); `write_csv` is the only I/O here (plots live in `plots`).
Defaults follow the figures: C = 0.4 x #nodes, eta = 0.2, lambda = 0.5, N_R = 100, l_in = 20,
l_out = 128; the rate sweep uses N_R = 200*lambda as Fig. 8 does.
"""

from __future__ import annotations

import csv
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

from scheduler.sim.runner import CellConfig, run_cell
from scheduler.sim.scenarios import TOPOLOGY_NODES

SWEEP_POLICIES = ("petals", "opt-num", "opt-order", "opt-rr", "proposed")
SWEEPS = ("servers", "eta", "rate", "l-out")


def sweep_points(kind: str, base: CellConfig) -> list[tuple[float, CellConfig]]:
    """(x value, config) for every point of the sweep `kind` around `base`."""
    nodes = TOPOLOGY_NODES.get(base.scenario, 23)
    if kind == "servers":
        return [
            (c, replace(base, num_servers=c))
            for c in sorted({max(3, round(f * nodes)) for f in (0.2, 0.3, 0.4, 0.5, 0.6)})
        ]
    if kind == "eta":
        return [(eta, replace(base, fast_fraction=eta)) for eta in (0.1, 0.2, 0.3, 0.4, 0.5)]
    if kind == "rate":
        return [
            (r, replace(base, rate=r, requests=max(10, round(200 * r)))) for r in (0.1, 0.3, 0.5, 0.7, 0.9)
        ]
    if kind == "l-out":
        return [(n, replace(base, l_out=n)) for n in (64, 128, 256, 384, 512)]
    raise ValueError(f"unknown sweep {kind!r}; choose from {', '.join(SWEEPS)}")


def sweep(
    kind: str,
    base: CellConfig,
    seeds: int,
    policies: Sequence[str] = SWEEP_POLICIES,
    progress: Callable[[], None] | None = None,
) -> list[dict[str, float | str]]:
    """One row per (point, policy): the x value, the policy and the averaged SPEC 6 summary."""
    rows: list[dict[str, float | str]] = []
    for x, config in sweep_points(kind, base):
        for policy in policies:
            summary = run_cell(replace(config, policy=policy), seeds)
            rows.append({"sweep": kind, "x": x, "policy": policy, **summary})
            if progress is not None:
                progress()
    return rows


def write_csv(rows: Sequence[dict[str, float | str]], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
