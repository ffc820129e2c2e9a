"""Sessions the scheduler routed: WS-RR decisions, admission in predicted order, leases (pure).

The fast time scale (Sun et al., section 3.2): every new session gets the WS-RR route and expected
wait of eq. 20 from a `RoutingState` over the servers that serve now. Our servers refuse a session
that does not fit their cache instead of queueing it, so "waiting" happens here: a session is
*admitted* (may open its chain) only when every server of its chain has room for it. Waiting
sessions are admitted in the order WS-RR predicted (expected start time, then arrival), and none
overtakes an earlier one on a server they share, so the prediction is also the order.

Room is counted in cache slots (units of `s_c`, docs/reference.md 3.2): what this scheduler granted, or what
the server announces in use when that is more (sessions routed without the scheduler, or a
client's local failover). A session of `batch x max_length` tokens takes
`batch * max_length / (l_in + l_out)` slots per block, a fraction: exactly the bytes the server
reserves for it. (Rounded up to whole slots, sessions shorter than `l_in + l_out` held a whole one:
on the Azure code trace's lengths 1.6 slots per session on average where the bytes need 1, so a
server admitted 3 sessions where 5 fit, and sessions waited for room the servers had; BENCHMARKS.md,
"Prefill/decode roles on the emulated swarm".) WS-RR routes each session for the room it needs
(`RoutingState.route(units=)`): routed as a nominal session, a long one was sent to a server without
room for it, and waited there while another had room. WS-RR's own state (eq. 20's expected waits)
counts whole slots: each session there holds its fraction rounded to the nearest, at least 1.

Sessions hold a lease: a client that vanishes without ending its session frees it when the lease
runs out (clients renew it while they run).

Policies: `cg-bp` and `gbp-cr` route with WS-RR as above; `petals` with PETALS' own router (no
waiting here: its clients are refused by full servers and back off); `chains` with JFFC over GCA's
chains (`chain_routing`), where a session's chain is chosen only when it is admitted.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence

import numpy as np

from llm_swarm.scheduler.algorithms import petals
from llm_swarm.scheduler.algorithms.problem import ModelSpec, ServerSpec, Span, placement_cache_slots
from llm_swarm.scheduler.algorithms.wsrr import RoutingState, overdue_end
from llm_swarm.scheduler.service.chain_routing import (
    LiveChain,
    compose_live_chains,
    fastest_free_chain,
    queue_start_times,
    timings_moved,
)
from llm_swarm.scheduler.service.durations import DurationCalibration
from llm_swarm.scheduler.service.session_records import RouteDecision, SessionRecord
from llm_swarm.swarm.route_request import RouteHop


class SessionBook:
    """Routing state over the live servers, the sessions routed through it, and admission."""

    def __init__(self, lease_s: float, slot_tokens: int, policy: str = "cg-bp"):
        self.lease_s, self.slot_tokens, self.policy = lease_s, slot_tokens, policy
        self.sessions: dict[str, SessionRecord] = {}
        self._order = itertools.count()
        self._peers: list[str] = []
        self._specs: list[ServerSpec] = []
        self._model: ModelSpec | None = None
        self._spans: list[Span | None] = []
        self._state: RoutingState | None = None
        self._capacity: dict[str, int] = {}  # n_j under the live spans
        self._announced_use: dict[str, float] = {}
        self._granted: dict[str, float] = {}  # slots held by admitted sessions, by server
        self._chains: tuple[LiveChain, ...] = ()  # `chains` policy: GCA's job servers on the live spans
        self.durations = DurationCalibration()  # measured / predicted run times of ended sessions

    # --- the servers routes go through ----------------------------------------------------------
    def set_servers(
        self,
        peers: Sequence[str],
        specs: Sequence[ServerSpec],
        model: ModelSpec | None,
        spans: Sequence[Span | None],
        announced_use: Mapping[str, float],
    ) -> None:
        """New live servers (or new spans): rebuild the routing state and replay the sessions into it."""
        self._announced_use = dict(announced_use)
        if list(peers) == self._peers and list(spans) == self._spans and model == self._model:
            if self._model is None:
                return
            if self.policy == "chains":
                if timings_moved(self._specs, specs):
                    self._specs = list(specs)  # e.g. a client's round trips arrived: chain times changed
                    self._compose_chains()
                return
            # WS-RR holds only the compute timings: its round trips come with each query
            if not timings_moved(self._specs, specs, fields=("tau", "tau_prefill")):
                if self._state is not None:  # measured under the load of the moment: follow it
                    self._state.set_load_costs([spec.tau_per_session for spec in specs])
                return
            # a server's compute timings moved (e.g. a prefill server now takes its prompts,
            # `SwarmView.routing_specs`): rebuild the routing state with them below
        self._peers, self._specs, self._model, self._spans = list(peers), list(specs), model, list(spans)
        self._state = None
        self._capacity = {}
        if model is None or not peers:
            return
        self._state = RoutingState(self._specs, model, self._spans)
        slots = placement_cache_slots(self._specs, model, self._spans)
        self._capacity = dict(zip(self._peers, slots, strict=True))
        if self.policy == "chains":
            self._compose_chains()
            return
        index = {peer: j for j, peer in enumerate(self._peers)}
        for session in sorted(self.sessions.values(), key=lambda s: s.order):
            slots = {index[peer]: _whole(count) for peer, count in session.slots().items() if peer in index}
            if slots:
                self._state.add_session(session.session_id, slots, session.ends_at)

    def _compose_chains(self) -> None:
        """GCA on the new spans; admitted sessions keep their chain if it still exists (else they
        only hold their servers' slots until they end)."""
        assert self._model is not None
        try:
            self._chains = compose_live_chains(self._peers, self._specs, self._model, self._spans)
        except ValueError:  # a server without timings yet: no chains until it announces them
            self._chains = ()
        index = {chain.hops: k for k, chain in enumerate(self._chains)}
        for session in self.sessions.values():
            if session.admitted:
                session.chain = index.get(session.hops)

    def _chain_load(self) -> list[float]:
        """Slots of each chain that admitted sessions hold."""
        load = [0.0] * len(self._chains)
        for session in self.sessions.values():
            if session.admitted and session.chain is not None:
                load[session.chain] += session.units
        return load

    @property
    def chains(self) -> tuple[LiveChain, ...]:
        return self._chains

    @property
    def peers(self) -> list[str]:
        return list(self._peers)

    def capacity(self, peer: str) -> int:
        return self._capacity.get(peer, 0)

    # --- routing ----------------------------------------------------------------------------------
    def units_for(self, batch_size: int, max_length: int) -> float:
        """Cache slots per block a session of `batch_size x max_length` tokens holds (a fraction)."""
        return batch_size * max_length / self.slot_tokens

    def route(
        self,
        session_id: str,
        client_id: str,
        rtts: Mapping[str, float],
        l_out: int,
        units: float,
        now: float,
        prefill_scale: float = 1.0,
        server_rtts: np.ndarray | None = None,
    ) -> RouteDecision | None:
        """Route and record a new session (None: no chain of reachable servers covers the model).
        `l_out` and `prefill_scale` (its prompt's length over the one servers' `tau_prefill` is
        measured for) are the session's own, so WS-RR's wait and completion estimates follow it.
        `server_rtts` (aligned with `peers`): a chain session's servers' round trips to each
        other, which WS-RR prices it with (`RoutingState.route`)."""
        if self._state is None:
            return None
        if self.policy == "chains":
            return self._route_chains(session_id, client_id, units, now)
        per_server = [rtts.get(peer, math.inf) for peer in self._peers]
        self._extend_overdue(now)
        if self.policy == "petals":
            decision = self._route_petals(client_id, per_server, l_out)
        else:
            self._state.set_client_rtts(client_id, per_server)
            route = self._state.route(client_id, l_out, now, prefill_scale, units, server_rtts)
            if route is None:  # no chain ever has its room: route it as nominal, and let the caller
                # refuse it naming the server too small (`SchedulerCore._chain_cannot_hold`)
                route = self._state.route(client_id, l_out, now, prefill_scale, server_rtts=server_rtts)
            decision = None if route is None else (route.chain, route.wait, route.completion, route.cost)
        if decision is None:
            return None
        chain, wait, completion, cost = decision
        hops = tuple(RouteHop(self._peers[hop.server], hop.start, hop.end) for hop in chain.hops)
        service = completion - wait
        session = SessionRecord(
            session_id=session_id,
            client_id=client_id,
            hops=hops,
            units=units,
            expected_start=now + wait,
            ends_at=now + wait + service * self.durations.scale,
            lease_expires_at=now + self.lease_s,
            order=next(self._order),
            routed_at=now,
            service=service,
        )
        self.sessions[session_id] = session
        index = {peer: j for j, peer in enumerate(self._peers)}
        by_index = {index[peer]: _whole(count) for peer, count in session.slots().items()}
        self._state.add_session(session_id, by_index, session.ends_at)
        return RouteDecision(session, wait, session.ends_at - now, cost)

    def _route_chains(
        self, session_id: str, client_id: str, units: float, now: float
    ) -> RouteDecision | None:
        """Queue the session for JFFC (admission picks its chain); None: no chain covers the model, or
        none could ever hold the session (it would block the queue's head forever)."""
        if not any(chain.capacity >= units for chain in self._chains):
            return None
        fastest = min(chain.service_time for chain in self._chains)
        ahead = self.num_waiting
        running = [s.ends_at for s in self.sessions.values() if s.admitted]
        # whole slots free over the chains (loads are fractions): how many queued sessions start now
        free = int(
            sum(max(c.capacity - b, 0) for c, b in zip(self._chains, self._chain_load(), strict=True)) + 1e-9
        )
        start = now if free > ahead else queue_start_times(now, running, fastest, ahead - free + 1)[-1]
        session = SessionRecord(
            session_id=session_id,
            client_id=client_id,
            hops=(),
            units=units,
            expected_start=start,
            ends_at=start + fastest,
            lease_expires_at=now + self.lease_s,
            order=next(self._order),
            routed_at=now,
        )
        self.sessions[session_id] = session
        return RouteDecision(session, start - now, start + fastest - now, fastest)

    def _extend_overdue(self, now: float) -> None:
        """Sessions still running past their expected end hold their room a while longer (a share of
        their predicted run time), not "until now": else eq. 20 counts their room as free already,
        predicts no wait, and sends a new session to a full server while another has room (netem:
        most of the scheduler's waits were such, predicted 0 s)."""
        if self._state is None:
            return
        for session in self.sessions.values():
            if session.admitted and session.ends_at <= now:
                session.ends_at = overdue_end(now, session.service * self.durations.scale)
                self._state.reschedule(session.session_id, session.ends_at)

    def _route_petals(self, client_id: str, per_server_rtt: list[float], l_out: int):
        """PETALS' own router (docs/reference.md 3.3) over the live servers; it predicts no wait."""
        specs = [
            ServerSpec(
                name=spec.name,
                memory_bytes=spec.memory_bytes,
                tau=spec.tau,
                rtt={client_id: rtt} if math.isfinite(rtt) else {},  # no RTT: unreachable, no link
            )
            for spec, rtt in zip(self._specs, per_server_rtt, strict=True)
        ]
        used = [self._in_use(peer) for peer in self._peers]
        chain = petals.route(specs, self._model, self._spans, client_id, used)
        if chain is None:
            return None
        completion = sum(
            (per_server_rtt[hop.server] + hop.num_blocks * self._specs[hop.server].tau) * l_out
            for hop in chain.hops
        )
        return chain, 0.0, completion, chain.cost

    # --- admission --------------------------------------------------------------------------------
    def _in_use(self, peer: str) -> float:
        return max(self._granted.get(peer, 0.0), self._announced_use.get(peer, 0.0))

    def _grant(self, session: SessionRecord, sign: int) -> None:
        for peer, slots in session.slots().items():
            self._granted[peer] = self._granted.get(peer, 0) + sign * slots

    def admit_ready(self, now: float) -> list[str]:
        """Admit waiting sessions in predicted order while their servers have room; returns their ids.

        PETALS admits everyone at once (its clients find out about full servers by being refused).
        """
        waiting = sorted(
            (s for s in self.sessions.values() if not s.admitted), key=lambda s: (s.expected_start, s.order)
        )
        if not waiting:
            return []
        free = {peer: self.capacity(peer) - self._in_use(peer) for peer in self._peers}
        if self.policy == "chains":
            return self._admit_chains(sorted(waiting, key=lambda s: s.order), free, now)
        blocked: set[str] = set()
        admitted = []
        for session in waiting:
            peers = [hop.peer_id for hop in session.hops]
            fits = all(
                _fits(free.get(hop.peer_id, -1), hop.num_blocks * session.units) for hop in session.hops
            )
            if self.policy == "petals" or (fits and not blocked.intersection(peers)):
                session.admitted, session.admitted_at = True, now
                self._grant(session, +1)
                if session.service > 0 and self._state is not None:
                    # from now on it runs: its end moves with its real start, not the predicted one
                    session.ends_at = now + session.service * self.durations.scale
                    self._state.reschedule(session.session_id, session.ends_at)
                for hop in session.hops:
                    free[hop.peer_id] = free.get(hop.peer_id, 0) - hop.num_blocks * session.units
                admitted.append(session.session_id)
            else:
                blocked.update(peers)  # later sessions must not overtake it on these servers
        return admitted

    def _admit_chains(self, waiting: list[SessionRecord], free: dict[str, float], now: float) -> list[str]:
        """JFFC: the queue's head takes the fastest chain with room, strictly first come first served."""
        admitted, load = [], self._chain_load()
        for session in waiting:

            def has_room(chain: LiveChain, units: float = session.units) -> bool:
                return all(_fits(free.get(hop.peer_id, -1), hop.num_blocks * units) for hop in chain.hops)

            k = fastest_free_chain(self._chains, load, session.units, has_room)
            if k is None:
                break  # the head waits, and nobody overtakes it
            chain = self._chains[k]
            session.hops, session.chain = chain.hops, k
            session.admitted, session.admitted_at = True, now
            session.ends_at = now + chain.service_time
            load[k] += session.units
            self._grant(session, +1)
            for hop in chain.hops:
                free[hop.peer_id] -= hop.num_blocks * session.units
            admitted.append(session.session_id)
        return admitted

    def expected_wait(self, session_id: str, now: float) -> float:
        session = self.sessions[session_id]
        return 0.0 if session.admitted else max(session.expected_start - now, 0.0)

    def routable(self, session_id: str) -> bool:
        """Whether every server of the session's chain still serves (else the client must re-route)."""
        live = set(self._peers)
        return all(hop.peer_id in live for hop in self.sessions[session_id].hops)

    # --- the end of sessions ---------------------------------------------------------------------
    def renew(self, session_id: str, now: float) -> bool:
        session = self.sessions.get(session_id)
        if session is None:
            return False
        session.lease_expires_at = now + self.lease_s
        return True

    def end(self, session_id: str, now: float | None = None) -> bool:
        """Forget a session; `now` when its client reported the end (its run time teaches the
        calibration; an expired lease or a refusal does not)."""
        session = self.sessions.pop(session_id, None)
        if session is None:
            return False
        if now is not None and session.admitted_at is not None and session.service > 0:
            self.durations.observe(now - session.admitted_at, session.service)
        if session.admitted:
            self._grant(session, -1)
            # the servers' records still count its cache until they re-announce and we re-read them:
            # without this, a session waiting for exactly that room would wait for the next roster read
            for peer, slots in session.slots().items():
                if peer in self._announced_use:
                    self._announced_use[peer] = max(self._announced_use[peer] - slots, 0)
        if self._state is not None:
            self._state.end_session(session_id)
        return True

    def expire(self, now: float) -> list[str]:
        """End every session whose lease ran out (its client vanished); returns their ids."""
        expired = [s.session_id for s in self.sessions.values() if s.lease_expires_at <= now]
        for session_id in expired:
            self.end(session_id)
        return expired

    # --- what operators see --------------------------------------------------------------------------
    def room(self, peer: str) -> tuple[int, float, float]:
        """(cache slots in all, slots granted by this scheduler, slots the server announces in use)."""
        return self.capacity(peer), self._granted.get(peer, 0.0), self._announced_use.get(peer, 0.0)

    def granted(self, peer: str) -> float:
        return self._in_use(peer)

    @property
    def num_admitted(self) -> int:
        return sum(1 for s in self.sessions.values() if s.admitted)

    @property
    def num_waiting(self) -> int:
        return sum(1 for s in self.sessions.values() if not s.admitted)


def _fits(free: float, needed: float) -> bool:
    """Room for `needed` slots in `free` (sums of fractions: a rounding error is not a shortfall)."""
    return free >= needed - 1e-9


def _whole(slots: float) -> int:
    """A session's slots at one server as WS-RR's state counts them: the nearest whole number, >= 1."""
    return max(round(slots), 1)
