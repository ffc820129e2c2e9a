"""Placement + routing policies, each composed from `scheduler.algorithms` (no second copy of an algorithm).

- `petals`: `petals.place` (servers join in random order), PETALS' fixed cache, `petals.route`
  with retry backoff.
- `opt-order`: the same, servers joining in CG-BP's order.
- `opt-num`: PETALS' window rule with CG-BP's block counts, eq. 2 cache (all free memory),
  `petals.route` with retry backoff.
- `opt-rr`: `petals.place` (random join order), PETALS' fixed cache, WS-RR (eq. 20 wait).
- `cg-bp`: `cg_bp` with R from `choose_num_requests`, eq. 2 cache, WS-RR (eq. 20 wait).
- `chains`: `tuning.tune_capacity` (GBP-CR + GCA), GCA's cache allocation, JFFC central queue.
- `jffc-only`: a whole model per server, GCA, JFFC.

The ablations are Sun et al.'s Fig. 6-9 variants (section 4.3); `jffc-only` is Sun, He and Hou, Table 1's
"JFFC only" benchmark. PETALS' client retries after `petals.retry_delay(n)` whenever the chain its
router picked (with the 10 s no-cache-room penalty) has no cache room; WS-RR clients start exactly
when eq. 20 says the chain has room (the scheduler tells them).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from llm_swarm.scheduler.algorithms import petals
from llm_swarm.scheduler.algorithms.cgbp import cg_bp, choose_num_requests
from llm_swarm.scheduler.algorithms.chains import ServerChain, chain_hops, gca, request_times
from llm_swarm.scheduler.algorithms.jffc import JffcDispatcher
from llm_swarm.scheduler.algorithms.problem import ModelSpec, ServerSpec, Span, cache_slots
from llm_swarm.scheduler.algorithms.routing_graph import ChainHop, chain_fits
from llm_swarm.scheduler.algorithms.tuning import compose, tune_capacity
from llm_swarm.scheduler.algorithms.windows import lexicographic_min_window
from llm_swarm.scheduler.algorithms.wsrr import RoutingState, overdue_end
from llm_swarm.scheduler.sim.discrete_events import (
    CLIENT,
    Decision,
    Queued,
    RetryAt,
    SimulationError,
    StartAt,
    service_hops,
)
from llm_swarm.scheduler.sim.length_info import LengthSource
from llm_swarm.scheduler.sim.prefill import PrefillModel
from llm_swarm.scheduler.sim.scenarios import Scenario
from llm_swarm.scheduler.sim.workload import Request
from llm_swarm.swarm.cost import request_time

POLICIES = ("petals", "cg-bp", "opt-num", "opt-order", "opt-rr", "chains", "jffc-only")
PETALS_FAMILY = ("petals", "opt-num", "opt-order", "opt-rr")


@dataclass(frozen=True)
class SetupDelays:
    """Per-session set-up time before the prefill (connection, cache allocation), by policy family.

    Sun et al.'s simulator is calibrated to its testbed with a constant session allocation delay of
    250 s for PETALS' code path and 60 s for CG-BP's, plus 70 ms initialization for both
    (the authors' released simulator); that is most of its Table 7 first-token times. The engine
    spends it before routing (see `engine`).
    `PAPER000` reproduces that calibration, `NONE` is the pure model of docs/reference.md 2.
    """

    petals_s: float
    proposed_s: float

    def for_policy(self, policy: str) -> float:
        return self.petals_s if policy in PETALS_FAMILY else self.proposed_s


SETUP_INIT_S = 0.070
PAPER000 = SetupDelays(250.0 + SETUP_INIT_S, 60.0 + SETUP_INIT_S)
NONE = SetupDelays(0.0, 0.0)


# -- dispatchers (online routing) --------------------------------------------------------------------


class PetalsRouting:
    """PETALS' client: Dijkstra with its heuristic weights; retries with backoff when the chain is full."""

    def __init__(
        self,
        route_servers: Sequence[ServerSpec],
        route_model: ModelSpec,
        spans: Sequence[Span | None],
        capacity: Sequence[int],
        setup_s: float,
    ):
        self.route_servers, self.route_model = list(route_servers), route_model
        self.spans, self.capacity, self.setup_s = list(spans), list(capacity), setup_s

    def slot_capacity(self) -> Sequence[int]:
        return self.capacity

    def blocks_held(self) -> Sequence[int]:
        return [span.length if span else 0 for span in self.spans]

    def on_arrival(self, request: Request, now: float, attempt: int, free_slots: Sequence[int]) -> Decision:
        used = [c - f for c, f in zip(self.capacity, free_slots, strict=True)]
        chain = petals.route(self.route_servers, self.route_model, self.spans, CLIENT, used)
        if chain is None:
            raise SimulationError("PETALS' placement does not cover the model")
        if all(free_slots[h.server] >= h.num_blocks for h in chain.hops):
            return StartAt(chain.hops, now)
        return RetryAt(now + petals.retry_delay(attempt + 1))

    def on_start(self, request: Request, hops: tuple[ChainHop, ...], now: float, finish: float) -> None:
        pass

    def on_finish(self, request: Request, now: float) -> list[tuple[Request, tuple[ChainHop, ...]]]:
        return []


class WsRrRouting:
    """The scheduler's WS-RR (`RoutingState`): start when eq. 20 says every hop has room.

    With `lengths` (`scheduler.sim.length_info`) routing and the waits use the `l_out` it
    estimates, not the request's true one, and a request starts as the live scheduler admits it
    (`scheduler.service.sessions`): as soon as its chain has room, waiting ones in predicted order,
    none overtaking an earlier one on a shared server. Without `lengths` (the oracle) eq. 20's
    start is exact, so a request starts at it.

    `cache_units` (the engine's, `scheduler.sim.discrete_events.simulate`): each request is routed for the
    room its own lengths need and recorded with it, and a request running past its expected end
    holds its room a while longer (`wsrr.overdue_end`), as the live scheduler does; only without
    `lengths` (the engine then admits it).
    """

    def __init__(
        self,
        state: RoutingState,
        spans: Sequence[Span | None],
        setup_s: float,
        prefill: PrefillModel | None = None,
        lengths: LengthSource | None = None,
        cache_units: Callable[[Request], float] | None = None,
    ):
        if cache_units is not None and lengths is not None:
            raise ValueError("sessions sized by their lengths are admitted by the engine: no `lengths`")
        self.cache_units = cache_units
        self.state, self.spans, self.setup_s = state, list(spans), setup_s
        self.prefill = prefill  # the engine's per-request prefill, so recorded ends match its own
        self.lengths = lengths
        self.told_waits: dict[int, float] = {}  # eq. 20's wait at each request's first routing
        self._waiting: dict[int, tuple[Request, tuple[ChainHop, ...], float, float, int]] = {}
        self._services: dict[int, float] = {}  # predicted run time of each request admitted, not started
        self._running: dict[int, tuple[ChainHop, ...]] = {}
        self._expected: dict[int, tuple[float, float]] = {}  # with cache_units: (end, run time) by id
        self._free = [self.state.cache_slots(j) for j in range(len(self.spans))]
        self._order = itertools.count()

    def slot_capacity(self) -> Sequence[int]:
        return [self.state.cache_slots(j) for j in range(len(self.spans))]

    def blocks_held(self) -> Sequence[int]:
        return [span.length if span else 0 for span in self.spans]

    def on_arrival(self, request: Request, now: float, attempt: int, free_slots: Sequence[int]) -> Decision:
        self.state.end_session(request.id)  # re-decision after a start that found no room
        self._hold_overdue(now)
        l_out = request.l_out if self.lengths is None else max(self.lengths.estimate(request), 1)
        units = 1.0 if self.cache_units is None else self.cache_units(request)
        route = self.state.route(CLIENT, l_out, now, units=units)
        if route is None or not math.isfinite(route.wait):
            raise SimulationError(f"request {request.id}: no chain can ever serve it")
        start = now + route.wait
        self.told_waits.setdefault(request.id, route.wait)
        # Record the session until the end the engine will compute (same eq. 1 arithmetic), so
        # later eq. 20 waits are exact (with the oracle's l_out).
        hops = service_hops(self.state.servers, route.chain.hops, self.prefill, request.l_in)
        duration = request_time(hops, l_out)
        slots = route.slots_by_server()
        if self.cache_units is not None:  # the live book's whole slots (`scheduler.service.sessions`)
            slots = {server: max(round(count * units), 1) for server, count in slots.items()}
        self.state.add_session(request.id, slots, start + duration)
        if self.cache_units is not None:
            self._expected[request.id] = (start + duration, duration)
        if self.lengths is None:
            return StartAt(route.chain.hops, start)
        entry = (request, route.chain.hops, start, duration, next(self._order))
        ahead = [w for w in self._waiting.values() if (w[2], w[4]) < (start, entry[4])]
        blocked = {h.server for w in ahead for h in w[1]}
        if blocked.isdisjoint(h.server for h in entry[1]) and chain_fits(entry[1], free_slots):
            self._services[request.id] = duration
            return StartAt(entry[1], now)
        self._waiting[request.id] = entry
        return Queued()

    def _hold_overdue(self, now: float) -> None:
        for request_id, (end, run_time) in list(self._expected.items()):
            if end <= now:
                self._expected[request_id] = (overdue_end(now, run_time), run_time)
                self.state.reschedule(request_id, self._expected[request_id][0])

    def on_start(self, request: Request, hops: tuple[ChainHop, ...], now: float, finish: float) -> None:
        if self.lengths is None:
            return
        self._running[request.id] = hops
        for h in hops:
            self._free[h.server] -= h.num_blocks
        # it runs from now: its predicted end moves with its real start (as the live scheduler's)
        self.state.reschedule(request.id, now + self._services.pop(request.id))

    def on_finish(self, request: Request, now: float) -> list[tuple[Request, tuple[ChainHop, ...]]]:
        self.state.end_session(request.id)
        self._expected.pop(request.id, None)
        if self.lengths is None:
            return []
        self.lengths.observe(request)
        for h in self._running.pop(request.id):
            self._free[h.server] += h.num_blocks
        free = list(self._free)  # `on_start` takes each admitted one's slots from `_free`
        admitted, blocked = [], set()
        for waiting, hops, _, duration, _ in sorted(self._waiting.values(), key=lambda w: (w[2], w[4])):
            servers = {h.server for h in hops}
            if blocked.isdisjoint(servers) and chain_fits(hops, free):
                for h in hops:
                    free[h.server] -= h.num_blocks
                admitted.append((waiting, hops))
                self._services[waiting.id] = duration
                del self._waiting[waiting.id]
            else:
                blocked.update(servers)  # later ones must not overtake it on these servers
        return admitted


class JffcRouting:
    """Sun, He and Hou, Alg. 3 over GCA's job servers: the fastest chain with a free slot, else a FIFO
    queue."""

    def __init__(self, chains: Sequence[ServerChain], spans: Sequence[Span | None], setup_s: float):
        if not chains:
            raise SimulationError("no server chain could be composed")
        self.spans, self.setup_s = list(spans), setup_s
        self.chain_hops = [chain_hops(chain, spans) for chain in chains]
        self.dispatcher = JffcDispatcher([(c.service_rate, c.capacity) for c in chains])
        self.capacity = placement_cache_slots_from_chains(chains, len(spans))
        self._chain_of: dict[int, int] = {}
        self._waiting: dict[int, Request] = {}

    def slot_capacity(self) -> Sequence[int]:
        return self.capacity

    def blocks_held(self) -> Sequence[int]:
        return [span.length if span else 0 for span in self.spans]

    def on_arrival(self, request: Request, now: float, attempt: int, free_slots: Sequence[int]) -> Decision:
        chain = self.dispatcher.arrive(request.id)
        if chain is None:
            self._waiting[request.id] = request
            return Queued()
        self._chain_of[request.id] = chain
        return StartAt(self.chain_hops[chain], now)

    def on_start(self, request: Request, hops: tuple[ChainHop, ...], now: float, finish: float) -> None:
        pass

    def on_finish(self, request: Request, now: float) -> list[tuple[Request, tuple[ChainHop, ...]]]:
        chain = self._chain_of.pop(request.id)
        successor = self.dispatcher.finish(chain)
        if successor is None:
            return []
        self._chain_of[successor] = chain
        return [(self._waiting.pop(successor), self.chain_hops[chain])]


def placement_cache_slots_from_chains(chains: Sequence[ServerChain], num_servers: int) -> list[int]:
    """Slots each server reserves for its chains: `sum_k q_jk * c_k` (GCA never exceeds eq. 2)."""
    slots = [0] * num_servers
    for chain in chains:
        for server, blocks in zip(chain.servers, chain.blocks, strict=True):
            slots[server] += blocks * chain.capacity
    return slots


# -- placements ------------------------------------------------------------------------------------


def petals_placement(
    servers: Sequence[ServerSpec], model: ModelSpec, join_order: Sequence[int]
) -> list[Span | None]:
    """`petals.place` with servers joining in `join_order`; spans re-aligned with `servers`."""
    placed = petals.place([servers[j] for j in join_order], model)
    if not placed.feasible:
        raise SimulationError(f"PETALS leaves blocks {list(placed.uncovered_blocks)[:10]} uncovered")
    spans: list[Span | None] = [None] * len(servers)
    for position, j in enumerate(join_order):
        spans[j] = placed.spans[position]
    return spans


def petals_window_placement(
    servers: Sequence[ServerSpec], model: ModelSpec, counts: Sequence[int], join_order: Sequence[int]
) -> list[Span | None]:
    """PETALS' join rule (docs/reference.md 3.3) with given block counts ('Optimized Number', Sun et al.
    section 4.3).

    `petals.place` derives the counts itself, so this re-runs its loop with CG-BP's `m_j`, using the
    same window rule (`lexicographic_min_window`) and throughput (`petals.throughput`).
    """
    block_throughput = np.zeros(model.num_blocks)
    spans: list[Span | None] = [None] * len(servers)
    for j in join_order:
        if counts[j] == 0:
            continue
        start = lexicographic_min_window(block_throughput, counts[j])
        block_throughput[start : start + counts[j]] += petals.throughput(servers[j], counts[j])
        spans[j] = Span(start, start + counts[j])
    return spans


def proposed_placement(servers: Sequence[ServerSpec], model: ModelSpec, rate: float, l_out: int):
    """CG-BP with the default R of docs/reference.md 3.1, lowered until the placement is feasible."""
    chosen = choose_num_requests(servers, model, rate, l_out)
    if chosen is None:
        raise SimulationError("CG-BP cannot place the model even for R = 1")
    for r in range(chosen, 0, -1):
        result = cg_bp(servers, model, r)
        if result.feasible:
            return result
    raise SimulationError("CG-BP found no feasible R")


def petals_fixed_cache(
    servers: Sequence[ServerSpec], model: ModelSpec, spans: Sequence[Span | None]
) -> list[int]:
    return [
        petals.cache_capacity_slots(s, model, span.length if span else 0)
        for s, span in zip(servers, spans, strict=True)
    ]


def with_ping_rtts(scenario: Scenario) -> list[ServerSpec]:
    """Servers as PETALS' router sees them: raw ping RTTs (it adds its own 18 ms per hop)."""
    return [
        dataclasses.replace(s, rtt={CLIENT: ping})
        for s, ping in zip(scenario.servers, scenario.ping_rtt, strict=True)
    ]


def with_chain_times(scenario: Scenario, l_out: int) -> list[ServerSpec]:
    """Sun, He and Hou's `tau_c`, `tau_p` per server, so that a chain's eq. 2 time is exactly eq. 1."""
    servers = []
    for s in scenario.servers:
        tau_c, tau_p = request_times(s.rtt_prefill[CLIENT], s.rtt[CLIENT], s.tau_prefill, s.tau, l_out)
        servers.append(dataclasses.replace(s, tau_c=tau_c, tau_p=tau_p))
    return servers


def effective_memory(
    servers: Sequence[ServerSpec], model: ModelSpec, spans: Sequence[Span | None], slots: Sequence[int]
) -> list[ServerSpec]:
    """Budgets `M_j' = s_m*m_j + s_c*slots_j` so eq. 2 / `RoutingState` see exactly `slots_j` cache slots."""
    result = []
    for s, span, n in zip(servers, spans, slots, strict=True):
        budget = model.block_bytes * (span.length if span else 0) + model.cache_bytes * (n + 0.5)
        result.append(dataclasses.replace(s, memory_bytes=min(budget, s.memory_bytes)))
    return result


def build_dispatcher(
    policy: str,
    scenario: Scenario,
    arrival_rate: float,
    rng: np.random.Generator,
    setup: SetupDelays = NONE,
    lengths: LengthSource | None = None,
):
    """The dispatcher of `policy` for a scenario; `rng` draws PETALS' random join order; `lengths`:
    what WS-RR (cg-bp, opt-rr) routes by instead of each request's true `l_out` (the others' routing
    does not read it)."""
    servers, model = list(scenario.servers), scenario.model
    setup_s = setup.for_policy(policy)
    join_order = [int(j) for j in rng.permutation(len(servers))]
    if policy in ("petals", "opt-order", "opt-rr"):
        if policy == "opt-order":
            cg = proposed_placement(servers, model, arrival_rate, scenario.l_out)
            join_order = list(cg.order) + [j for j in range(len(servers)) if j not in set(cg.order)]
        spans = petals_placement(servers, model, join_order)
        fixed = petals_fixed_cache(servers, model, spans)
        if policy == "opt-rr":
            state = RoutingState(effective_memory(servers, model, spans, fixed), model, spans)
            return WsRrRouting(state, spans, setup_s, scenario.prefill, lengths)
        return PetalsRouting(with_ping_rtts(scenario), model, spans, fixed, setup_s)
    if policy == "opt-num":
        cg = proposed_placement(servers, model, arrival_rate, scenario.l_out)
        counts = [span.length if span else 0 for span in cg.spans]
        spans = petals_window_placement(servers, model, counts, join_order)
        # PETALS' router falls back to the eq. 2 slots n_j when the model has no width (petals.py).
        route_model = dataclasses.replace(model, hidden_size=None)
        slots = [
            cache_slots(s, model, span.length if span else 0) for s, span in zip(servers, spans, strict=True)
        ]
        return PetalsRouting(with_ping_rtts(scenario), route_model, spans, slots, setup_s)
    if policy == "cg-bp":
        cg = proposed_placement(servers, model, arrival_rate, scenario.l_out)
        state = RoutingState(servers, model, cg.spans)
        return WsRrRouting(state, cg.spans, setup_s, scenario.prefill, lengths)
    if policy == "chains":
        timed = with_chain_times(scenario, scenario.l_out)
        composition = tune_capacity(timed, model, arrival_rate) or compose(timed, model, 1)
        return JffcRouting(composition.chains, composition.placement.spans, setup_s)
    if policy == "jffc-only":
        timed = with_chain_times(scenario, scenario.l_out)
        whole = model.block_bytes * model.num_blocks + model.cache_bytes * model.num_blocks
        spans = [Span(0, model.num_blocks) if s.memory_bytes >= whole else None for s in timed]
        return JffcRouting(gca(timed, model, spans), spans, setup_s)
    raise ValueError(f"unknown policy {policy!r}; choose from {', '.join(POLICIES)}")
