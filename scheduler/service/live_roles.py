"""Roles for the managed servers (`swarm-scheduler --roles auto`): the role planner
(`scheduler.algorithms.role_split`) on the swarm the scheduler sees, scored by the contended simulator.

The simulated swarm is built from the announcements: each server's memory, `tau` and `tau_prefill`
(scaled to the scheduler's `l_in`), the slowest known client's round trip to it, and the
server-to-server rates servers announce in `ServerInfo.links` (bytes/s; a pair nobody measured is a
link the simulated clients will not use, and the planner never pairs over it). With no measured
link, no candidate exists and nothing is simulated: every server stays `both`.

A plan costs a few goodput searches of small simulated runs (about a second in all on the
benchmark swarms), run in the scheduler's loop at a placement review, which it holds that long;
`RoleAssigner` re-plans only when its inputs change (servers, spans, timings and link rates to two
significant digits, the arrival rate to a power of two).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence

from llm_swarm.scheduler.algorithms.problem import Span
from llm_swarm.scheduler.algorithms.role_split import BOTH, RolePlan, plan_roles
from llm_swarm.scheduler.service.view import SwarmView
from llm_swarm.scheduler.sim.metrics import Slo
from llm_swarm.scheduler.sim.prefill import PrefillModel
from llm_swarm.scheduler.sim.role_planning import GoodputOfRoles, RoleSearch, role_inputs, with_links
from llm_swarm.scheduler.sim.scenarios import Scenario
from llm_swarm.scheduler.sim.single_client import seen_by_client
from llm_swarm.swarm.errors import SwarmUserError

logger = logging.getLogger(__name__)

ROLE_MODES = ("off", "auto")
DEFAULT_SLO = (10.0, 0.3)  # TTFT, TPOT (s) the roles are planned for without --slo-ttft/--slo-tpot


def check_mode(mode: str) -> str:
    if mode not in ROLE_MODES:
        raise SwarmUserError(f"--roles must be one of {', '.join(ROLE_MODES)}, got {mode!r}")
    return mode


def live_scenario(view: SwarmView, peers: Sequence[str], spans: Sequence[Span | None]) -> Scenario | None:
    """The swarm as the simulator needs it (None: sizes or timings not announced yet)."""
    model = view.model_spec()
    if model is None or not peers:
        return None
    specs = view.server_specs(peers)
    if any(not spec.tau or not spec.tau_prefill for spec in specs):
        return None
    servers, rtts = [], []
    for spec in specs:
        rtt = spec.worst_rtt()
        rtts.append(rtt)
        servers.append(seen_by_client(spec, rtt, rtt))
    prefill = PrefillModel(
        tuple(0.0 for _ in specs),
        tuple(spec.tau_prefill / view.l_in for spec in specs),
        tuple(rtts),
        tuple(0.0 for _ in specs),
    )
    scenario = Scenario(
        "live", model, tuple(servers), tuple(rtts), tuple(peers), view.l_in, view.l_out, prefill
    )
    return with_links(scenario, announced_links(view, peers), RoleSearch().link_rtt_s)


def announced_links(view: SwarmView, peers: Sequence[str]) -> dict[str, dict[str, float]]:
    """Sender peer id -> receiver peer id -> bytes/s, as the senders announce them."""
    wanted = set(peers)
    return {
        peer: {other: rate for other, rate in view.records[peer].links.items() if other in wanted}
        for peer in peers
    }


def plan_live_roles(
    view: SwarmView,
    peers: Sequence[str],
    spans: Sequence[Span | None],
    rate: float | None,
    slo: tuple[float | None, float | None],
) -> RolePlan | None:
    """The role plan for `peers` on `spans` (None: not enough is announced to plan)."""
    scenario = live_scenario(view, peers, spans)
    if scenario is None or any(span is None for span in spans):
        return None
    ttft, tpot = slo
    if ttft is None and tpot is None:
        ttft, tpot = DEFAULT_SLO
    inputs = role_inputs(scenario, rate, spans)
    search = RoleSearch(start_rate=rate or RoleSearch().start_rate)
    return plan_roles(inputs, GoodputOfRoles(scenario, Slo(ttft, tpot), search))


def _key(view: SwarmView, peers: Sequence[str], spans: Sequence[Span | None], rate: float | None) -> tuple:
    def rounded(value: float | None) -> float | None:
        return None if not value else float(f"{value:.2g}")

    links = announced_links(view, peers)
    return (
        tuple(peers),
        tuple(spans),
        tuple((rounded(view.records[p].tau), rounded(view.records[p].tau_prefill)) for p in peers),
        tuple(sorted((a, b, rounded(r)) for a, row in links.items() for b, r in row.items())),
        None if not rate else round(math.log2(rate)),
    )


class RoleAssigner:
    """The roles the scheduler hands out (peer id -> role; a peer not listed: both)."""

    def __init__(self, mode: str, slo: tuple[float | None, float | None]):
        self.mode, self.slo = check_mode(mode), slo
        self.roles: dict[str, str] = {}
        self.plan: RolePlan | None = None
        self._key: tuple | None = None

    def review(self, view: SwarmView, assignment: Mapping[str, Span | None], rate: float | None) -> bool:
        """Re-plan if the inputs changed; returns whether any server's role changed."""
        if self.mode == "off":
            return False
        peers = sorted(peer for peer, span in assignment.items() if span is not None)
        spans = [assignment[peer] for peer in peers]
        key = _key(view, peers, spans, rate) if all(p in view.records for p in peers) else None
        if key is None or key == self._key:
            return False
        self._key = key
        try:
            plan = plan_live_roles(view, peers, spans, rate, self.slo)
        except (ValueError, RuntimeError) as error:  # a swarm the simulator cannot model: stay colocated
            logger.warning("role planning failed, every server stays both: %s", error)
            plan = None
        roles = {} if plan is None else {p: r for p, r in zip(peers, plan.roles, strict=True) if r != BOTH}
        self.plan = plan
        if roles == self.roles:
            return False
        self.roles = roles
        logger.info("roles: %s", plan.describe(peers) if plan else "every server both")
        return True

    def drop(self, reason: str) -> None:
        """Every server back to both until the inputs change (the plan could not be placed)."""
        if self.roles:
            logger.warning("roles: every server both: %s", reason)
        self.roles, self.plan = {}, None

    def role_for(self, peer: str) -> str:
        return self.roles.get(peer, "") if self.mode == "auto" else ""
