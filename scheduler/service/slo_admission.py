"""Admission by SLO: does a routed session meet its TTFT and TPOT targets? (pure)

With `swarm-scheduler --slo-ttft S --slo-tpot S` every route is checked as it is made: the session's
first token is expected after its wait (WS-RR's eq. 20, or JFFC's queue) plus the prefill of its
chain (eq. 1 with one output token), and each later token after the chain's per-token time (eq. 1's
decode term), both stretched like every other prediction by the measured/predicted run-time ratio
(`durations`). A session expected to miss a target is told so at once in its route reply
(`slo_miss`, with the reason and the expected wait) instead of waiting silently; the client then
gives up or, if it opted in (`ClientOptions.accept_slo_miss`), waits as before. The scheduler still
queues it: whether to wait is the client's call, and an old client that does not read the field
keeps its old behaviour.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from llm_swarm.swarm.errors import SwarmUserError
from llm_swarm.swarm.route_request import RouteHop


@dataclass(frozen=True)
class SloTargets:
    ttft: float | None = None  # seconds from the route request to the first token
    tpot: float | None = None  # seconds per later token

    def __post_init__(self) -> None:
        for name in ("ttft", "tpot"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value > 0):
                raise SwarmUserError(f"--slo-{name} must be a positive number of seconds, got {value}")

    @property
    def active(self) -> bool:
        return self.ttft is not None or self.tpot is not None


@dataclass(frozen=True)
class SloPrediction:
    ttft: float  # expected seconds to the first token: wait + prefill
    tpot: float  # expected seconds per later token
    miss: str = ""  # why a target is expected to be missed ("" = both met)


def chain_latency(
    hops: Sequence[RouteHop],
    rtts: Mapping[str, float],
    tau: Callable[[str], float],
    tau_prefill: Callable[[str], float],
) -> tuple[float, float]:
    """(prefill, per-token time) of a chain, eq. 1: each hop's round trip plus its blocks' compute
    (`tau`, `tau_prefill`: per block, by peer id; the prefill round trip is taken equal to the
    per-token one, as the scheduler's view does)."""
    prefill = sum(rtts.get(h.peer_id, 0.0) + h.num_blocks * tau_prefill(h.peer_id) for h in hops)
    per_token = sum(rtts.get(h.peer_id, 0.0) + h.num_blocks * tau(h.peer_id) for h in hops)
    return prefill, per_token


def predict(
    targets: SloTargets, wait: float, prefill: float, per_token: float, scale: float = 1.0
) -> SloPrediction:
    """The expected TTFT and TPOT of a session and, if one misses its target, why."""
    ttft, tpot = wait + prefill * scale, per_token * scale
    reasons = []
    if targets.ttft is not None and ttft > targets.ttft:
        parts = f"wait {wait:.2f} s + prefill {prefill * scale:.2f} s"
        reasons.append(
            f"expected time to first token {ttft:.2f} s ({parts}) exceeds the {targets.ttft:g} s target"
        )
    if targets.tpot is not None and tpot > targets.tpot:
        reasons.append(f"expected time per token {tpot:.3f} s exceeds the {targets.tpot:g} s target")
    return SloPrediction(ttft, tpot, "; ".join(reasons))
