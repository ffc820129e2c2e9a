"""When to re-place blocks, and with which R (pure: times are passed in, nothing touches the network).

The slow time scale of the two-time-scale design (Sun et al., section 3): a placement is computed
with `swarm-plan place`'s own functions and adopted when

- the set of managed servers changed (a server joined, left or was never placed), or
- the live spans cannot guarantee R sessions on some block (a server moved away, capacity fell), or
- R changed materially (hysteresis: by at least a quarter and by at least 1), or
- the new placement is faster by at least `min_gain` (per-token time of the slowest client's
  shortest route through an idle swarm).

Anything else keeps the servers where they are: moving a server drains its sessions and reloads
blocks, which costs far more than a few percent of per-token time.
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property

from llm_swarm.scheduler.algorithms.cgbp import (
    choose_num_requests,
    session_capacity,
    slowest_client_request_time,
)
from llm_swarm.scheduler.algorithms.placing import PLACEMENTS, PlacedServers, PlanProblem
from llm_swarm.scheduler.algorithms.problem import Span
from llm_swarm.scheduler.algorithms.role_placement import prefill_blocks, prefill_spans
from llm_swarm.scheduler.algorithms.role_split import prefill_ratio
from llm_swarm.scheduler.plan.commands import placement_output
from llm_swarm.scheduler.plan.problem_io import problem_json
from llm_swarm.scheduler.service.live_roles import RoleAssigner, announced_links
from llm_swarm.scheduler.service.live_roles import check_mode as check_role_mode
from llm_swarm.scheduler.service.view import SwarmView
from llm_swarm.swarm.errors import SwarmUserError

POLICIES = ("cg-bp", "gbp-cr", "chains", "petals")


@dataclass(frozen=True)
class PlanSettings:
    policy: str = "cg-bp"
    num_requests: int | None = None  # fixed R; None: from the arrival rate
    arrival_rate: float | None = None  # fixed lambda (requests/s); None: estimated online
    min_gain: float = 0.1  # adopt a merely faster placement only if at least this much faster
    r_hysteresis: float = 0.25  # re-place for R only when it changes by this fraction (and >= 1)
    rate_window: float = 300.0  # seconds of arrivals the online rate estimate looks at
    roles: str = "off"  # "auto": plan prefill/decode roles from the announced links (`live_roles`)

    def __post_init__(self) -> None:
        """Every value checked where the settings are made (messages name `swarm-scheduler`'s flags)."""
        if self.policy not in POLICIES:
            raise SwarmUserError(f"--policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        if self.num_requests is not None and self.num_requests < 1:
            raise SwarmUserError("--num-requests must be at least 1")
        if self.arrival_rate is not None and not 0 < self.arrival_rate < math.inf:
            raise SwarmUserError("--arrival-rate must be a positive number of requests per second")
        if not 0 <= self.min_gain < 1:
            raise SwarmUserError(f"--min-gain must be in [0, 1), got {self.min_gain}")
        if not self.r_hysteresis >= 0 or not self.rate_window > 0:
            raise SwarmUserError("the R hysteresis must be >= 0 and the rate window positive")
        check_role_mode(self.roles)


@dataclass(frozen=True)
class Plan:
    """One computed placement: what the algorithm was given and what it returned. The `swarm-plan`
    documents that reproduce it are a record for operators (`swarm-plan place` on `plan_input` prints
    `plan_output`), built only when someone asks for them."""

    problem: PlanProblem  # the servers that decode (every server without roles)
    placed: PlacedServers
    num_requests: int
    # prefill servers' spans, placed after the others (`place_prefill`); not part of the documents
    prefill: Mapping[str, Span | None] = field(default_factory=dict)

    @cached_property
    def spans(self) -> dict[str, Span | None]:
        """Peer id -> span (None: no blocks)."""
        return {**self.placed.by_name(self.problem), **self.prefill}

    @property
    def bound(self) -> float | None:
        """Eq. 17 (CG-BP only)."""
        return self.placed.bound

    @cached_property
    def plan_input(self) -> dict:
        return problem_json(self.problem)

    @cached_property
    def plan_output(self) -> dict:
        return placement_output(self.problem, self.placed)


@dataclass
class ArrivalRate:
    """Requests per second over a sliding window (docs/reference.md 3.1: the scheduler re-estimates
    lambda)."""

    window: float
    started_at: float
    arrivals: deque = field(default_factory=deque)

    def record(self, now: float) -> None:
        self.arrivals.append(now)

    def rate(self, now: float) -> float | None:
        while self.arrivals and self.arrivals[0] < now - self.window:
            self.arrivals.popleft()
        observed = min(now - self.started_at, self.window)
        if not self.arrivals or observed <= 0:
            return None
        return len(self.arrivals) / max(observed, 1.0)


def compute_plan(
    view: SwarmView,
    peers: Sequence[str],
    settings: PlanSettings,
    num_requests: int,
    arrival_rate: float | None = None,
) -> Plan:
    """Place `peers` with the policy; raises `Infeasible`/`PlanInputError` like `swarm-plan place`.

    `gbp-cr` places for capacity `c = R`; `chains` tunes c for the arrival rate (the c tuning of
    docs/reference.md 3.4, Sun, He and Hou's full design) when one is known and c is not fixed
    (`--num-requests`, e.g. as `swarm-plan goodput` chose it), else uses `c = R` too."""
    rate = settings.arrival_rate if settings.arrival_rate is not None else arrival_rate
    if settings.policy == "cg-bp":
        problem = view.plan_problem(peers, num_requests=num_requests)
    elif settings.policy == "chains" and rate and settings.num_requests is None:
        problem = view.plan_problem(peers, capacity="auto", arrival_rate=rate)
    elif settings.policy in ("gbp-cr", "chains"):
        problem = view.plan_problem(peers, capacity=num_requests)
    else:
        problem = view.plan_problem(peers)
    algorithm = "gbp-cr" if settings.policy == "chains" else settings.policy
    return Plan(problem, PLACEMENTS[algorithm](problem), num_requests)


def place_prefill(view: SwarmView, plan: Plan, prefill: Sequence[str]) -> Plan:
    """`plan` (of the servers that decode) with spans for the `prefill` servers, paired with the
    decode servers over their announced links (`scheduler.algorithms.role_placement`), the best at
    prompts first. A prefill server that cannot hold a block and a prompt gets none."""
    model = view.model_spec()
    if not prefill or model is None:
        return plan
    specs = view.server_specs(prefill)
    # one nominal prompt's cache per block: the room a prefill server needs to run a prompt
    prompt_per_block = model.cache_bytes * view.l_in / (view.l_in + view.l_out)
    blocks = {
        spec.name: prefill_blocks(spec.memory_bytes, model.num_blocks, model.block_bytes, prompt_per_block)
        for spec in specs
    }
    order = sorted(specs, key=lambda spec: (-prefill_ratio(spec, view.l_in), spec.name))
    placeable = [spec.name for spec in order if blocks[spec.name] >= 1]
    decode = {peer: span for peer, span in plan.spans.items() if span is not None}
    links = announced_links(view, [*placeable, *decode])
    spans = prefill_spans(placeable, [blocks[name] for name in placeable], model.num_blocks, decode, links)
    placed: dict[str, Span | None] = dict.fromkeys(prefill)
    placed.update(zip(placeable, spans, strict=True))
    return dataclasses.replace(plan, prefill=placed)


def choose_requests(
    view: SwarmView, peers: Sequence[str], settings: PlanSettings, arrival_rate: float | None
) -> int:
    """R (docs/reference.md 3.1): fixed, or `min(round(mean + std), R_max)` for the given or estimated rate
    (>= 1)."""
    if settings.num_requests is not None:
        return settings.num_requests
    rate = settings.arrival_rate if settings.arrival_rate is not None else arrival_rate
    if not rate or not peers:
        return 1
    problem = view.plan_problem(peers, arrival_rate=rate)
    chosen = choose_num_requests(problem.servers, problem.model, rate, view.l_out)
    return chosen if chosen is not None else 1


def r_changed(current: int, proposed: int, hysteresis: float) -> bool:
    """Whether R moved enough to re-place (do not flap between neighbours)."""
    return abs(proposed - current) >= max(1, math.ceil(hysteresis * current))


def guarantees(
    view: SwarmView, peers: Sequence[str], spans: Sequence[Span | None], num_requests: int
) -> bool:
    """Whether spans give every block room for R sessions using all of each server's blocks (eq. 15)."""
    model = view.model_spec()
    if model is None:
        return False
    specs = {spec.name: spec for spec in view.server_specs(peers)}
    capacity = [0] * model.num_blocks
    for peer, span in zip(peers, spans, strict=True):
        if span is None:
            continue
        sessions = session_capacity(specs[peer], model, span.length)
        for block in range(span.start, span.end):
            capacity[block] += sessions
    return min(capacity, default=0) >= num_requests


def idle_per_token_time(view: SwarmView, peers: Sequence[str], spans: Sequence[Span | None]) -> float:
    """Per-token time of the slowest client's shortest route through an idle swarm (inf: not served)."""
    model = view.model_spec()
    if model is None or all(span is None for span in spans):
        return math.inf
    try:
        total = slowest_client_request_time(view.server_specs(peers), model, spans, view.l_out)
    except ValueError:
        return math.inf
    return total / view.l_out


def role_assigner(settings: PlanSettings, slo: tuple[float | None, float | None]) -> RoleAssigner:
    """Who hands out prefill/decode roles (`--roles auto`; off: every server keeps its own, and
    assignments carry no role)."""
    return RoleAssigner(settings.roles, slo)


def plan_summary(plan: Plan) -> str:
    """One log line's worth: the spans by short peer id."""
    placed = sorted((span.start, span.end, peer) for peer, span in plan.spans.items() if span)
    parts = [f"{peer[-6:]}={start}:{end}" for start, end, peer in placed]
    parts += [f"{peer[-6:]}=none" for peer, span in plan.spans.items() if span is None]
    return " ".join(parts)
