"""The `swarm-plan` commands as pure functions: parsed problem in, output document out (SPEC section 4).

`scheduler.plan_cli` wraps them with stdin/stdout and exit codes; the scheduler service calls them
directly, so a placement it publishes is exactly what `swarm-plan place` computes from the same
problem document.
"""

from __future__ import annotations

from typing import Any

from scheduler.algorithms import petals
from scheduler.algorithms.cgbp import cg_bp, choose_num_requests
from scheduler.algorithms.chains import gbp_cr
from scheduler.algorithms.problem import uncovered_blocks
from scheduler.algorithms.tuning import Composition, compose, tune_capacity
from scheduler.algorithms.wsrr import RoutingState
from scheduler.plan_io import (
    PlanInputError,
    PlanProblem,
    RoutingProblem,
    chain_json,
    json_number,
    parse_routing,
    placement_json,
    require_server_fields,
)


class Infeasible(Exception):
    """The input is valid but no plan serves the whole model (exit status 3)."""

    def __init__(self, message: str, uncovered: list[int]):
        super().__init__(message)
        self.uncovered = uncovered


# -- place ---------------------------------------------------------------------------------------


def place_cg_bp(problem: PlanProblem) -> dict[str, Any]:
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
    return {
        "placement": placement_json(problem.servers, result.spans),
        "num_requests": requests,
        "bound": result.bound,
        "order": [problem.servers[j].name for j in result.order],
    }


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


def place_petals(problem: PlanProblem) -> dict[str, Any]:
    if problem.model.hidden_size is None:
        raise PlanInputError(
            "model.hidden_size: required for petals (its block count reserves memory by width)"
        )
    require_server_fields(problem, [("tau", "forward_rps")], "petals")
    result = petals.place(problem.servers, problem.model)
    if not result.feasible:
        raise Infeasible("PETALS' placement leaves blocks on no server", list(result.uncovered_blocks))
    return {
        "placement": placement_json(problem.servers, result.spans),
        "order": [problem.servers[j].name for j in result.order],
    }


def place_gbp_cr(problem: PlanProblem) -> dict[str, Any]:
    require_server_fields(problem, ["tau_c", "tau_p"], "gbp-cr")
    if problem.capacity == "auto":
        composition = _tuned(problem, objective="lower-bound")
        capacity, placement = composition.capacity, composition.placement
    else:
        capacity = _fixed_capacity(problem)
        placement = gbp_cr(problem.servers, problem.model, capacity, problem.arrival_rate, problem.rho_bar)
    if not placement.chains:
        raise Infeasible(
            f"GBP-CR with c={capacity} completes no chain",
            uncovered_blocks(placement.spans, problem.model.num_blocks),
        )
    return {
        "placement": placement_json(problem.servers, placement.spans),
        "c": capacity,
        "order": [problem.servers[j].name for j in placement.order],
    }


# -- compose -------------------------------------------------------------------------------------


def compose_chains(problem: PlanProblem, objective: str) -> dict[str, Any]:
    require_server_fields(problem, ["tau_c", "tau_p"], "compose")
    if problem.capacity == "auto":
        composition = _tuned(problem, objective)
    else:
        composition = compose(
            problem.servers, problem.model, _fixed_capacity(problem), problem.arrival_rate, problem.rho_bar
        )
    if not composition.chains:
        raise Infeasible(
            f"no chain with free cache slots covers the model with c={composition.capacity}",
            uncovered_blocks(composition.placement.spans, problem.model.num_blocks),
        )
    output: dict[str, Any] = {
        "c": composition.capacity,
        "chains": [
            {
                "servers": [problem.servers[j].name for j in chain.servers],
                "blocks": list(chain.blocks),
                "capacity": chain.capacity,
                "service_time": chain.service_time,
            }
            for chain in composition.chains
        ],
        "service_rate": composition.service_rate,
    }
    if problem.arrival_rate is not None:
        bounds = composition.response_time_bounds(problem.arrival_rate)
        output["response_time_bounds"] = [json_number(bound) for bound in bounds]
    return output


def _tuned(problem: PlanProblem, objective: str) -> Composition:
    """c* for "c": "auto" (SPEC 3.4), with the chains composed for it."""
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


def _fixed_capacity(problem: PlanProblem) -> int:
    if not isinstance(problem.capacity, int):
        raise PlanInputError('c: missing (a positive integer, or "auto" with arrival_rate)')
    return problem.capacity


# -- route ---------------------------------------------------------------------------------------


def route_ws_rr(text: str | bytes) -> dict[str, Any]:
    routing = parse_routing(text)
    problem = routing.problem
    require_server_fields(problem, ["tau", "tau_prefill"], "ws-rr")
    state = RoutingState(problem.servers, problem.model, routing.placement)
    for server, sessions in routing.active.items():
        for k, (remaining, slots) in enumerate(sessions):
            state.add_session(("active", server, k), {server: slots}, ends_at=remaining)  # now = 0
    route = state.route(routing.client, routing.l_out, now=0.0)
    if route is None:
        raise _no_route(routing, needs_prefill_rtt=True)
    return {"chain": chain_json(problem.servers, route.chain.hops), "cost": route.cost, "wait": route.wait}


def route_petals(text: str | bytes) -> dict[str, Any]:
    routing = parse_routing(text)
    problem = routing.problem
    require_server_fields(problem, [("tau", "inference_rps")], "petals routing")
    used = [sum(slots for _, slots in routing.active.get(j, ())) for j in range(len(problem.servers))]
    chain = petals.route(problem.servers, problem.model, routing.placement, routing.client, used)
    if chain is None:
        raise _no_route(routing, needs_prefill_rtt=False)
    return {"chain": chain_json(problem.servers, chain.hops), "cost": chain.cost, "wait": 0.0}


def _no_route(routing: RoutingProblem, needs_prefill_rtt: bool) -> Infeasible:
    """Why no chain exists: blocks no reachable server holds, or (none uncovered) caches that never fit."""
    client = routing.client
    reachable = [
        span if client in server.rtt and (client in server.rtt_prefill or not needs_prefill_rtt) else None
        for server, span in zip(routing.problem.servers, routing.placement, strict=True)
    ]
    uncovered = uncovered_blocks(reachable, routing.problem.model.num_blocks)
    if uncovered:
        return Infeasible(f"no server reachable from client {client!r} holds some blocks", uncovered)
    return Infeasible(f"no chain can ever hold this request's cache for client {client!r}", [])
