"""Simulating a goodput plan's candidates: one candidate (a policy and its parameter) on
one swarm at one Poisson rate, averaged over seeds, as `scheduler.sim.goodput_plan` asks for it.

A default policy is built as `policies.build_dispatcher` builds it (so its numbers are
`swarm-sim --goodput`'s), a fixed parameter from the same pieces with `R` or `c` given; placements
are kept between runs. Every candidate sees the same arrivals for a (rate, seed). Overloaded runs
stop as soon as the probe's outcome is certain (`Evaluator`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction

import numpy as np

from llm_swarm.scheduler.algorithms import petals
from llm_swarm.scheduler.algorithms.cgbp import cg_bp
from llm_swarm.scheduler.algorithms.problem import Span
from llm_swarm.scheduler.algorithms.tuning import compose, tune_capacity
from llm_swarm.scheduler.algorithms.wsrr import RoutingState
from llm_swarm.scheduler.sim.discrete_events import RetryAt, SimulationError, StartAt, simulate
from llm_swarm.scheduler.sim.metrics import GOODPUT_ATTAINMENT, Slo, per_request, slo_attainment
from llm_swarm.scheduler.sim.policies import (
    NONE,
    JffcRouting,
    SetupDelays,
    WsRrRouting,
    build_dispatcher,
    proposed_placement,
    with_chain_times,
)
from llm_swarm.scheduler.sim.scenarios import Scenario
from llm_swarm.scheduler.sim.workload import Request, poisson

DEFAULT_POLICIES = ("cg-bp", "chains", "petals")

PARAMETER = {"cg-bp": "R", "chains": "c"}

IDLE_RATE = 1e-3  # the rate the defaults plan for when only one request is simulated
MAX_ATTEMPTS = 1000  # a request refused this often never finds room: the candidate cannot serve


@dataclass(frozen=True)
class Candidate:
    """A plan to try: a policy and its parameter (None: the policy chooses it from the rate)."""

    policy: str
    parameter: int | None = None

    @property
    def label(self) -> str:
        return (
            self.policy
            if self.parameter is None
            else f"{self.policy} {PARAMETER[self.policy]}={self.parameter}"
        )

    @property
    def default(self) -> bool:
        return self.parameter is None

    def scheduler_flags(self) -> str:
        """How `swarm-scheduler` runs this plan."""
        if self.parameter is None:
            return f"--policy {self.policy}"
        return f"--policy {self.policy} --num-requests {self.parameter}"


@dataclass(frozen=True)
class SearchSettings:
    seeds: int = 2  # Monte Carlo runs (different arrivals) averaged per probed rate
    first_seed: int = 0  # seeds first_seed .. first_seed + seeds - 1 (another range: fresh arrivals)
    min_requests: int = 100  # requests per run: max(min_requests, horizon * rate)
    # seconds of arrivals per run: horizon_s as `swarm-sim --goodput`, or horizon_services lone
    # requests' response times if shorter (a swarm of fast servers builds its queues in less)
    horizon_s: float = 200.0
    horizon_services: float = 50.0
    doublings: int = 6
    halvings: int = 6  # below the common start rate when even it misses the target
    bisections: int = 5
    refine_rounds: int = 2  # bisections of a tuned policy's parameter around its best value
    setup: SetupDelays = NONE  # session set-up delays (none: the pure model of docs/reference.md 2)

    def __post_init__(self) -> None:
        if (
            self.seeds < 1
            or self.first_seed < 0
            or self.min_requests < 1
            or not (self.horizon_s > 0 and self.horizon_services > 0)
        ):
            raise ValueError("seeds, requests and horizon must be positive")
        if min(self.doublings, self.halvings, self.bisections, self.refine_rounds) < 0:
            raise ValueError("the search's step counts must be >= 0")


# -- simulating one candidate ---------------------------------------------------------------------


class CandidateError(Exception):
    """The candidate cannot serve the swarm's requests (infeasible parameter, uncovered blocks)."""


def _placement(candidate: Candidate, scenario: Scenario, rate: float):
    """What a CG-BP or chains dispatcher is built on (its spans, or GCA's composition): the same
    calls as `policies.build_dispatcher` for a default policy, the parameter fixed otherwise."""
    servers, model = list(scenario.servers), scenario.model
    if candidate.policy == "cg-bp":
        if candidate.parameter is None:
            return proposed_placement(servers, model, rate, scenario.l_out).spans
        placed = cg_bp(servers, model, candidate.parameter)
        if not placed.feasible:
            raise CandidateError(f"CG-BP with R={candidate.parameter} leaves blocks below capacity R")
        return placed.spans
    timed = with_chain_times(scenario, scenario.l_out)
    if candidate.parameter is None:
        return tune_capacity(timed, model, rate) or compose(timed, model, 1)
    return compose(timed, model, candidate.parameter)


def dispatcher_for(
    candidate: Candidate,
    scenario: Scenario,
    rate: float,
    rng: np.random.Generator,
    setup: SetupDelays,
    cache: dict | None = None,
):
    """The simulator's dispatcher for a candidate, as `policies.build_dispatcher` builds the default
    policies. `cache` keeps placements between runs: a default policy's for each rate, a fixed
    parameter's for all (c tuning scans every c, which would otherwise cost more than the runs)."""
    try:
        if candidate.policy == "petals":  # its random join order is the run's: nothing to keep
            if scenario.model.hidden_size is None:
                raise CandidateError("PETALS' placement needs the model's hidden_size")
            if petals.cache_capacity_slots(scenario.servers[0], scenario.model, 1) < 1:
                raise CandidateError("PETALS' fixed attention cache cannot hold one session per block")
            return build_dispatcher(candidate.policy, scenario, rate, rng, setup)
        cache = {} if cache is None else cache
        key = (candidate, rate if candidate.default else None)
        if key not in cache:
            cache[key] = _placement(candidate, scenario, rate)
        placement, setup_s = cache[key], setup.for_policy(candidate.policy)
        if candidate.policy == "cg-bp":
            state = RoutingState(list(scenario.servers), scenario.model, placement)
            return WsRrRouting(state, placement, setup_s, scenario.prefill)
        if candidate.policy == "chains":
            return JffcRouting(placement.chains, placement.placement.spans, setup_s)
    except SimulationError as error:
        raise CandidateError(str(error)) from None
    raise ValueError(f"unknown policy {candidate.policy!r}")


def spans_of(dispatcher) -> list[Span | None]:
    """The placement a dispatcher serves (every policy's dispatcher keeps its spans)."""
    return list(dispatcher.spans)


class _Hopeless(Exception):
    """Enough requests of a run already miss their TTFT target that the probe fails whatever the rest do."""

    def __init__(self, missed: int):
        super().__init__(missed)
        self.missed = missed


class _Guarded:
    """A dispatcher that counts requests certain to miss the TTFT target, and stops the run (raises
    `_Hopeless`) past `limit` of them; it also stops a run whose requests retry without end.

    A request cannot see its first token before the start its policy decided (WS-RR's eq. 20 start,
    PETALS' next retry, JFFC's dequeue), so a decided start later than `arrival + ttft` is a certain
    miss. Overloaded runs are where simulation is slowest (WS-RR's queues grow with every arrival)
    and where the outcome is plain first.
    """

    def __init__(self, inner, ttft: float | None = None, limit: int = 0):
        self.inner, self.ttft, self.limit = inner, ttft, limit
        self.setup_s = inner.setup_s
        self.missed: set[int] = set()

    def slot_capacity(self):
        return self.inner.slot_capacity()

    def blocks_held(self):
        return self.inner.blocks_held()

    def _starts_at(self, request: Request, time_: float) -> None:
        if self.ttft is None:
            return
        if time_ - request.arrival > self.ttft and request.id not in self.missed:
            self.missed.add(request.id)
            if len(self.missed) > self.limit:
                raise _Hopeless(len(self.missed))

    def on_arrival(self, request, now, attempt, free_slots):
        if attempt > MAX_ATTEMPTS:  # PETALS' backoff caps at 60 s: this is most of a day of refusals
            raise CandidateError(f"request {request.id} was refused {attempt} times: never finds cache room")
        decision = self.inner.on_arrival(request, now, attempt, free_slots)
        if isinstance(decision, StartAt | RetryAt):
            self._starts_at(request, decision.time)
        return decision

    def on_start(self, request, hops, now, finish):
        self.inner.on_start(request, hops, now, finish)

    def on_finish(self, request, now):
        started = self.inner.on_finish(request, now)
        for waiting, _ in started:
            self._starts_at(waiting, now)
        return started


@dataclass(frozen=True)
class IdleLatency:
    """One request alone in the swarm, the best any default policy gives it (seconds)."""

    ttft: float
    tpot: float
    total: float


def _simulate(scenario: Scenario, dispatcher, requests: Sequence[Request]):
    try:
        return simulate(scenario.servers, scenario.model, dispatcher, requests, scenario.prefill)
    except SimulationError as error:
        raise CandidateError(str(error)) from None


class Evaluator:
    """SLO attainment of candidates on one swarm, memoized; every candidate sees the same arrivals.

    A run stops early once so many of its requests miss the TTFT target that the mean attainment
    over the seeds is below the 90% target whatever the other runs give (`_Guarded`); its
    attainment is then the upper bound it reached, which decides a probe exactly as the full run.
    """

    def __init__(self, scenario: Scenario, slo: Slo, settings: SearchSettings, idle: IdleLatency):
        if not slo.active:
            raise ValueError("the goodput plan needs a TTFT and/or a TPOT target")
        self.scenario, self.slo, self.settings = scenario, slo, settings
        self.horizon = min(settings.horizon_s, settings.horizon_services * idle.total)
        self.simulations = 0
        self._attainment: dict[tuple[Candidate, float], float] = {}
        self._requests: dict[tuple[float, int], list[Request]] = {}
        self._placements: dict = {}
        self._stopped: set[tuple[Candidate, float]] = set()

    def stopped_early(self, candidate: Candidate, rate: float) -> bool:
        """Whether the attainment at `rate` is an upper bound (below the target) from a stopped run."""
        return (candidate, rate) in self._stopped

    def requests(self, rate: float, seed: int) -> list[Request]:
        key = (rate, seed)
        if key not in self._requests:
            count = max(self.settings.min_requests, round(self.horizon * rate))
            rng = np.random.default_rng(seed)
            self._requests[key] = poisson(rate, count, self.scenario.l_in, self.scenario.l_out, rng)
        return self._requests[key]

    def run(self, candidate: Candidate, rate: float, seed: int, requests: Sequence[Request]):
        """One simulation; PETALS' random join order comes from its own stream of the seed."""
        rng = np.random.default_rng([seed, 1])
        dispatcher = dispatcher_for(
            candidate, self.scenario, rate, rng, self.settings.setup, self._placements
        )
        # one run's attainment below 1 - seeds * (1 - target) keeps the mean below the target
        # (exact arithmetic: 200 * (1 - 0.9) is 19.999... in floats)
        missable = 1 - Fraction(GOODPUT_ATTAINMENT).limit_denominator(10**6)
        limit = math.floor(len(requests) * self.settings.seeds * missable)
        self.simulations += 1
        return _simulate(self.scenario, _Guarded(dispatcher, self.slo.ttft_s, limit), requests)

    def attainment(self, candidate: Candidate, rate: float) -> float:
        """Mean SLO attainment over the seeds at a Poisson `rate` (raises `CandidateError`); a value
        below the target may be an upper bound (a run stopped early)."""
        key = (candidate, rate)
        if key not in self._attainment:
            values = []
            first = self.settings.first_seed
            for seed in range(first, first + self.settings.seeds):
                requests = self.requests(rate, seed)
                try:
                    records = self.run(candidate, rate, seed, requests).records
                except _Hopeless as stop:
                    values.append(1 - stop.missed / len(requests))
                    self._stopped.add(key)
                    continue
                metrics = per_request(records)
                values.append(slo_attainment(metrics["ttft"], metrics["tpot"], self.slo))
            self._attainment[key] = float(np.mean(values))
        return self._attainment[key]


# -- the swarm's idle latencies and the rate ladder ------------------------------------------------


def idle_latency(scenario: Scenario, setup: SetupDelays = NONE) -> IdleLatency:
    """TTFT, TPOT and response time of a lone request, each the least over the default policies."""
    request = [Request(0, 0.0, scenario.l_in, scenario.l_out)]
    found = []
    for policy in DEFAULT_POLICIES:
        if policy == "petals" and scenario.model.hidden_size is None:
            continue
        try:
            dispatcher = dispatcher_for(
                Candidate(policy), scenario, IDLE_RATE, np.random.default_rng(0), setup
            )
            result = _simulate(scenario, _Guarded(dispatcher), request)
        except CandidateError:
            continue
        metrics = per_request(result.records)
        found.append((float(metrics["ttft"][0]), float(metrics["tpot"][0]), float(metrics["total"][0])))
    if not found:
        raise CandidateError("no policy can serve a single request on this swarm")
    return IdleLatency(*(min(values) for values in zip(*found, strict=True)))
