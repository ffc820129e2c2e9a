"""Composing job servers (GBP-CR then GCA) and tuning the required capacity c (Sun, He and Hou, section 3;
docs/reference.md 3.4).

c trades service time for concurrency (Sun, He and Hou, Fig. 1): small c puts many blocks on each server
(short, fast chains of low capacity), large c leaves cache room for many concurrent jobs on longer
chains. `tune_capacity` scans `c = 1..c_max` and keeps the lowest c minimizing either Theorem 3.7's
lower bound on the mean response time of the GBP-CR + GCA chains (the default, section 3.2.3) or the
surrogate `c*K(c)` of eq. 14.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from llm_swarm.scheduler.algorithms.chains import DEFAULT_RHO_BAR, GbpCrPlacement, ServerChain, gbp_cr, gca
from llm_swarm.scheduler.algorithms.problem import ModelSpec, ServerSpec, floor_ratio
from llm_swarm.scheduler.algorithms.queueing import response_time_bounds

Objective = Literal["lower-bound", "surrogate"]


@dataclass(frozen=True)
class Composition:
    """GBP-CR placement for capacity c and the job servers GCA composes on it."""

    capacity: int  # c
    placement: GbpCrPlacement
    chains: tuple[ServerChain, ...]

    @property
    def service_rate(self) -> float:
        """`nu = sum_k c_k*mu_k` (Sun, He and Hou, eq. 4)."""
        return sum(chain.capacity * chain.service_rate for chain in self.chains)

    def response_time_bounds(self, arrival_rate: float) -> tuple[float, float]:
        return response_time_bounds([(c.service_rate, c.capacity) for c in self.chains], arrival_rate)


def max_capacity(servers: Sequence[ServerSpec], model: ModelSpec) -> int:
    """`c_max = floor((max_j M_j - s_m) / s_c)`: the most jobs any server can serve on one block."""
    largest = max((server.memory_bytes for server in servers), default=0.0)
    return floor_ratio(largest - model.block_bytes, model.cache_bytes)


def compose(
    servers: Sequence[ServerSpec],
    model: ModelSpec,
    capacity: int,
    arrival_rate: float | None = None,
    rho_bar: float = DEFAULT_RHO_BAR,
) -> Composition:
    """GBP-CR for capacity c, then GCA on the resulting placement."""
    placement = gbp_cr(servers, model, capacity, arrival_rate, rho_bar)
    return Composition(capacity, placement, gca(servers, model, placement.spans))


def tune_capacity(
    servers: Sequence[ServerSpec],
    model: ModelSpec,
    arrival_rate: float,
    rho_bar: float = DEFAULT_RHO_BAR,
    objective: Objective = "lower-bound",
) -> Composition | None:
    """The composition for `c* = argmin_{c in [1, c_max]}` of the objective (lowest c on ties).

    Returns None when no c gives a finite objective (no stable composition exists).
    """
    chains_of: dict[tuple, tuple[ServerChain, ...]] = {}  # GCA per distinct placement: many c share one
    best: Composition | None = None
    best_value = math.inf
    for capacity in range(1, max_capacity(servers, model) + 1):
        placement = gbp_cr(servers, model, capacity, arrival_rate, rho_bar)
        if not placement.order:
            break  # m_j(c) only shrinks with c: no server holds a block any more
        if objective == "surrogate":
            value = capacity * len(placement.chains) if placement.rate_met else math.inf
            chains = None
        else:
            if placement.spans not in chains_of:
                chains_of[placement.spans] = gca(servers, model, placement.spans)
            chains = chains_of[placement.spans]
            value = response_time_bounds([(c.service_rate, c.capacity) for c in chains], arrival_rate)[0]
        if value < best_value:
            best_value = value
            if chains is None:
                chains = gca(servers, model, placement.spans)
            best = Composition(capacity, placement, chains)
    return best
