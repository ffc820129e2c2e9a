"""Figure sweeps of Sun et al. (Fig. 6-9): per-token time vs #servers, eta, rate or l_out, per policy.

`sweep_points` and `sweep` are pure (they return configs / rows); `write_csv` is the only I/O here
(plots live in `plots`). The x values and defaults are the figures' own: Fig. 6 varies C (AboveNet
6-22, BellCanada and GTS-CE 10-40), Fig. 7 eta in 0.1-0.5, Fig. 8 lambda in 0.05-2 with
N_R = 200*lambda, Fig. 9 l_out in 64-512; otherwise C = 0.4 x #nodes, eta = 0.2, lambda = 0.5,
N_R = 100, l_in = 20, l_out = 128. A base config's explicit values override those defaults.
"""

from __future__ import annotations

import csv
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

from llm_swarm.scheduler.sim.monte_carlo import CellConfig, run_cell
from llm_swarm.scheduler.sim.scenarios import TOPOLOGY_NODES

SWEEP_POLICIES = ("petals", "opt-num", "opt-order", "opt-rr", "cg-bp")
SWEEPS = ("servers", "eta", "rate", "l-out")
FIG6_SERVERS = {
    "abovenet": (6, 10, 15, 20, 22),
    "bellcanada": (10, 15, 20, 25, 40),
    "gtsce": (10, 15, 20, 25, 40),
}
FIG7_ETA = (0.1, 0.2, 0.3, 0.4, 0.5)
FIG8_RATES = (0.05, 0.1, 0.5, 1.0, 2.0)
FIG9_L_OUT = (64, 128, 256, 384, 512)
DEFAULT_SERVER_SHARE, DEFAULT_ETA = 0.4, 0.2


def figure_base(base: CellConfig) -> CellConfig:
    """Fig. 6-9's deployment where `base` leaves it open: C = 0.4 x #nodes, eta = 0.2."""
    if base.scenario not in TOPOLOGY_NODES:
        raise ValueError(
            f"figure sweeps need a Topology Zoo scenario ({', '.join(TOPOLOGY_NODES)}), not {base.scenario!r}"
        )
    servers = base.num_servers or round(DEFAULT_SERVER_SHARE * TOPOLOGY_NODES[base.scenario])
    eta = DEFAULT_ETA if base.fast_fraction is None else base.fast_fraction
    return replace(base, num_servers=servers, fast_fraction=eta)


def sweep_points(kind: str, base: CellConfig) -> list[tuple[float, CellConfig]]:
    """(x value, config) for every point of the sweep `kind` around `base`."""
    if kind not in SWEEPS:
        raise ValueError(f"unknown sweep {kind!r}; choose from {', '.join(SWEEPS)}")
    config = figure_base(base)
    if kind == "servers":
        return [(c, replace(config, num_servers=c)) for c in FIG6_SERVERS[base.scenario]]
    if kind == "eta":
        return [(eta, replace(config, fast_fraction=eta)) for eta in FIG7_ETA]
    if kind == "rate":
        return [(r, replace(config, rate=r, requests=max(10, round(200 * r)))) for r in FIG8_RATES]
    return [(n, replace(config, l_out=n)) for n in FIG9_L_OUT]


def sweep(
    kind: str,
    base: CellConfig,
    seeds: int,
    policies: Sequence[str] = SWEEP_POLICIES,
    progress: Callable[[], None] | None = None,
) -> list[dict[str, float | str]]:
    """One row per (point, policy): the x value, the policy and the averaged summary of
    docs/reference.md 6."""
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
