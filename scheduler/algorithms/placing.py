"""Block placement by policy: a typed problem in, a typed placement out (docs/reference.md 3.1, 3.3, 3.4).

The one place that knows which algorithm a policy name means and which server fields it needs.
`swarm-plan place` (via `scheduler.plan.commands`) and the scheduler service both call it; neither
goes through JSON to reach an algorithm (`scheduler.plan.problem_io` reads and writes the documents).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from llm_swarm.scheduler.algorithms import petals
from llm_swarm.scheduler.algorithms.cgbp import cg_bp, choose_num_requests
from llm_swarm.scheduler.algorithms.chains import DEFAULT_RHO_BAR, gbp_cr
from llm_swarm.scheduler.algorithms.problem import ModelSpec, ServerSpec, Span, uncovered_blocks
from llm_swarm.scheduler.algorithms.tuning import Composition, tune_capacity


class PlanInputError(ValueError):
    """The input is not a valid problem; the message is one line meant for the user."""


class Infeasible(Exception):
    """The input is valid but no plan serves the whole model (`swarm-plan` exit status 3)."""

    def __init__(self, message: str, uncovered: list[int]):
        super().__init__(message)
        self.uncovered = uncovered


@dataclass(frozen=True)
class PlanProblem:
    """What to place: the model, the servers and the policy's parameters (problem.json, typed)."""

    model: ModelSpec
    servers: tuple[ServerSpec, ...]
    num_requests: int | None = None  # R for CG-BP
    arrival_rate: float | None = None  # lambda, requests/s
    l_out: int | None = None  # output tokens per request (to estimate T1 when choosing R)
    capacity: int | str | None = None  # Sun, He and Hou's c, or "auto"
    rho_bar: float = DEFAULT_RHO_BAR


@dataclass(frozen=True)
class PlacedServers:
    """A placement: one span per server of the problem (aligned with `problem.servers`)."""

    spans: tuple[Span | None, ...]
    order: tuple[int, ...]  # the order the algorithm placed the servers in (indices into servers)
    num_requests: int | None = None  # CG-BP's R
    bound: float | None = None  # CG-BP's eq. 17 bound, s/token
    capacity: int | None = None  # GBP-CR's c

    def by_name(self, problem: PlanProblem) -> dict[str, Span | None]:
        return {server.name: span for server, span in zip(problem.servers, self.spans, strict=True)}


def require_server_fields(
    problem: PlanProblem, fields: Sequence[str | tuple[str, ...]], purpose: str
) -> None:
    """Raise unless every server carries `fields` (e.g. `tau` for CG-BP); a tuple means any one of them."""
    for j, server in enumerate(problem.servers):
        for alternatives in fields:
            names = (alternatives,) if isinstance(alternatives, str) else alternatives
            if not any(_present(getattr(server, name)) for name in names):
                raise PlanInputError(
                    f"{server_where(j, server.name)}.{' or '.join(names)}: required for {purpose}"
                )


def server_where(j: int, name: str) -> str:
    """How messages name server `j`: `servers[2] (mig1)`."""
    return f"servers[{j}] ({name})"


def cg_bp_placement(problem: PlanProblem) -> PlacedServers:
    """CG-BP (docs/reference.md 3.1) for the problem's R, or for R chosen from its arrival rate."""
    require_server_fields(problem, ["tau", "rtt"], "cg-bp")
    requests = problem.num_requests
    if requests is None:
        requests = _choose_requests(problem)
    result = cg_bp(problem.servers, problem.model, requests)
    if not result.feasible:
        raise Infeasible(
            f"CG-BP with R={requests} leaves blocks with capacity below R: lower num_requests or add servers",
            list(result.uncovered_blocks),
        )
    return PlacedServers(tuple(result.spans), tuple(result.order), num_requests=requests, bound=result.bound)


def _choose_requests(problem: PlanProblem) -> int:
    if problem.arrival_rate is None or problem.l_out is None:
        raise PlanInputError("num_requests: missing (or give arrival_rate and l_out to choose it)")
    require_server_fields(problem, ["tau_prefill", "rtt_prefill"], "choosing num_requests from arrival_rate")
    requests = choose_num_requests(problem.servers, problem.model, problem.arrival_rate, problem.l_out)
    if requests is None:
        single = cg_bp(problem.servers, problem.model, 1)
        raise Infeasible(
            "CG-BP cannot serve even one request: add servers or memory", list(single.uncovered_blocks)
        )
    return requests


def petals_placement(problem: PlanProblem) -> PlacedServers:
    """PETALS' own placement (docs/reference.md 3.3), the baseline."""
    if problem.model.hidden_size is None:
        raise PlanInputError(
            "model.hidden_size: required for petals (its block count reserves memory by width)"
        )
    require_server_fields(problem, [("tau", "forward_rps")], "petals")
    result = petals.place(problem.servers, problem.model)
    if not result.feasible:
        raise Infeasible("PETALS' placement leaves blocks on no server", list(result.uncovered_blocks))
    return PlacedServers(tuple(result.spans), tuple(result.order))


def gbp_cr_placement(problem: PlanProblem) -> PlacedServers:
    """GBP-CR (docs/reference.md 3.4) for the problem's c, or for the c tuned to its arrival rate
    (`"auto"`)."""
    require_server_fields(problem, ["tau_c", "tau_p"], "gbp-cr")
    if problem.capacity == "auto":
        composition = tuned_composition(problem, objective="lower-bound")
        capacity, placement = composition.capacity, composition.placement
    else:
        capacity = fixed_capacity(problem)
        placement = gbp_cr(problem.servers, problem.model, capacity, problem.arrival_rate, problem.rho_bar)
    if not placement.chains:
        raise Infeasible(
            f"GBP-CR with c={capacity} completes no chain",
            uncovered_blocks(placement.spans, problem.model.num_blocks),
        )
    return PlacedServers(tuple(placement.spans), tuple(placement.order), capacity=capacity)


def tuned_composition(problem: PlanProblem, objective: str) -> Composition:
    """c* for "c": "auto" (docs/reference.md 3.4), with the chains composed for it."""
    if problem.arrival_rate is None:
        raise PlanInputError('arrival_rate: required with "c": "auto"')
    composition = tune_capacity(
        problem.servers, problem.model, problem.arrival_rate, problem.rho_bar, objective
    )
    if composition is None:
        single = gbp_cr(problem.servers, problem.model, 1)
        raise Infeasible(
            f"no capacity c gives a stable system at arrival_rate={problem.arrival_rate}",
            uncovered_blocks(single.spans, problem.model.num_blocks),
        )
    return composition


def fixed_capacity(problem: PlanProblem) -> int:
    """The problem's integer c (GBP-CR and chain composition without tuning)."""
    if not isinstance(problem.capacity, int):
        raise PlanInputError('c: missing (a positive integer, or "auto" with arrival_rate)')
    return problem.capacity


# `swarm-plan place --algo NAME`: the placement algorithms by the names users type.
PLACEMENTS: dict[str, Callable[[PlanProblem], PlacedServers]] = {
    "cg-bp": cg_bp_placement,
    "petals": petals_placement,
    "gbp-cr": gbp_cr_placement,
}


def _present(value: object) -> bool:
    """A field counts as given unless None or an empty mapping (e.g. `"rtt": {}`)."""
    return value is not None and not (isinstance(value, Mapping) and not value)
