"""The discrete-event core: arrivals, admission, cache slots (eq. 2), waiting, completion.

Modelling choices (Sun et al., section 4.1, following its simulator):

- Per-block compute times do not depend on concurrency: a server runs its sessions' steps in
  parallel and memory (eq. 2) is the only shared resource. So once a request starts on a chain its
  timeline is fixed by eq. 1: prefill then `l_out - 1` decode steps,
  `sum_j (t_prefill_cj + k_j*tau_prefill_j) + (l_out - 1) * sum_j (t_cj + k_j*tau_j)`.
- A session reserves `k_j` cache slots (of `s_c` bytes) at every server j of its chain when it
  starts (static allocation for `l_in + l_out` tokens) and frees them when it completes; the engine
  refuses a start that would break `s_m*m_j + s_c*sum_r k_j^r <= M_j` (eq. 2), so memory can never
  be exceeded, whatever the policy decides.
- A policy-specific session set-up delay (`Dispatcher.setup_s`) is spent by the client before it
  asks for a route. Sun et al.'s simulator adds such a calibrated constant to every request (see
  `policies.SetupDelays`); we let it delay the request without holding cache, since with caches held
  through it PETALS' waits would far exceed the paper's measured first-token times (Table 7).
- Waiting is the policy's business: it answers an arrival with "start at t" (WS-RR's eq. 20 wait),
  "retry at t" (PETALS' client backoff) or "queued" (JFFC's central queue, woken on completions).

Events at equal times run completions first, then deferred starts, then arrivals/retries, each in
creation order, so runs are deterministic.

With a `service` (`scheduler.sim.contended`) the timeline is not fixed at the start:
the service advances the request through the servers' loops on the same event queue (its events
run after completions and before starts at equal times) and reports its first token and end. A
start the policy asked for that finds no cache room (sessions run longer than eq. 1 said) then
waits, as the live scheduler's admission does, until completions free its chain, in the order the
starts were due and none overtaking an earlier one on a shared server. Without a service nothing of
this runs and results are those of Sun et al.'s model.

`cache_units` (with a service) sizes each session's cache by its own lengths, as live servers and
the live scheduler do (`scheduler/service/sessions.py`): a request holds `cache_units(request)` slots
per block (a fraction: its `l_in + l_out` over the nominal session's), not one. Sun et al.'s model
gives every session one nominal slot, so sessions of long prompts fit where their bytes would not
(BENCHMARKS.md, "Prefill/decode roles on the emulated swarm": 4x the measured goodput predicted
for a swarm whose decode servers hold two of its longest sessions).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from llm_swarm.scheduler.algorithms.problem import ModelSpec, ServerSpec
from llm_swarm.scheduler.algorithms.routing_graph import ChainHop
from llm_swarm.scheduler.sim.prefill import PrefillModel
from llm_swarm.scheduler.sim.workload import Request
from llm_swarm.swarm.cost import HopCost, request_time

CLIENT = "client"


@dataclass(frozen=True)
class StartAt:
    """Start the request on `hops` at `time` (>= now)."""

    hops: tuple[ChainHop, ...]
    time: float


@dataclass(frozen=True)
class RetryAt:
    """The client backs off and asks again at `time`."""

    time: float


@dataclass(frozen=True)
class Queued:
    """The policy keeps the request; it will hand it back from `on_finish`."""


Decision = StartAt | RetryAt | Queued


class Dispatcher(Protocol):
    """A placement plus an online routing rule (see `scheduler.sim.policies`)."""

    setup_s: float

    def slot_capacity(self) -> Sequence[int]:
        """Cache slots per server the policy allocates (eq. 2 must hold at full use)."""

    def blocks_held(self) -> Sequence[int]:
        """`m_j` per server."""

    def on_arrival(self, request: Request, now: float, attempt: int, free_slots: Sequence[int]) -> Decision:
        """Decide for a request arriving (attempt 0) or retrying (attempt >= 1) at `now`."""

    def on_start(self, request: Request, hops: tuple[ChainHop, ...], now: float, finish: float) -> None:
        """The request holds its slots from `now` until `finish`."""

    def on_finish(self, request: Request, now: float) -> list[tuple[Request, tuple[ChainHop, ...]]]:
        """The request completed; returns queued requests that start now."""


@dataclass(frozen=True)
class RequestRecord:
    """What happened to one request (times are absolute seconds)."""

    id: int
    arrival: float
    setup: float  # session set-up before the first routing query
    start: float  # first server work: the chain reserved its caches
    first_token: float
    finish: float
    l_out: int
    num_hops: int
    retries: int


@dataclass
class SimResult:
    records: list[RequestRecord]
    peak_slots: list[float]  # most slots in use at each server at any time (fractions with `cache_units`)
    slot_capacity: list[int]
    events: int = 0
    memory_bytes_peak: list[float] = field(default_factory=list)  # s_m*m_j + s_c*peak_j (eq. 2 left side)
    service_stats: dict[str, float] = field(default_factory=dict)  # the service's counters, if any


class SimulationError(RuntimeError):
    """A policy broke an invariant (e.g. memory) or left a request stranded."""


class Service(Protocol):
    """How started requests are served when eq. 1 does not fix it (`scheduler.sim.contended`)."""

    def bind(self, schedule, finished) -> None:
        """`schedule(time, callback, argument)` runs `callback(time, argument)` then;
        `finished(request, first_token, finish)` reports a request done."""

    def start(self, request: Request, hops: tuple[ChainHop, ...], now: float) -> None:
        """The request holds its chain's caches from `now`."""

    def stats(self) -> dict[str, float]:
        """Counters for the result (`SimResult.service_stats`)."""


_FINISH, _SERVICE, _START, _ARRIVE = 0, 1, 2, 3


def service_hops(
    servers: Sequence[ServerSpec],
    hops: Sequence[ChainHop],
    prefill: PrefillModel | None = None,
    l_in: int | None = None,
) -> list[HopCost]:
    """Eq. 1's view of a chain for the client (`swarm.cost.HopCost` per server).

    With a `prefill` model and the request's `l_in`, the prefill terms are the request's own
    (trace replay); otherwise the servers' nominal ones.
    """
    own = prefill is not None and l_in is not None
    return [
        HopCost(
            rtt=servers[h.server].rtt[CLIENT],
            rtt_prefill=prefill.rtt_prefill(h.server, l_in) if own else servers[h.server].rtt_prefill[CLIENT],
            tau=servers[h.server].tau,
            tau_prefill=prefill.tau_prefill(h.server, l_in) if own else servers[h.server].tau_prefill,
            num_blocks=h.num_blocks,
        )
        for h in hops
    ]


def simulate(
    servers: Sequence[ServerSpec],
    model: ModelSpec,
    dispatcher: Dispatcher,
    requests: Sequence[Request],
    prefill: PrefillModel | None = None,
    service: Service | None = None,
    cache_units: Callable[[Request], float] | None = None,
) -> SimResult:
    """Run every request to completion; raises SimulationError if one can never be served.

    `prefill`: charge each request the prefill of its own `l_in` (see `scheduler.sim.prefill`).
    `service`: serve started requests through it (contended servers) instead of by eq. 1.
    `cache_units`: slots per block each request holds (default 1; see the module docstring).
    """
    if cache_units is not None and service is None:
        raise ValueError("sessions sized by their lengths wait for room: that needs a service")
    units_of = cache_units or (lambda request: 1)
    capacity = list(dispatcher.slot_capacity())
    blocks = list(dispatcher.blocks_held())
    for j, server in enumerate(servers):  # eq. 2 at full cache use
        if model.block_bytes * blocks[j] + model.cache_bytes * capacity[j] > server.memory_bytes * (
            1 + 1e-12
        ):
            raise SimulationError(f"policy allocates more than M_j at server {server.name}")
    used: list[float] = [0] * len(servers)
    peak: list[float] = [0] * len(servers)
    events: list[tuple[float, int, int, object]] = []
    order = itertools.count()
    attempts: dict[int, int] = {}
    started: dict[int, tuple[float, float, tuple[ChainHop, ...]]] = {}  # id -> (start, first token, hops)
    records: list[RequestRecord] = []
    count = 0

    blocked: list[tuple[Request, tuple[ChainHop, ...]]] = []  # with a service: starts waiting for room

    def push(time: float, kind: int, payload: object) -> None:
        heapq.heappush(events, (time, kind, next(order), payload))

    def served(request: Request, first_token: float, finish: float) -> None:
        begin, _, hops = started[request.id]
        started[request.id] = (begin, first_token, hops)
        push(finish, _FINISH, request)

    if service is not None:
        service.bind(lambda time, callback, argument: push(time, _SERVICE, (callback, argument)), served)

    def start(request: Request, hops: tuple[ChainHop, ...], now: float) -> bool:
        units = units_of(request)
        free = [c - u for c, u in zip(capacity, used, strict=True)]
        if not all(free[h.server] >= h.num_blocks * units - 1e-9 for h in hops):
            return False
        for h in hops:
            used[h.server] += h.num_blocks * units
            peak[h.server] = max(peak[h.server], used[h.server])
        chain = service_hops(servers, hops, prefill, request.l_in)
        prefill_s = request_time(chain, 1)  # eq. 1 with l_out = 1: the prefill pass alone
        finish = now + request_time(chain, request.l_out)
        started[request.id] = (now, now + prefill_s, hops)
        dispatcher.on_start(request, hops, now, finish)
        if service is None:
            push(finish, _FINISH, request)
        else:
            service.start(request, hops, now)
        return True

    def start_or_wait(request: Request, hops: tuple[ChainHop, ...], now: float) -> None:
        """With a service: start now, or wait behind earlier blocked starts on shared servers."""
        ahead = {h.server for _, waiting in blocked for h in waiting}
        if ahead.isdisjoint(h.server for h in hops) and start(request, hops, now):
            return
        blocked.append((request, hops))

    def unblock(now: float) -> None:
        ahead: set[int] = set()
        for entry in list(blocked):
            request, hops = entry
            servers_of = {h.server for h in hops}
            if ahead.isdisjoint(servers_of) and start(request, hops, now):
                blocked.remove(entry)
            else:
                ahead.update(servers_of)  # later ones must not overtake it on these servers

    def decide(request: Request, now: float) -> None:
        free = [c - u for c, u in zip(capacity, used, strict=True)]
        decision = dispatcher.on_arrival(request, now, attempts[request.id], free)
        if isinstance(decision, StartAt):
            if decision.time <= now:
                if service is not None:
                    start_or_wait(request, decision.hops, now)
                elif not start(request, decision.hops, now):
                    raise SimulationError(f"request {request.id}: policy started it without cache room")
            else:
                push(decision.time, _START, (request, decision.hops))
        elif isinstance(decision, RetryAt):
            if decision.time <= now:
                raise SimulationError(f"request {request.id}: retry must lie in the future")
            attempts[request.id] += 1
            push(decision.time, _ARRIVE, request)

    for request in requests:
        attempts[request.id] = 0
        push(request.arrival + dispatcher.setup_s, _ARRIVE, request)
    while events:
        now, kind, _, payload = heapq.heappop(events)
        count += 1
        if kind == _ARRIVE:
            decide(payload, now)
        elif kind == _SERVICE:
            callback, argument = payload
            callback(now, argument)
        elif kind == _START:
            request, hops = payload
            if service is not None:  # a live scheduler keeps a waiting session's route
                start_or_wait(request, hops, now)
            elif not start(request, hops, now):  # the policy's estimate was off: ask it again
                decide(request, now)
        else:
            request = payload
            begin, first_token, hops = started.pop(request.id)
            for h in hops:
                used[h.server] -= h.num_blocks * units_of(request)
            records.append(
                RequestRecord(
                    request.id,
                    request.arrival,
                    dispatcher.setup_s,
                    begin,
                    first_token,
                    now,
                    request.l_out,
                    len(hops),
                    attempts[request.id],
                )
            )
            for waiting, waiting_hops in dispatcher.on_finish(request, now):
                if not start(waiting, waiting_hops, now):
                    raise SimulationError(f"request {waiting.id}: dequeued without cache room")
            if blocked:
                unblock(now)
    if len(records) != len(requests):
        raise SimulationError(f"{len(requests) - len(records)} requests never completed")
    records.sort(key=lambda r: r.id)
    memory_peak = [model.block_bytes * m + model.cache_bytes * p for m, p in zip(blocks, peak, strict=True)]
    stats = service.stats() if service is not None else {}
    return SimResult(records, peak, capacity, count, memory_peak, stats)
