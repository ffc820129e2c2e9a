"""`swarm-plan`: block placement, routing and chain composition from the command line (SPEC section 4).

JSON in on stdin, JSON out on stdout. Exit status 0 on success, 2 for invalid input (one line on
stderr), 3 when the swarm cannot serve the model (a JSON error naming the uncovered blocks).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
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
    dumps,
    json_number,
    parse_problem,
    parse_routing,
    placement_json,
    require_server_fields,
)

EXIT_INVALID_INPUT = 2
EXIT_INFEASIBLE = 3

_PROBLEM_EXAMPLE = """\
problem.json (seconds, bytes; spans are 0-based [start, end)):
  {"model": {"num_blocks": 70, "block_bytes": 1323397667, "cache_bytes": 8486912},
   "servers": [{"name": "mig1", "memory_bytes": 9.1e9, "tau": 0.0162488, "tau_prefill": 0.0512,
                "rtt": {"c1": 0.055}, "rtt_prefill": {"c1": 0.060}}],
   "num_requests": 66}
"""

_DESCRIPTION = f"""\
Plan a swarm: place blocks on servers, route a request, or compose server chains.

examples:
  swarm-plan place --algo cg-bp < problem.json
  swarm-plan route --algo ws-rr < routing.json
  swarm-plan compose < problem.json

{_PROBLEM_EXAMPLE}
exit status: 0 ok; 2 invalid input (message on stderr); 3 infeasible
(stdout: {{"error": ..., "uncovered_blocks": [...]}}).
"""

_PLACE_HELP = f"""\
Place blocks on the servers of problem.json (read from stdin).

  cg-bp   CG-BP (SPEC 3.1). Servers need tau and rtt. R is "num_requests"; or give
          "arrival_rate" and "l_out" (servers then also need tau_prefill and rtt_prefill) and R is
          round(mean + std) of the arrivals during one request, capped by eq. 19.
          Output: {{"placement", "num_requests", "bound" (eq. 17, s/token), "order"}}.
  petals  the PETALS baseline (SPEC 3.3). Needs model "hidden_size" (optional "kv_dim", default
          hidden_size; "dtype_bytes", default 2); servers need tau, or "forward_rps" (default 1/tau)
          and optionally "network_rps" (default unlimited). Output: {{"placement", "order"}}.
  gbp-cr  GBP-CR (SPEC 3.4). Servers need tau_c and tau_p; the problem needs "c" (or "c": "auto"
          with "arrival_rate"); optional "rho_bar" (default 0.7). Output: {{"placement", "c", "order"}}.

example:
  echo '{{"model": {{"num_blocks": 4, "block_bytes": 1e9, "cache_bytes": 1e7}},
        "servers": [{{"name": "a", "memory_bytes": 8e9, "tau": 0.01, "rtt": {{"c1": 0.05}}}}],
        "num_requests": 10}}' | swarm-plan place --algo cg-bp

{_PROBLEM_EXAMPLE}"""

_ROUTE_HELP = """\
Route one request (routing.json on stdin: a problem.json plus "placement" as output by place,
"client", "l_in", "l_out" and "active": {"server name": [[remaining_seconds, slots], ...]}).

  ws-rr   WS-RR (SPEC 3.2): shortest path with link cost wait (eq. 20) + l_out * t^c (eq. 8).
          Servers need tau, tau_prefill, and rtt/rtt_prefill to the client.
  petals  PETALS' router (SPEC 3.3): per hop rtt/2 + 0.018 s + blocks/inference_rps (default
          tau), +10 s where PETALS' fixed cache has no room. "cost" is PETALS' weight; "wait" is 0.

output: {"chain": [{"name", "start", "end"} (blocks that server processes)], "cost", "wait"}

example:
  echo '{"model": {"num_blocks": 4, "block_bytes": 1e9, "cache_bytes": 1e7},
        "servers": [{"name": "a", "memory_bytes": 8e9, "tau": 0.01, "tau_prefill": 0.02,
                     "rtt": {"c1": 0.05}, "rtt_prefill": {"c1": 0.06}}],
        "placement": [{"name": "a", "start": 0, "end": 4}],
        "client": "c1", "l_in": 20, "l_out": 64, "active": {"a": [[3.5, 4]]}}' \\
    | swarm-plan route --algo ws-rr
"""

_COMPOSE_HELP = """\
GBP-CR placement + GCA cache allocation (SPEC 3.4) for problem.json on stdin. Servers need tau_c
(communication time per request) and tau_p (computation time per block per request). The problem
needs "c", or "c": "auto" with "arrival_rate" to pick c* in [1, c_max] by --c-objective; optional
"rho_bar" (default 0.7). With an arrival rate, GBP-CR stops once the chains reach
lambda/(rho_bar*c) and the output has Theorem 3.7's bounds on JFFC's mean response time (null if
the load is unstable).

output: {"c", "chains": [{"servers", "blocks", "capacity", "service_time"}], "service_rate",
         "response_time_bounds": [lower, upper]}

example:
  echo '{"model": {"num_blocks": 3, "block_bytes": 1, "cache_bytes": 0.1},
        "servers": [{"name": "j1", "memory_bytes": 2, "tau_c": 1, "tau_p": 0.001},
                    {"name": "j2", "memory_bytes": 3, "tau_c": 2, "tau_p": 0.002},
                    {"name": "j3", "memory_bytes": 2, "tau_c": 1, "tau_p": 0.003}],
        "c": 1, "arrival_rate": 0.5}' | swarm-plan compose
"""


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


# -- command line --------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="swarm-plan", description=_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="{place,route,compose}")

    place = commands.add_parser(
        "place",
        help="place blocks",
        description=_PLACE_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    place.add_argument("--algo", required=True, choices=["cg-bp", "petals", "gbp-cr"])
    handlers = {"cg-bp": place_cg_bp, "petals": place_petals, "gbp-cr": place_gbp_cr}
    place.set_defaults(run=lambda args, text: handlers[args.algo](parse_problem(text)))

    route = commands.add_parser(
        "route",
        help="route one request",
        description=_ROUTE_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    route.add_argument("--algo", required=True, choices=["ws-rr", "petals"])
    routers = {"ws-rr": route_ws_rr, "petals": route_petals}
    route.set_defaults(run=lambda args, text: routers[args.algo](text))

    compose_parser = commands.add_parser(
        "compose",
        help="GBP-CR + GCA chain composition",
        description=_COMPOSE_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    compose_parser.add_argument(
        "--c-objective",
        choices=["lower-bound", "surrogate"],
        default="lower-bound",
        help='with "c": "auto": minimize Theorem 3.7\'s lower bound (default) or c*K(c) (eq. 14)',
    )
    compose_parser.set_defaults(run=lambda args, text: compose_chains(parse_problem(text), args.c_objective))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    run: Callable[[argparse.Namespace, bytes], dict[str, Any]] = args.run
    try:
        output = run(args, sys.stdin.buffer.read())  # bytes: json.loads detects the encoding
    except PlanInputError as error:
        print(f"swarm-plan: invalid input: {error}", file=sys.stderr)
        return EXIT_INVALID_INPUT
    except Infeasible as error:
        print(dumps({"error": str(error), "uncovered_blocks": error.uncovered}))
        return EXIT_INFEASIBLE
    print(dumps(output))
    return 0


if __name__ == "__main__":
    sys.exit(main())
