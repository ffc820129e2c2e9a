"""Goodput search (docs/reference.md 6): the highest arrival rate at which >= 90% of requests meet both SLOs.

`search_rates` is pure: it probes a caller-supplied `attainment_at(rate)` on a doubling grid until
the target is missed, then bisects between the last passing and the first failing rate. Attainment
falls with load (more waiting, later first tokens), so the bracket holds the crossing; `goodput`
then takes the highest rate whose whole lower prefix passes. `cell_goodput` wires it to the simulator.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from llm_swarm.scheduler.sim.metrics import GOODPUT_ATTAINMENT
from llm_swarm.scheduler.sim.monte_carlo import CellConfig, run_cell
from llm_swarm.scheduler.sim.rate_probes import RateProbes


@dataclass(frozen=True)
class GoodputResult:
    goodput: float  # requests/s; 0.0 when even the first rate misses
    probes: tuple[tuple[float, float], ...]  # (rate, attainment) in probing order


def search_rates(
    attainment_at: Callable[[float], float],
    start: float,
    doublings: int = 6,
    bisections: int = 4,
    target: float = GOODPUT_ATTAINMENT,
) -> GoodputResult:
    """Double from `start` until attainment < target (at most `doublings` times), then bisect."""
    if start <= 0 or doublings < 0 or bisections < 0:
        raise ValueError("need start > 0 and non-negative doublings/bisections")
    probe = RateProbes(attainment_at, target)
    low, high, rate = 0.0, None, start
    for _ in range(doublings + 1):
        if not probe.passes(rate):
            high = rate
            break
        low, rate = rate, 2 * rate
    if high is not None and low > 0:
        for _ in range(bisections):
            middle = (low + high) / 2
            if probe.passes(middle):
                low = middle
            else:
                high = middle
    return GoodputResult(probe.goodput(), tuple(probe.probes))


def cell_goodput(config: CellConfig, seeds: int, doublings: int = 6, bisections: int = 4) -> GoodputResult:
    """Goodput of one scenario x policy, starting the search at `config.rate` (Poisson arrivals).

    The request count grows with the rate (200 s of arrivals, as Sun et al.'s Fig. 8 sizes its rate
    sweep) so that high rates are not judged on a run too short to build a queue.
    """
    if config.slo_ttft is None and config.slo_tpot is None:
        raise ValueError("goodput needs --slo-ttft and/or --slo-tpot")

    def attainment_at(rate: float) -> float:
        cell = replace(config, rate=rate, requests=max(config.requests, round(200 * rate)))
        return run_cell(cell, seeds)["slo_attainment"]

    return search_rates(attainment_at, config.rate, doublings, bisections)
