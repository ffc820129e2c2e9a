"""The `swarm-plan` commands as pure functions: parsed problem in, output document out
(docs/reference.md section 4).

`scheduler.plan.cli` wraps them with stdin/stdout and exit codes. The algorithms are reached through
`scheduler.algorithms.placing`, typed, which the scheduler service calls too: a placement it
publishes is exactly what `swarm-plan place` computes from the problem document it records.
"""

from __future__ import annotations

from typing import Any

from llm_swarm.scheduler.algorithms import petals
from llm_swarm.scheduler.algorithms.placing import (
    PLACEMENTS,
    Infeasible,
    PlacedServers,
    PlanProblem,
    fixed_capacity,
    require_server_fields,
    tuned_composition,
)
from llm_swarm.scheduler.algorithms.problem import uncovered_blocks
from llm_swarm.scheduler.algorithms.tuning import compose
from llm_swarm.scheduler.algorithms.wsrr import RoutingState
from llm_swarm.scheduler.plan.problem_io import (
    RoutingProblem,
    chain_json,
    json_number,
    parse_routing,
    placement_json,
)

__all__ = ["Infeasible", "compose_chains", "place", "placement_output", "route_petals", "route_ws_rr"]


# -- place ---------------------------------------------------------------------------------------


def placement_output(problem: PlanProblem, placed: PlacedServers) -> dict[str, Any]:
    """`swarm-plan place`'s output document (docs/reference.md 4) for a computed placement."""
    output: dict[str, Any] = {"placement": placement_json(problem.servers, placed.spans)}
    if placed.num_requests is not None:
        output["num_requests"] = placed.num_requests
        output["bound"] = placed.bound
    if placed.capacity is not None:
        output["c"] = placed.capacity
    output["order"] = [problem.servers[j].name for j in placed.order]
    return output


def place(problem: PlanProblem, algo: str) -> dict[str, Any]:
    """`swarm-plan place --algo ALGO` on a parsed problem."""
    return placement_output(problem, PLACEMENTS[algo](problem))


# -- compose -------------------------------------------------------------------------------------


def compose_chains(problem: PlanProblem, objective: str) -> dict[str, Any]:
    require_server_fields(problem, ["tau_c", "tau_p"], "compose")
    if problem.capacity == "auto":
        composition = tuned_composition(problem, objective)
    else:
        composition = compose(
            problem.servers, problem.model, fixed_capacity(problem), problem.arrival_rate, problem.rho_bar
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
