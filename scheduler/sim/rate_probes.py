"""The probes of a goodput search: each probed arrival rate with its SLO attainment, in order."""

from __future__ import annotations

from collections.abc import Callable

from llm_swarm.scheduler.sim.metrics import goodput


class RateProbes:
    """Probes `attainment_at(rate)` and keeps every `(rate, attainment)` in probing order; the
    searches (`goodput.search_rates`, `goodput_plan.search_goodput`) choose the rates, and the
    goodput is read from all their probes (docs/reference.md 6: the prefix rule of `metrics.goodput`)."""

    def __init__(self, attainment_at: Callable[[float], float], target: float):
        self.attainment_at, self.target = attainment_at, target
        self.probes: list[tuple[float, float]] = []

    def passes(self, rate: float) -> bool:
        """Whether `rate` meets the attainment target (probed, and recorded)."""
        attained = self.attainment_at(rate)
        self.probes.append((rate, attained))
        return attained >= self.target

    def goodput(self) -> float:
        """The highest probed rate whose whole lower prefix passes; needs at least one probe."""
        rates, attained = zip(*self.probes, strict=True)
        return goodput(rates, attained, self.target)
