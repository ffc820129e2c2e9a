"""Goodput planning: the placement policy and parameter that serve the most requests per
second within the SLOs on one swarm, found by simulation (DistServe's algorithm 1 over our policies).

Candidates (`candidate_grid`):

- the policies as the scheduler runs them by default, re-planned for every arrival rate probed
  (exactly `swarm-sim --goodput`'s policies): `cg-bp` (CG-BP with R from the rate + WS-RR),
  `chains` (GBP-CR with c tuned by Theorem 3.7 + GCA + JFFC) and `petals` (the baseline);
- the same with the parameter fixed: `cg-bp R=k` and `chains c=k` for k on a doubling grid up to the
  largest feasible value, plus the values the defaults choose at the measured rate, then refined
  by bisecting around each family's best (`refine_rounds`).

Each candidate's goodput is searched on one rate ladder (`search_goodput`): all start at the same
low rate derived from the swarm's memory and idle service time (`start_rate`), double until the
attainment target is missed, then bisect. A fixed-parameter candidate stops early once the rate it
failed at is no higher than the best goodput found so far: it cannot win, and its goodput is then
shown as a lower bound (`pruned`). The default policies are searched to the end, so the table
always holds their goodput beside the chosen plan's, which is therefore at least theirs.

`servers_to_add` answers Aladdin's question (how many more servers of a kind the swarm needs to
meet the SLOs at a rate) by a monotone search over the count (`smallest_count`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from llm_swarm.scheduler.algorithms.cgbp import cg_bp, choose_num_requests, max_requests
from llm_swarm.scheduler.algorithms.problem import Span, floor_ratio
from llm_swarm.scheduler.algorithms.tuning import compose, max_capacity, tune_capacity
from llm_swarm.scheduler.sim.metrics import GOODPUT_ATTAINMENT, Slo
from llm_swarm.scheduler.sim.plan_runs import (
    DEFAULT_POLICIES,
    Candidate,
    CandidateError,
    Evaluator,
    IdleLatency,
    SearchSettings,
    dispatcher_for,
    idle_latency,
    spans_of,
)
from llm_swarm.scheduler.sim.planning_swarm import with_added_servers
from llm_swarm.scheduler.sim.policies import with_chain_times
from llm_swarm.scheduler.sim.rate_probes import RateProbes
from llm_swarm.scheduler.sim.scenarios import Scenario

TUNED = ("cg-bp", "chains")  # the policies with a parameter: R and c
GRID_LIMIT = 1 << 16  # no parameter grid goes past this, whatever the memory allows

# -- the rate search (pure) ------------------------------------------------------------------------


@dataclass(frozen=True)
class RateSearch:
    goodput: float  # requests/s (docs/reference.md 6: the prefix rule of `metrics.goodput`)
    probes: tuple[tuple[float, float], ...]  # (rate, attainment) in probing order
    capped: bool = False  # never missed the target up to the last doubling: goodput is at least this
    pruned: bool = False  # stopped once it could not beat `beat`: goodput is a lower bound below it


def search_goodput(
    attainment_at: Callable[[float], float],
    start: float,
    *,
    doublings: int = 6,
    halvings: int = 6,
    bisections: int = 5,
    beat: float = 0.0,
    target: float = GOODPUT_ATTAINMENT,
) -> RateSearch:
    """Goodput by doubling from `start` until the target is missed (halving instead when `start`
    itself misses), then bisecting the bracket; stops as soon as the failing end of the bracket is
    no higher than `beat` (such a candidate's goodput is below `beat`)."""
    if not start > 0:
        raise ValueError(f"the start rate must be positive, got {start}")
    probe = RateProbes(attainment_at, target)
    low, high, pruned = 0.0, None, False
    if probe.passes(start):
        low = start
        for _ in range(doublings):
            if probe.passes(2 * low):
                low *= 2
            else:
                high = 2 * low
                break
    else:
        high = start
        for _ in range(halvings):
            if high <= beat:
                pruned = True
                break
            if probe.passes(high / 2):
                low = high / 2
                break
            high /= 2
    if high is not None and low > 0:
        for _ in range(bisections):
            if high <= beat:
                pruned = True
                break
            middle = (low + high) / 2
            if probe.passes(middle):
                low = middle
            else:
                high = middle
    return RateSearch(probe.goodput(), tuple(probe.probes), high is None, pruned)


def smallest_count(meets: Callable[[int], bool], cap: int) -> int | None:
    """The smallest n in [0, cap] with `meets(n)`, for a predicate that stays true once true
    (more servers never hurt): doubling, then bisection; None if even `cap` does not meet it."""
    if cap < 0:
        raise ValueError(f"the cap must be >= 0, got {cap}")
    if meets(0):
        return 0
    low, high = 0, min(1, cap)
    while high > low and not meets(high):
        if high == cap:
            return None
        low, high = high, min(2 * high, cap)
    if high == low:  # cap == 0
        return None
    while high - low > 1:
        middle = (low + high) // 2
        if meets(middle):
            high = middle
        else:
            low = middle
    return high


def start_rate(scenario: Scenario, idle: IdleLatency, doublings: int) -> float:
    """The rate every candidate's search starts at: `doublings` halvings below an upper bound on any
    policy's throughput (the most sessions memory can hold at once, each holding its cache on every
    block, over a lone request's response time: Little's law), so the ladder ends at twice it."""
    model = scenario.model
    memory = sum(s.memory_bytes for s in scenario.servers)
    sessions = floor_ratio(
        memory - model.block_bytes * model.num_blocks, model.cache_bytes * model.num_blocks
    )
    if sessions < 1 or not idle.total > 0:
        raise CandidateError("the swarm's memory holds the model but no session")
    return sessions / idle.total / 2 ** (doublings - 1)


# -- candidates -------------------------------------------------------------------------------------


def _doubling_grid(feasible: Callable[[int], bool], limit: int) -> list[int]:
    """1, 2, 4, ... while feasible, and the largest feasible value below the first infeasible one."""
    grid: list[int] = []
    value = 1
    while value <= limit and feasible(value):
        grid.append(value)
        value *= 2
    if grid and value <= limit:  # bisect between the last feasible and the first infeasible
        low, high = grid[-1], value
        while high - low > 1:
            middle = (low + high) // 2
            low, high = (middle, high) if feasible(middle) else (low, middle)
        if low not in grid:
            grid.append(low)
    return grid


def candidate_grid(scenario: Scenario, rate: float | None) -> list[Candidate]:
    """The default policies, then each tuned policy with its parameter on a doubling grid (and the
    value its default would choose at `rate`, the measured rate, when known)."""
    servers, model = list(scenario.servers), scenario.model
    candidates = [Candidate(p) for p in DEFAULT_POLICIES if p != "petals" or model.hidden_size is not None]
    r_limit = min(max(max_requests(servers, model), 1) * 4, GRID_LIMIT)
    r_values = set(_doubling_grid(lambda r: cg_bp(servers, model, r).feasible, r_limit))
    timed = with_chain_times(scenario, scenario.l_out)
    c_limit = min(max(max_capacity(timed, model), 1), GRID_LIMIT)
    c_values = set(_doubling_grid(lambda c: bool(compose(timed, model, c).chains), c_limit))
    if rate is not None:
        chosen = choose_num_requests(servers, model, rate, scenario.l_out)
        while chosen and not cg_bp(servers, model, chosen).feasible:
            chosen -= 1  # as the simulator's cg-bp lowers R until feasible
        if chosen:
            r_values.add(chosen)
        tuned = tune_capacity(timed, model, rate)
        if tuned is not None and tuned.chains:
            c_values.add(tuned.capacity)
    candidates += [Candidate("cg-bp", r) for r in sorted(r_values)]
    candidates += [Candidate("chains", c) for c in sorted(c_values)]
    return candidates


# -- the plan search -------------------------------------------------------------------------------


@dataclass(frozen=True)
class CandidateResult:
    candidate: Candidate
    search: RateSearch | None  # None: the candidate cannot serve the swarm (`error`)
    attainment_at_rate: float | None = None  # at the measured rate, when one is given
    error: str = ""
    # rates whose attainment is an upper bound below the target (a run stopped early, `Evaluator`)
    bounded: tuple[float, ...] = ()

    @property
    def goodput(self) -> float:
        return self.search.goodput if self.search is not None else 0.0


@dataclass(frozen=True)
class GoodputPlan:
    best: CandidateResult
    results: tuple[CandidateResult, ...]  # in evaluation order
    idle: IdleLatency
    start_rate: float
    simulations: int
    search_s: float
    placement: tuple[Span | None, ...] = field(default=())  # the best plan's, at the planning rate


def _rank(result: CandidateResult) -> tuple:
    """Best first: goodput, then attainment at the measured rate, then a default policy."""
    return (result.goodput, result.attainment_at_rate or 0.0, result.candidate.default)


def plan_goodput(
    scenario: Scenario, slo: Slo, rate: float | None = None, settings: SearchSettings | None = None
) -> GoodputPlan:
    """Search every candidate's goodput on the swarm; the best plan and the whole table.

    `rate` is the measured arrival rate: the defaults' parameters at it join the grid, every
    candidate's attainment at it is reported, and the best plan's placement is made for it.
    """
    settings = settings or SearchSettings()
    if rate is not None and not (math.isfinite(rate) and rate > 0):
        raise ValueError(f"the arrival rate must be positive, got {rate}")
    started = time.perf_counter()
    idle = idle_latency(scenario, settings.setup)
    evaluator = Evaluator(scenario, slo, settings, idle)
    start = start_rate(scenario, idle, settings.doublings)
    results: dict[Candidate, CandidateResult] = {}
    best = 0.0

    def evaluate(candidate: Candidate) -> None:
        nonlocal best
        if candidate in results:
            return
        try:
            search = search_goodput(
                lambda r: evaluator.attainment(candidate, r),
                start,
                doublings=settings.doublings,
                halvings=settings.halvings,
                bisections=settings.bisections,
                beat=0.0 if candidate.default else best,
            )
            at_rate = evaluator.attainment(candidate, rate) if rate is not None else None
        except CandidateError as error:
            results[candidate] = CandidateResult(candidate, None, None, str(error))
            return
        rates = [r for r, _ in search.probes] + ([rate] if rate is not None else [])
        bounded = tuple(r for r in dict.fromkeys(rates) if evaluator.stopped_early(candidate, r))
        results[candidate] = CandidateResult(candidate, search, at_rate, bounded=bounded)
        best = max(best, search.goodput)

    for candidate in candidate_grid(scenario, rate):
        evaluate(candidate)
    for _ in range(settings.refine_rounds):
        for candidate in _refinements(results.values()):
            evaluate(candidate)
    table = tuple(results.values())
    winner = max(table, key=_rank)
    if winner.search is None:
        raise CandidateError("no candidate can serve this swarm: " + "; ".join(r.error for r in table))
    placement = tuple(_spans(winner.candidate, scenario, rate or winner.goodput or start, settings))
    return GoodputPlan(
        winner, table, idle, start, evaluator.simulations, time.perf_counter() - started, placement
    )


def _refinements(results) -> list[Candidate]:
    """For each tuned policy, the midpoints between its best parameter and its tried neighbours."""
    new = []
    for policy in TUNED:
        tried = sorted(
            (r for r in results if r.candidate.policy == policy and not r.candidate.default),
            key=lambda r: r.candidate.parameter,
        )
        scored = [r for r in tried if r.search is not None]
        if not scored:
            continue
        top = max(scored, key=_rank)
        values = [r.candidate.parameter for r in tried]
        k = values.index(top.candidate.parameter)
        for neighbour in (values[k - 1] if k > 0 else None, values[k + 1] if k + 1 < len(values) else None):
            if neighbour is not None:
                middle = (neighbour + top.candidate.parameter) // 2
                if middle not in values:
                    new.append(Candidate(policy, middle))
    return new


def _spans(candidate: Candidate, scenario: Scenario, rate: float, settings: SearchSettings):
    return spans_of(dispatcher_for(candidate, scenario, rate, np.random.default_rng(0), settings.setup))


# -- Aladdin: how many more servers ---------------------------------------------------------------


@dataclass(frozen=True)
class ServersToAdd:
    kind: str
    rate: float
    count: int | None  # None: not met with up to `cap` more servers
    cap: int
    candidate: Candidate | None  # the plan that meets the SLOs with `count` more servers
    attainment: float | None
    tried: tuple[tuple[int, bool], ...]  # (count, met) in the order searched
    placement: tuple[Span | None, ...] = ()
    scenario: Scenario | None = None  # the grown swarm


def servers_to_add(
    scenario: Scenario,
    kind: str,
    rate: float,
    slo: Slo,
    settings: SearchSettings | None = None,
    cap: int = 32,
    first: Sequence[Candidate] = (),
) -> ServersToAdd:
    """The fewest copies of `kind` (a GPU kind or a server of the swarm) with which some candidate
    meets the SLOs for >= 90% of requests at `rate`. `first`: candidates to try first at every count
    (e.g. the best plan on the swarm as it is)."""
    settings = settings or SearchSettings()
    if not (math.isfinite(rate) and rate > 0):
        raise ValueError(f"--at-rate must be positive, got {rate}")
    with_added_servers(scenario, kind, 0)  # an unknown kind fails here, before any simulation
    idle = idle_latency(scenario, settings.setup)  # sizes the runs alike at every count
    found: dict[int, tuple[Candidate, float] | None] = {}
    tried: list[tuple[int, bool]] = []

    def meets(count: int) -> bool:
        if count not in found:
            grown = with_added_servers(scenario, kind, count)
            evaluator = Evaluator(grown, slo, settings, idle)
            found[count] = None
            for candidate in dict.fromkeys([*first, *candidate_grid(grown, rate)]):
                try:
                    attained = evaluator.attainment(candidate, rate)
                except CandidateError:
                    continue
                if attained >= GOODPUT_ATTAINMENT:
                    found[count] = (candidate, attained)
                    break
            tried.append((count, found[count] is not None))
        return found[count] is not None

    count = smallest_count(meets, cap)
    if count is None:
        return ServersToAdd(kind, rate, None, cap, None, None, tuple(tried))
    candidate, attained = found[count]
    grown = with_added_servers(scenario, kind, count)
    placement = tuple(_spans(candidate, grown, rate, settings))
    return ServersToAdd(kind, rate, count, cap, candidate, attained, tuple(tried), placement, grown)
