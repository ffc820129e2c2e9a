"""The scheduler's state machine: roster in, placements and routes out (pure; `now` is passed in).

`SchedulerCore` owns the swarm view, the current assignment and the session book. The gRPC
servicer and the DHT loop (`scheduler.service.runner`) only feed it records and requests and
send its answers on; every decision is made here, so it is tested without sockets.

Restarting the scheduler loses nothing the swarm needs: the servers keep serving, and a new
scheduler adopts the spans it finds in the DHT as its starting placement (re-placing only for
the reasons `planner` lists), and counts the cache the servers announce in use until the
sessions it never saw end.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field

from llm_swarm.scheduler.algorithms.chain_cost import announced_server_rtts
from llm_swarm.scheduler.algorithms.placing import Infeasible, PlanInputError
from llm_swarm.scheduler.algorithms.problem import Span
from llm_swarm.scheduler.algorithms.role_split import PREFILL
from llm_swarm.scheduler.service.planner import (
    ArrivalRate,
    Plan,
    PlanSettings,
    choose_requests,
    compute_plan,
    guarantees,
    idle_per_token_time,
    place_prefill,
    plan_summary,
    r_changed,
    role_assigner,
)
from llm_swarm.scheduler.service.prefill_routing import PrefillPlanner
from llm_swarm.scheduler.service.request_stats import RequestStats
from llm_swarm.scheduler.service.sessions import RouteDecision, SessionBook, SessionRecord
from llm_swarm.scheduler.service.slo_admission import SloTargets, chain_latency, predict
from llm_swarm.scheduler.service.status import describe_servers
from llm_swarm.scheduler.service.view import ModelShape, SwarmView, prefill_time
from llm_swarm.swarm.errors import SwarmUserError
from llm_swarm.swarm.length_prediction import OutputLengthPredictor, SessionLengthLearner
from llm_swarm.swarm.route_request import RouteRequest
from llm_swarm.swarm.server_info import ServerInfo

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CoreSettings:
    plan: PlanSettings = field(default_factory=PlanSettings)
    l_in: int = 20
    l_out: int = 128
    period: float = 30.0  # seconds between placement reviews
    settle: float = 2.0  # after the servers changed, wait this long for more changes before re-placing
    lease: float = 60.0  # seconds a session lives without KeepAlive
    client_ttl: float = 600.0  # forget a client's round trips after this long without queries
    max_sessions_per_client: int = 64  # routed and not yet ended, per client id
    max_sessions: int = 10_000  # routed and not yet ended, all clients together
    # route by the output length learned from ended sessions (at most the declared one), not the declared
    l_out_prediction: bool = False
    # admission by SLO (`slo_admission`): routes expected to miss these (seconds) say so in their reply
    slo_ttft: float | None = None
    slo_tpot: float | None = None

    def __post_init__(self) -> None:
        """Every value checked where the settings are made (messages name `swarm-scheduler`'s flags)."""
        # `not x > 0` also rejects nan
        for name in ("period", "lease", "l_in", "l_out", "client_ttl"):
            if not getattr(self, name) > 0:
                raise SwarmUserError(f"--{name.replace('_', '-')} must be positive")
        if not self.settle >= 0:
            raise SwarmUserError(f"--settle must be >= 0, got {self.settle}")
        if self.max_sessions_per_client < 1 or self.max_sessions < 1:
            raise SwarmUserError("--max-sessions-per-client must be at least 1")
        SloTargets(self.slo_ttft, self.slo_tpot)  # checks them

    @property
    def slo(self) -> SloTargets:
        return SloTargets(self.slo_ttft, self.slo_tpot)


class RouteRefused(Exception):
    """The scheduler will not route this session (the message says why); the client routes locally."""


@dataclass(frozen=True)
class Assignment:
    assigned: bool
    span: Span | None
    epoch: int
    reason: str = ""
    role: str = ""  # prefill, decode or both (`--roles auto`); empty: the server keeps its own


class SchedulerCore:
    def __init__(self, shape: ModelShape, settings: CoreSettings, now: float):
        self.settings = settings
        self.view = SwarmView(shape, settings.l_in, settings.l_out)
        self.book = SessionBook(settings.lease, settings.l_in + settings.l_out, settings.plan.policy)
        # the book's servers' announced round trips to each other (`_refresh_book`)
        self._server_rtts = announced_server_rtts([], {})
        self.rate = ArrivalRate(settings.plan.rate_window, now)
        self.requests = RequestStats()
        # learns answer lengths from ended sessions (always: cheap; used with --l-out-prediction)
        self.lengths = SessionLengthLearner(OutputLengthPredictor(default=settings.l_out))
        self.started_at = now
        self.epoch = 0
        self.plan: Plan | None = None  # the last adopted placement
        self.assignment: dict[str, Span | None] = {}
        self.num_requests = settings.plan.num_requests or 1
        self.placed_members: frozenset[str] | None = None  # managed servers the assignment was made for
        self._members_changed_at: float | None = None
        self._last_review = now
        self._first_roster = True
        self.roles = role_assigner(settings.plan, (settings.slo_ttft, settings.slo_tpot))
        self._placed_roles: dict[str, str] = {}  # the roles the assignment was placed for
        self.prefill = PrefillPlanner(shape.block_windows)  # where routed sessions' prompts run

    # --- the roster (from the DHT) -------------------------------------------------------------
    def update_roster(self, records: Mapping[str, ServerInfo], now: float) -> None:
        """Take the latest server records; re-index routing over the servers that serve now."""
        self.view.records = dict(records)
        members = frozenset(self.view.placeable())
        if self._first_roster:
            self._first_roster = False
            self._adopt_live(members)
        if members != self.placed_members and self._members_changed_at is None:
            self._members_changed_at = now
        self._refresh_book()

    def _refresh_book(self) -> None:
        """Hand the servers that serve now (and their timings) to the session book."""
        # sessions route to servers that decode: a --role prefill server only takes prompts
        # (`prefill_routing`), so no chain may pass through it
        live = [peer for peer in self.view.live() if self.view.records[peer].role.serves("decode")]
        model = self.view.model_spec()
        announced = {peer: self.view.used_units(peer, model) for peer in live} if model else {}
        self.book.set_servers(
            live, self.view.routing_specs(live), model, self.view.live_spans(live), announced
        )
        # what chain sessions are priced with: read from the records once per roster, not per route
        self._server_rtts = announced_server_rtts(self.book.peers, self.view.records)

    def _adopt_live(self, members: frozenset[str]) -> None:
        """After a (re)start: the servers' current spans are the assignment, if every one has one."""
        spans = {peer: self.view.live_spans([peer])[0] for peer in members}
        if members and all(span is not None for span in spans.values()):
            self.assignment, self.placed_members = spans, members
            self.epoch += 1
            logger.info(
                "adopted the %d managed servers' current spans as placement %d", len(members), self.epoch
            )

    # --- placement ---------------------------------------------------------------------------------
    def review(self, now: float, force: bool = False) -> bool:
        """Re-place if there is a reason to (planner's list); returns whether a new placement was adopted.
        With `--roles auto`, then re-plans the servers' roles when their inputs changed (on the
        colocated placement of every server: the planner's candidates), and re-places at once when
        a role changed: chains through the servers that decode, prefill servers paired with them."""
        last = self._last_review
        adopted = self._review_placement(now, force)
        # only when the placement was reviewed (not at every roster read): a re-plan simulates
        reviewed = self._last_review != last and self.placed_members is not None
        if reviewed and self.settings.plan.roles != "off":
            colocated = self._compute(sorted(self.placed_members or ()), now, roles={})
            spans = colocated.spans if colocated is not None else self.assignment
            if self.roles.review(self.view, spans, self.rate.rate(now)):
                adopted = self._review_placement(now, force=True) or adopted
        return adopted

    def _current_roles(self, peers: list[str]) -> dict[str, str]:
        return {peer: role for peer, role in self.roles.roles.items() if peer in peers}

    def _review_placement(self, now: float, force: bool) -> bool:
        members = frozenset(self.view.placeable())
        settled = (
            self._members_changed_at is not None and now - self._members_changed_at >= self.settings.settle
        )
        periodic = now - self._last_review >= self.settings.period
        if not (force or settled or periodic):
            return False
        self._last_review = now
        self.view.forget_clients(now - self.settings.client_ttl)
        if not members:
            return False
        peers = sorted(members)
        roles = self._current_roles(peers)
        # sessions' chains pass only through servers that decode: R and speed are theirs
        routed = [peer for peer in peers if roles.get(peer) != PREFILL]
        proposed_r = choose_requests(self.view, routed, self.settings.plan, self.rate.rate(now))
        reason = None
        if members != self.placed_members:
            reason = "servers changed"
            self.num_requests = proposed_r
        elif roles != self._placed_roles:
            reason = "roles changed"
            self.num_requests = proposed_r
        elif r_changed(self.num_requests, proposed_r, self.settings.plan.r_hysteresis):
            reason = f"R {self.num_requests} -> {proposed_r}"
            self.num_requests = proposed_r
        current = [self.assignment.get(peer) for peer in routed]
        live_now = self.view.live_spans(routed)
        if reason is None and not guarantees(self.view, routed, live_now, self.num_requests):
            reason = f"the live spans do not guarantee R={self.num_requests}"
        candidate = self._compute(peers, now, roles)
        if candidate is None and roles:
            # the servers that decode cannot hold the model alone: serve colocated rather than not
            self.roles.drop("the servers that decode cannot be placed alone")
            roles, routed = {}, peers
            current = [self.assignment.get(peer) for peer in routed]
            if roles != self._placed_roles:
                reason = reason or "roles dropped"
            candidate = self._compute(peers, now, roles)
        if candidate is None:
            self._members_changed_at = None
            return False
        if reason is None:
            old_time = idle_per_token_time(self.view, routed, current)
            new_time = idle_per_token_time(self.view, routed, [candidate.spans.get(p) for p in routed])
            if new_time < old_time * (1 - self.settings.plan.min_gain):
                reason = f"{(1 - new_time / old_time) * 100:.0f}% faster per token"
        self._members_changed_at = None
        if reason is None or candidate.spans == {p: self.assignment.get(p) for p in peers}:
            if self.plan is None:
                self.plan = candidate  # first review after adopting live spans: keep the documents
            self._placed_roles = roles
            return False
        self.plan, self.assignment, self.placed_members = candidate, dict(candidate.spans), members
        self._placed_roles = roles
        self.epoch += 1
        bound = f"{candidate.bound * 1e3:.1f} ms" if candidate.bound is not None else "n/a"
        logger.info(
            "placement %d (%s; %s, R=%d, bound %s): %s",
            self.epoch,
            reason,
            self.settings.plan.policy,
            candidate.num_requests,
            bound,
            plan_summary(candidate),
        )
        return True

    def _compute(self, peers: list[str], now: float, roles: Mapping[str, str]) -> Plan | None:
        """The policy's placement of the servers that decode (every server without `roles`), then
        the prefill servers' spans (`planner.place_prefill`); with too little memory for R, the
        largest R that still fits."""
        prefill = [peer for peer in peers if roles.get(peer) == PREFILL]
        routed = [peer for peer in peers if roles.get(peer) != PREFILL]
        requests = self.num_requests
        while requests >= 1:
            try:
                plan = compute_plan(self.view, routed, self.settings.plan, requests, self.rate.rate(now))
                return place_prefill(self.view, plan, prefill)
            except Infeasible as error:
                if requests == 1 or self.settings.plan.policy == "petals":
                    logger.warning("no placement: %s (uncovered blocks %s)", error, error.uncovered[:10])
                    return None
                requests = max(requests // 2, 1) if requests > 8 else requests - 1
                self.num_requests = requests
            except (PlanInputError, ValueError) as error:
                logger.warning("no placement: %s", error)
                return None
        return None

    def assignment_for(self, peer: str) -> Assignment:
        if peer not in self.assignment:
            return Assignment(False, None, self.epoch, "not placed yet: wait for the next placement")
        span = self.assignment[peer]
        if span is None:
            return Assignment(
                False, None, self.epoch, f"no blocks: not enough memory for R={self.num_requests}"
            )
        return Assignment(True, span, self.epoch, role=self.roles.role_for(peer))

    # --- routing --------------------------------------------------------------------------------------
    def route(self, request: RouteRequest, now: float) -> RouteDecision | None:
        client_id, rtts, shape = request.client_id, request.rtts, request.shape
        batch_size, max_length, l_out = shape.batch_size, shape.max_length, shape.l_out
        self.book.expire(now)
        self._check_admissible(client_id, batch_size, max_length)
        self.rate.record(now)
        new_client = client_id not in self.view.clients
        self.view.report_rtts(client_id, rtts, now)
        if new_client and self.settings.plan.policy == "chains":
            self._refresh_book()  # GCA's chain times count this client's round trips (tau_c)
        self.book.expire(now)
        units = self.book.units_for(batch_size, max_length)
        prefill_scale = max(shape.l_in, 1) / self.view.l_in  # servers' tau_prefill is for view.l_in tokens
        routed_l_out = l_out
        if self.settings.l_out_prediction:
            routed_l_out = self.lengths.l_out_for(max(shape.l_in, 1), l_out, request.task or None)
        server_rtts = self._server_rtts if request.pushed else None
        decision = self.book.route(
            uuid.uuid4().hex, client_id, rtts, routed_l_out, units, now, prefill_scale, server_rtts
        )
        if decision is None:
            return None
        decision.session.l_in, decision.session.l_out = max(shape.l_in, 1), l_out
        decision.session.task = request.task
        problem = self._chain_cannot_hold(decision.session.hops, decision.session.units, max_length)
        if problem is not None:
            self.book.end(decision.session.session_id)
            raise RouteRefused(
                f"no chain could ever hold a session of {batch_size} x {max_length} tokens: {problem}"
            )
        session = decision.session
        if session.hops:  # a `chains` session waiting for its chain prefills where JFFC puts it
            session.prefill = self.prefill.plan(
                session.hops, self.view.records, session.l_in, batch_size, now + decision.wait
            )
            session.prefill_planned = True
        self.tick(now)
        if not session.admitted and session.hops:
            self._log_wait(session, decision.wait)
        return self._with_slo(decision, rtts, max(shape.l_in, 1), now)

    def _log_wait(self, session, wait: float) -> None:
        """Why a routed session waits: its chain's room, as admission counts it (one line)."""
        rooms = []
        for hop in session.hops:
            capacity, granted, announced = self.book.room(hop.peer_id)
            free, needs = capacity - max(granted, announced), hop.num_blocks * session.units
            rooms.append(
                f"{hop.peer_id[-6:]} {free:.2f} of {capacity} slots free "
                f"(granted {granted:.2f}, announced {announced:.2f}), needs {needs:.2f}"
            )
        logger.info(
            "session %s waits for cache room (predicted %.2f s, %d waiting): %s",
            session.session_id[:8],
            wait,
            self.book.num_waiting,
            "; ".join(rooms),
        )

    def _with_slo(self, decision: RouteDecision, rtts: Mapping[str, float], l_in: int, now: float):
        """With SLO targets: the session's expected TTFT and TPOT, and whether it misses them. A
        `chains` session waiting for JFFC has no chain yet: the fastest chain stands in for it."""
        targets = self.settings.slo
        if not targets.active:
            return decision
        hops = decision.session.hops or (self.book.chains[0].hops if self.book.chains else ())
        records = self.view.records

        def tau(peer: str) -> float:
            return (records[peer].tau or 0.0) if peer in records else 0.0

        def tau_prefill(peer: str) -> float:
            return prefill_time(records[peer], l_in) if peer in records else 0.0

        prefill, per_token = chain_latency(hops, rtts, tau, tau_prefill)
        wait = self.book.expected_wait(decision.session.session_id, now)
        slo = predict(targets, wait, prefill, per_token, self.book.durations.scale)
        return dataclasses.replace(decision, slo=slo)

    def _check_admissible(self, client_id: str, batch_size: int, max_length: int) -> None:
        """Bounded: sessions per client and in all; a session longer than every server accepts."""
        sessions = self.book.sessions.values()
        if len(self.book.sessions) >= self.settings.max_sessions:
            raise RouteRefused(f"the scheduler holds {self.settings.max_sessions} sessions, its limit")
        held = sum(1 for session in sessions if session.client_id == client_id)
        if held >= self.settings.max_sessions_per_client:
            raise RouteRefused(
                f"client {client_id[:8]} holds {held} sessions, the per-client limit: end some first"
            )
        live = [self.view.records[peer] for peer in self.view.live()]
        if live and all(info.max_length < max_length for info in live):
            longest = max(info.max_length for info in live)
            raise RouteRefused(f"max_length {max_length} exceeds every server's limit (at most {longest})")

    def _chain_cannot_hold(self, hops, units: float, max_length: int) -> str | None:
        """Why a routed chain can never admit the session (None: it can, once its servers have room)."""
        for hop in hops:
            capacity = self.book.capacity(hop.peer_id)
            if capacity < hop.num_blocks * units - 1e-9:
                return (
                    f"server {hop.peer_id[-8:]} has {capacity} cache slots in all, the session needs "
                    f"{hop.num_blocks * units:.2f}"
                )
            info = self.view.records.get(hop.peer_id)
            if info is not None and info.max_length < max_length:
                return f"server {hop.peer_id[-8:]} accepts sessions of at most {info.max_length} tokens"
        return None

    def tick(self, now: float) -> list[str]:
        """Expire leases and admit whoever fits now; returns newly admitted session ids."""
        self.book.expire(now)
        admitted = self.book.admit_ready(now)
        for session_id in admitted:
            session = self.book.sessions[session_id]
            self.requests.record_wait(now - session.routed_at)
        return admitted

    # --- sessions, as the API sees them -------------------------------------------------------------
    def session(self, session_id: str) -> SessionRecord | None:
        """The routed session (admitted or waiting), or None if it ended or was never routed."""
        return self.book.sessions.get(session_id)

    def renew_lease(self, session_id: str, now: float) -> bool:
        """Keep the session for another lease; False if it is unknown (ended or expired)."""
        return self.book.renew(session_id, now)

    def expected_wait(self, session_id: str, now: float) -> float:
        """Seconds until the session is expected to be admitted (0 once admitted)."""
        return self.book.expected_wait(session_id, now)

    def end_if_unroutable(self, session_id: str) -> bool:
        """End the session if a server of its chain left (the client must route again); True if so."""
        if self.book.routable(session_id):
            return False
        self.book.end(session_id)
        return True

    # --- status --------------------------------------------------------------------------------------
    def end_session(
        self,
        session_id: str,
        ttft: float = 0.0,
        tpot: float = 0.0,
        tokens: int = 0,
        now: float | None = None,
    ) -> bool:
        """The client is done; it may report what it measured (the metrics of docs/reference.md 6, for
        operators). With `now`, its run time calibrates later predictions (`durations`); the tokens
        of a session this scheduler admitted teach the output-length predictor (`lengths`)."""
        self.requests.record_finished(ttft, tpot, tokens)
        session = self.book.sessions.get(session_id)
        if session is not None and session.admitted and session.l_out > 0:
            self.lengths.session_ended(
                session.client_id, session.l_in, session.l_out, tokens, ttft, session.task or None
            )
        return self.book.end(session_id, now)

    def status(self, now: float) -> dict:
        book = self.book
        described = describe_servers(self.view, self.assignment, book.capacity, book.granted)
        plan = self.plan
        bound = plan.bound if plan is not None and plan.bound is not None else -1.0
        rate = self.settings.plan.arrival_rate or self.rate.rate(now) or 0.0
        return {
            "policy": self.settings.plan.policy,
            "epoch": self.epoch,
            "num_blocks": self.view.shape.num_blocks,
            "num_requests": self.num_requests,
            "bound": bound if math.isfinite(bound) else -1.0,
            "arrival_rate": rate,
            **described,
            "active_sessions": book.num_admitted,
            "waiting_sessions": book.num_waiting,
            "plan_input": plan.plan_input if plan else None,
            "plan_output": plan.plan_output if plan else None,
            "uptime": now - self.started_at,
            **self.requests.summary(),
        }
