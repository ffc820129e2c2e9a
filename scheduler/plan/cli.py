"""`swarm-plan`: block placement, routing and chain composition from the command line
(docs/reference.md section 4).

JSON in on stdin, JSON out on stdout. Exit status 0 on success, 2 for invalid input (one line on
stderr), 3 when the swarm cannot serve the model (a JSON error naming the uncovered blocks).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

from llm_swarm.scheduler.algorithms.placing import PLACEMENTS, Infeasible, PlanInputError
from llm_swarm.scheduler.plan import goodput as goodput_command
from llm_swarm.scheduler.plan.commands import compose_chains, place, route_petals, route_ws_rr
from llm_swarm.scheduler.plan.problem_io import dumps, parse_problem
from llm_swarm.scheduler.plan.subcommand import add_subcommand

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
  swarm-plan goodput --scenario clustered --slo-ttft 5x --slo-tpot 1.5x

{_PROBLEM_EXAMPLE}
exit status: 0 ok; 2 invalid input (message on stderr); 3 infeasible
(stdout: {{"error": ..., "uncovered_blocks": [...]}}).
"""

_PLACE_HELP = f"""\
Place blocks on the servers of problem.json (read from stdin).

  cg-bp   CG-BP (docs/reference.md 3.1). Servers need tau and rtt. R is "num_requests"; or give
          "arrival_rate" and "l_out" (servers then also need tau_prefill and rtt_prefill) and R is
          round(mean + std) of the arrivals during one request, capped by eq. 19.
          Output: {{"placement", "num_requests", "bound" (eq. 17, s/token), "order"}}.
  petals  the PETALS baseline (docs/reference.md 3.3). Needs model "hidden_size" (optional
          "kv_dim", default hidden_size; "dtype_bytes", default 2); servers need tau, or
          "forward_rps" (default 1/tau) and optionally "network_rps" (default unlimited).
          Output: {{"placement", "order"}}.
  gbp-cr  GBP-CR (docs/reference.md 3.4). Servers need tau_c and tau_p; the problem needs "c" (or
          "c": "auto" with "arrival_rate"); optional "rho_bar" (default 0.7).
          Output: {{"placement", "c", "order"}}.

example:
  echo '{{"model": {{"num_blocks": 4, "block_bytes": 1e9, "cache_bytes": 1e7}},
        "servers": [{{"name": "a", "memory_bytes": 8e9, "tau": 0.01, "rtt": {{"c1": 0.05}}}}],
        "num_requests": 10}}' | swarm-plan place --algo cg-bp

{_PROBLEM_EXAMPLE}"""

_ROUTE_HELP = """\
Route one request (routing.json on stdin: a problem.json plus "placement" as output by place,
"client", "l_in", "l_out" and "active": {"server name": [[remaining_seconds, slots], ...]}).

  ws-rr   WS-RR (docs/reference.md 3.2): shortest path with link cost wait (eq. 20) +
          l_out * t^c (eq. 8). Servers need tau, tau_prefill, and rtt/rtt_prefill to the client.
  petals  PETALS' router (docs/reference.md 3.3): per hop rtt/2 + 0.018 s +
          blocks/inference_rps (default tau), +10 s where PETALS' fixed cache has no room.
          "cost" is PETALS' weight; "wait" is 0.

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
GBP-CR placement + GCA cache allocation (docs/reference.md 3.4) for problem.json on stdin.
Servers need tau_c (communication time per request) and tau_p (computation time per block per
request). The problem needs "c", or "c": "auto" with "arrival_rate" to pick c* in [1, c_max] by
--c-objective; optional "rho_bar" (default 0.7). With an arrival rate, GBP-CR stops once the
chains reach lambda/(rho_bar*c) and the output has Theorem 3.7's bounds on JFFC's mean response
time (null if the load is unstable).

output: {"c", "chains": [{"servers", "blocks", "capacity", "service_time"}], "service_rate",
         "response_time_bounds": [lower, upper]}

example:
  echo '{"model": {"num_blocks": 3, "block_bytes": 1, "cache_bytes": 0.1},
        "servers": [{"name": "j1", "memory_bytes": 2, "tau_c": 1, "tau_p": 0.001},
                    {"name": "j2", "memory_bytes": 3, "tau_c": 2, "tau_p": 0.002},
                    {"name": "j3", "memory_bytes": 2, "tau_c": 1, "tau_p": 0.003}],
        "c": 1, "arrival_rate": 0.5}' | swarm-plan compose
"""


# -- command line --------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        fromfile_prefix_chars="@",  # arguments from a file: swarm-... @args.txt
        prog="swarm-plan",
        description=_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="{place,route,compose,goodput}")

    place_parser = add_subcommand(commands, "place", "place blocks", _PLACE_HELP)
    place_parser.add_argument("--algo", required=True, choices=list(PLACEMENTS))
    place_parser.set_defaults(run=lambda args, text: place(parse_problem(text), args.algo))

    route = add_subcommand(commands, "route", "route one request", _ROUTE_HELP)
    route.add_argument("--algo", required=True, choices=["ws-rr", "petals"])
    routers = {"ws-rr": route_ws_rr, "petals": route_petals}
    route.set_defaults(run=lambda args, text: routers[args.algo](text))

    compose_parser = add_subcommand(commands, "compose", "GBP-CR + GCA chain composition", _COMPOSE_HELP)
    compose_parser.add_argument(
        "--c-objective",
        choices=["lower-bound", "surrogate"],
        default="lower-bound",
        help='with "c": "auto": minimize Theorem 3.7\'s lower bound (default) or c*K(c) (eq. 14)',
    )
    compose_parser.set_defaults(run=lambda args, text: compose_chains(parse_problem(text), args.c_objective))
    goodput_command.add_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    run: Callable[[argparse.Namespace, bytes], dict[str, Any]] = args.run
    try:
        # bytes: json.loads detects the encoding; `goodput --scenario` reads nothing
        reads_stdin = getattr(args, "reads_stdin", lambda _: True)(args)
        output = run(args, sys.stdin.buffer.read() if reads_stdin else b"")
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
