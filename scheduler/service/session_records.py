"""What the scheduler records about a session it routed (plain data, shared by the routing policies)."""

from __future__ import annotations

from dataclasses import dataclass

from llm_swarm.scheduler.service.slo_admission import SloPrediction
from llm_swarm.swarm.route_request import RouteHop


@dataclass
class SessionRecord:
    session_id: str
    client_id: str
    hops: tuple[RouteHop, ...]  # empty while a `chains` session waits: JFFC picks its chain on admission
    units: float  # cache slots per block (a fraction: `SessionBook.units_for`)
    expected_start: float  # absolute: routed_at + the predicted wait
    ends_at: float  # absolute expected end
    lease_expires_at: float
    order: int
    admitted: bool = False
    admitted_at: float | None = None
    routed_at: float = 0.0
    chain: int | None = None  # `chains` policy: the index of the live chain it runs on
    service: float = 0.0  # WS-RR policies: eq. 1's predicted run time once admitted (unstretched)
    l_in: int = 0  # the prompt and answer lengths the client declared when routed (what its end
    l_out: int = 0  # report is checked against and learned with: `swarm.length_prediction`)
    task: str = ""  # the task label it declared (lengths are learned per label)
    # where its prompt runs (`prefill_routing`): prefill servers for some hops; planned with the chain
    prefill: tuple[RouteHop, ...] = ()
    prefill_planned: bool = False

    def slots(self) -> dict[str, float]:
        return {hop.peer_id: hop.num_blocks * self.units for hop in self.hops}


@dataclass(frozen=True)
class RouteDecision:
    session: SessionRecord
    wait: float  # expected wait (WS-RR: eq. 20), seconds from now
    completion: float  # expected seconds until done
    cost: float
    slo: SloPrediction | None = None  # with SLO targets: expected TTFT/TPOT and any miss (`slo_admission`)
