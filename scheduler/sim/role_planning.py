"""The role planner (`scheduler.algorithms.role_split`) on a simulated swarm: its inputs from a `Scenario`,
and its candidates scored by goodput in the contended simulator.

A candidate's score is its goodput: the highest Poisson rate at which >= 90% of requests meet both
SLOs (`goodput_plan.search_goodput`), the servers running the live loop (`--contended serial`), the
chosen prefill servers taking prompts as the live scheduler plans them (`--disaggregate scheduler`;
`RoleSearch.disaggregate` selects the client's own rule instead) and handing caches over the
scenario's links (`scheduler.sim.contended_roles`), the others placed and routed by the policy (cg-bp). A
search stops as soon as it cannot beat the best score found so far, and runs that already miss the
target stop early (`plan_runs._Guarded`), so a plan of a few candidates takes seconds.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction

import numpy as np

from llm_swarm.scheduler.algorithms.problem import Span
from llm_swarm.scheduler.algorithms.role_split import (
    BOTH,
    RoleInputs,
    RolePlan,
    Roles,
    RoleWorkload,
    plan_roles,
)
from llm_swarm.scheduler.sim.contended_roles import link_rates
from llm_swarm.scheduler.sim.contended_run import ContendedOptions, simulate_contended
from llm_swarm.scheduler.sim.discrete_events import SimulationError
from llm_swarm.scheduler.sim.goodput_plan import search_goodput
from llm_swarm.scheduler.sim.metrics import GOODPUT_ATTAINMENT, Slo, per_request, slo_attainment
from llm_swarm.scheduler.sim.plan_runs import _Guarded, _Hopeless
from llm_swarm.scheduler.sim.policies import build_dispatcher, proposed_placement
from llm_swarm.scheduler.sim.scenarios import Link, Scenario
from llm_swarm.scheduler.sim.workload import Request, poisson

UNKNOWN_LINK_BPS = 1e6  # a link nobody measured: the simulated client's rule must not use it


@dataclass(frozen=True)
class RoleSearch:
    """How each candidate's goodput is searched (small by default: the plan must take seconds)."""

    seeds: int = 1
    min_requests: int = 60  # per run: max(min_requests, horizon_s * rate)
    horizon_s: float = 120.0
    start_rate: float = 0.05
    doublings: int = 8
    halvings: int = 4
    bisections: int = 3
    policy: str = "cg-bp"
    contended: str = "serial"
    link_rtt_s: float = 0.010  # round trip of every server-to-server link
    # how prompts are sent to prefill servers: "scheduler" (the live scheduler's queue-aware plan,
    # `scheduler/service/prefill_routing.py`, what a swarm with a scheduler does) or a client rule
    disaggregate: str = "scheduler"

    def __post_init__(self) -> None:
        if self.seeds < 1 or self.min_requests < 1 or not (self.horizon_s > 0 and self.start_rate > 0):
            raise ValueError("the role search needs seeds, requests, horizon and start rate > 0")
        if min(self.doublings, self.halvings, self.bisections) < 0 or not self.link_rtt_s >= 0:
            raise ValueError("the role search's step counts and link round trip must be >= 0")


def kv_token_bytes(scenario: Scenario) -> float:
    model = scenario.model
    return 2 * (model.kv_dim or model.hidden_size or 0) * model.dtype_bytes


def with_links(scenario: Scenario, links: Mapping[str, Mapping[str, float]], rtt_s: float) -> Scenario:
    """The scenario with links given in bytes/s by server name (a pair not given: `UNKNOWN_LINK_BPS`)."""
    names = [s.name for s in scenario.servers]
    rows = []
    for a in names:
        row = []
        for b in names:
            rate = links.get(a, {}).get(b)
            row.append(Link(0.0, math.inf) if a == b else Link(rtt_s, 8 * rate if rate else UNKNOWN_LINK_BPS))
        rows.append(tuple(row))
    return dataclasses.replace(scenario, server_links=tuple(rows))


def role_inputs(
    scenario: Scenario, rate: float | None = None, spans: Sequence[Span | None] | None = None
) -> RoleInputs:
    """The planner's inputs: `spans`, or else CG-BP's colocated placement at `rate` (0.1 req/s when
    unknown), for the scenario's nominal lengths."""
    if spans is None:
        spans = proposed_placement(list(scenario.servers), scenario.model, rate or 0.1, scenario.l_out).spans
    return RoleInputs(
        scenario.servers,
        list(spans),
        scenario.model.num_blocks,
        link_rates(scenario),
        kv_token_bytes(scenario),
        RoleWorkload(scenario.l_in, scenario.l_out, rate),
    )


class GoodputOfRoles:
    """`evaluate(roles)` for `plan_roles`: goodput in the contended simulator, memoized, each candidate
    seeing the same arrivals; a search stops once it cannot beat the best goodput seen."""

    def __init__(
        self,
        scenario: Scenario,
        slo: Slo,
        search: RoleSearch = RoleSearch(),
        requests: Callable[[float, int], list[Request]] | None = None,
        prune: bool = True,
    ):
        if not slo.active:
            raise ValueError("role planning by goodput needs a TTFT and/or a TPOT target")
        if scenario.server_links is None:
            raise ValueError("role planning by goodput needs the links between servers")
        self.scenario, self.slo, self.search = scenario, slo, search
        self._requests = requests
        self._cache: dict[tuple[float, int], list[Request]] = {}
        self.scores: dict[Roles, float] = {}
        self.prune = prune  # False: every candidate's goodput searched to the end (for reports)
        self.best = 0.0
        self.simulations = 0

    def requests(self, rate: float, seed: int) -> list[Request]:
        key = (rate, seed)
        if key not in self._cache:
            if self._requests is not None:
                self._cache[key] = self._requests(rate, seed)
            else:
                count = max(self.search.min_requests, round(self.search.horizon_s * rate))
                rng = np.random.default_rng(seed)
                self._cache[key] = poisson(rate, count, self.scenario.l_in, self.scenario.l_out, rng)
        return self._cache[key]

    def attainment(self, roles: Roles, rate: float) -> float:
        scenario = dataclasses.replace(self.scenario, roles=None if all(r == BOTH for r in roles) else roles)
        options = ContendedOptions(self.search.contended, disaggregate=self.search.disaggregate)
        missable = 1 - Fraction(GOODPUT_ATTAINMENT).limit_denominator(10**6)
        values = []
        for seed in range(self.search.seeds):
            requests = self.requests(rate, seed)
            limit = math.floor(len(requests) * self.search.seeds * missable)
            rng = np.random.default_rng([seed, 1])

            def dispatcher(decode: Scenario, rng=rng, limit=limit):
                inner = build_dispatcher(self.search.policy, decode, rate, rng)
                return _Guarded(inner, self.slo.ttft_s, limit)

            self.simulations += 1
            try:
                records = simulate_contended(scenario, options, requests, dispatcher).records
            except _Hopeless as stop:
                values.append(1 - stop.missed / len(requests))
                continue
            except SimulationError:
                return 0.0  # the candidate cannot serve (e.g. the decoders cannot hold the model)
            metrics = per_request(records)
            values.append(slo_attainment(metrics["ttft"], metrics["tpot"], self.slo))
        return float(np.mean(values))

    def __call__(self, roles: Roles) -> float:
        roles = tuple(roles)
        if roles not in self.scores:
            s = self.search
            found = search_goodput(
                lambda rate: self.attainment(roles, rate),
                s.start_rate,
                doublings=s.doublings,
                halvings=s.halvings,
                bisections=s.bisections,
                beat=self.best if self.prune else 0.0,
            )
            self.scores[roles] = found.goodput
            self.best = max(self.best, found.goodput)
        return self.scores[roles]


def plan_scenario_roles(
    scenario: Scenario,
    slo: Slo,
    search: RoleSearch = RoleSearch(),
    requests: Callable[[float, int], list[Request]] | None = None,
    min_gain: float = 0.0,
) -> tuple[RolePlan, GoodputOfRoles]:
    """The planner's choice on a simulated swarm (its links must be set), and the evaluator (scores)."""
    evaluate = GoodputOfRoles(scenario, slo, search, requests)
    return plan_roles(role_inputs(scenario), evaluate, min_gain), evaluate


def roles_text(roles: Sequence[str]) -> str:
    """`swarm-sim --roles` text for a plan (runs of one role joined as `role*n`)."""
    parts: list[str] = []
    for role in roles:
        if parts and parts[-1].split("*")[0] == role:
            name, _, times = parts[-1].partition("*")
            parts[-1] = f"{name}*{int(times or 1) + 1}"
        else:
            parts.append(role)
    return ",".join(parts)


def split_swarm(l_in: int, l_out: int, link_mbps: float, link_rtt_s: float = 0.010) -> Scenario:
    """A swarm where roles should pay: four compute-rich, bandwidth-poor 80 GB GPUs (300 TFLOPS,
    0.5 TB/s: prefill fast, decode slow) and four bandwidth-rich, compute-poor ones (25 TFLOPS,
    2 TB/s: the reverse), each able to hold the whole `hetero` model (LLaMA-2-70B-shaped, NF4),
    the client 20 ms from all, every two servers joined at `link_mbps`."""
    from llm_swarm.scheduler.sim import hetero
    from llm_swarm.scheduler.sim.contended_roles import uniform_links
    from llm_swarm.scheduler.sim.profiles import GIB
    from llm_swarm.scheduler.sim.scenarios import build_scenario

    compute = hetero.footnote11("compute-80GB", 79 * GIB, tflops=300, gb_per_ms=0.5)
    bandwidth = hetero.footnote11("bandwidth-80GB", 79 * GIB, tflops=25, gb_per_ms=2.0)
    gpus = (compute,) * 4 + (bandwidth,) * 4
    scenario = build_scenario(
        "split", hetero.LLAMA_2_70B_NF4, gpus, [hetero.CLIENT_LINK] * len(gpus), l_in, l_out
    )
    return dataclasses.replace(scenario, server_links=uniform_links(len(gpus), link_rtt_s, link_mbps * 1e6))


def roles_document(scenario: Scenario, slo: Slo, link_mbps: float, link_rtt_ms: float) -> dict:
    """`swarm-plan goodput --roles auto --link-mbps M`: the role plan on the swarm with every two
    servers joined at M Mbit/s, as JSON (goodputs are the contended model's, cg-bp, 1 seed)."""
    from llm_swarm.scheduler.sim.contended_roles import uniform_links

    if not link_mbps > 0 or not link_rtt_ms >= 0:
        raise ValueError("--link-mbps must be positive and --link-rtt-ms >= 0")
    links = uniform_links(len(scenario.servers), link_rtt_ms / 1e3, link_mbps * 1e6)
    linked = dataclasses.replace(scenario, server_links=links)
    search = RoleSearch(link_rtt_s=link_rtt_ms / 1e3)
    started = time.perf_counter()
    plan, evaluate = plan_scenario_roles(linked, slo, search)
    names = [s.name for s in scenario.servers]
    return {
        "model": "contended serial, cg-bp, 1 seed per probe",
        "link_mbps": link_mbps,
        "chosen": "colocated" if plan.colocated else roles_text(plan.roles),
        "roles": dict(zip(names, plan.roles, strict=True)),
        "hand_off_targets": {name: list(targets) for name, targets in plan.targets.items()},
        "goodput": None if math.isnan(plan.score) else plan.score,
        "colocated_goodput": None if math.isnan(plan.colocated_score) else plan.colocated_score,
        "reason": plan.reason,
        "candidates": [{"roles": roles_text(roles), "goodput": score} for roles, score in plan.evaluated],
        "scheduler_flags": "--roles auto" if not plan.colocated else "--roles off",
        "simulations": evaluate.simulations,
        "search_s": round(time.perf_counter() - started, 3),
    }
