"""`swarm-plan goodput`: the placement policy and parameter with the highest simulated goodput under
SLOs, and how many more servers the SLOs need at a higher rate (the search is
`scheduler.sim.goodput_plan`, this module reads the arguments and writes the JSON document).

The swarm is a named scenario (`--scenario`) or, without one, a `swarm-plan` problem document on
stdin, e.g. the `plan_input` the scheduler publishes in its status.
"""

from __future__ import annotations

import argparse
import math
import re
from typing import Any

from llm_swarm.scheduler.algorithms.placing import Infeasible, PlanInputError
from llm_swarm.scheduler.plan.problem_io import json_number, parse_problem, placement_json
from llm_swarm.scheduler.plan.subcommand import add_subcommand
from llm_swarm.scheduler.sim.discrete_events import SimulationError
from llm_swarm.scheduler.sim.goodput_plan import (
    CandidateError,
    CandidateResult,
    GoodputPlan,
    SearchSettings,
    idle_latency,
    plan_goodput,
    servers_to_add,
)
from llm_swarm.scheduler.sim.metrics import Slo
from llm_swarm.scheduler.sim.monte_carlo import SCENARIOS
from llm_swarm.scheduler.sim.planning_swarm import named_swarm, problem_swarm, with_added_servers
from llm_swarm.scheduler.sim.policies import NONE, PAPER000
from llm_swarm.scheduler.sim.role_planning import roles_document
from llm_swarm.scheduler.sim.scenarios import Scenario
from llm_swarm.swarm.cli.dataclass_args import add_field_options

HELP = """\
Search the placement policy and its parameter (the PETALS baseline; CG-BP + WS-RR with R chosen
from the rate or fixed; GBP-CR + GCA + JFFC "chains" with c tuned or fixed) by simulated goodput:
the highest Poisson arrival rate at which >= 90% of requests meet both SLOs (DistServe's
definition, docs/reference.md 6). Prints the best plan, its goodput, every candidate's goodput
and the search time as JSON.

The swarm: --scenario NAME (swarm-sim's scenarios; random deployments drawn from --scenario-seed),
or, without --scenario, a swarm-plan problem document on stdin (servers need tau, tau_prefill and
an rtt to the client; the scheduler's status publishes one as plan_input). SLOs are seconds, or
Nx: N times what a lone request gets in the idle swarm (e.g. --slo-ttft 5x --slo-tpot 1.5x).

--rate is the measured arrival rate (default: the problem's arrival_rate): every candidate's SLO
attainment at it is reported and the best plan's placement is made for it.
--servers-to-add KIND --at-rate R: the fewest more servers of KIND (a GPU kind of the scenario,
e.g. A100, or the name of a server to copy) with which some plan meets the SLOs at rate R.
--link-mbps M (every two servers joined at M Mbit/s) with --roles auto (the default): the role
planner's choice of prefill servers (swarm-scheduler --roles auto's), its goodput and colocated
serving's in the contended simulator (cg-bp), under "roles"; without links no roles are planned.

examples:
  swarm-plan goodput --scenario clustered --slo-ttft 5x --slo-tpot 1.5x
  swarm-plan goodput --scenario ripe --l-in 2048 --slo-ttft 1.5 --slo-tpot 0.09 \\
      --servers-to-add MIG-3g.40gb --at-rate 16
  swarm-plan goodput --slo-ttft 10 --slo-tpot 0.5 --rate 0.8 < plan_input.json
  swarm-plan goodput --scenario hetero --l-in 2048 --l-out 128 --slo-ttft 10 --slo-tpot 0.3 \\
      --link-mbps 1000   # also: prefill/decode roles against colocated serving ("roles")
"""

_SLO = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*(x?)\s*$")


def slo_value(text: str) -> tuple[float, bool]:
    """`"1.5"` -> (1.5 s, absolute); `"5x"` -> (5, a multiple of the idle value)."""
    match = _SLO.match(text)
    if match is None or not float(match.group(1)) > 0:
        raise argparse.ArgumentTypeError(
            f"must be positive seconds or a positive multiple like 5x, got {text!r}"
        )
    return float(match.group(1)), bool(match.group(2))


def add_parser(commands) -> None:
    """The `goodput` subcommand of `swarm-plan`."""
    parser = add_subcommand(
        commands, "goodput", "choose policy and parameter by simulated goodput under SLOs", HELP
    )
    parser.add_argument(
        "--scenario", choices=SCENARIOS, help="a named scenario (default: problem.json on stdin)"
    )
    parser.add_argument("--client-cluster", type=int, choices=(0, 1, 2), default=0, help="clustered only")
    parser.add_argument(
        "--scenario-seed", type=int, default=0, help="draws random deployments (ripe, topologies)"
    )
    parser.add_argument("--client", help="problem.json: the client to plan for (default: the farthest)")
    parser.add_argument("--l-in", type=int, default=20, help="prompt tokens per request (named scenarios)")
    parser.add_argument(
        "--l-out", type=int, help="generated tokens per request (default: the problem's, or 128)"
    )
    parser.add_argument("--slo-ttft", type=slo_value, help="TTFT target: seconds, or Nx the idle TTFT")
    parser.add_argument("--slo-tpot", type=slo_value, help="TPOT target: seconds, or Nx the idle TPOT")
    parser.add_argument("--rate", type=float, help="the measured arrival rate, requests/s")
    # the search's defaults are SearchSettings', so the command line and code that plans agree
    add_field_options(
        parser,
        SearchSettings,
        {
            "--seeds": "Monte Carlo runs averaged per probed rate",
            "--bisections": "halvings of each goodput's bracket (resolution 2^-N)",
            "--refine-rounds": "bisections of R and c around each family's best",
        },
    )
    parser.add_argument(
        "--setup",
        choices=("none", "paper"),
        default="none",
        help="session set-up delays (Sun et al.'s, or none)",
    )
    parser.add_argument(
        "--servers-to-add", metavar="KIND", help="how many more servers of KIND the SLOs need"
    )
    parser.add_argument("--at-rate", type=float, help="... to be met at this arrival rate")
    parser.add_argument("--max-servers-to-add", type=int, default=32, help="give up beyond this many")
    parser.add_argument(
        "--roles",
        choices=("auto", "off"),
        default="auto",
        help="auto: with --link-mbps, also plan prefill/decode roles (scheduler.algorithms.role_split, "
        'scored by the contended simulator) and report them beside colocated serving under "roles"',
    )
    parser.add_argument(
        "--link-mbps", type=float, help="bandwidth between every two servers (needed for --roles auto)"
    )
    parser.add_argument("--link-rtt-ms", type=float, default=10.0, help="round trip between two servers")
    parser.set_defaults(run=run, reads_stdin=lambda args: args.scenario is None)


def run(args: argparse.Namespace, text: bytes) -> dict[str, Any]:
    """The subcommand on parsed arguments (and stdin's problem when there is no --scenario)."""
    _check(args)
    try:
        scenario, rate = _swarm(args, text)
        if args.servers_to_add is not None:
            with_added_servers(scenario, args.servers_to_add, 0)  # an unknown kind fails before the search
        settings = SearchSettings(
            seeds=args.seeds,
            bisections=args.bisections,
            refine_rounds=args.refine_rounds,
            setup=PAPER000 if args.setup == "paper" else NONE,
        )
        idle = idle_latency(scenario, settings.setup)
        slo = Slo(_target(args.slo_ttft, idle.ttft), _target(args.slo_tpot, idle.tpot))
        plan = plan_goodput(scenario, slo, rate, settings)
        output = plan_document(plan, scenario, slo, rate)
        if args.roles == "auto" and args.link_mbps is not None:
            output["roles"] = roles_document(scenario, slo, args.link_mbps, args.link_rtt_ms)
        if args.servers_to_add is not None:
            added = servers_to_add(
                scenario,
                args.servers_to_add,
                args.at_rate,
                slo,
                settings,
                cap=args.max_servers_to_add,
                first=[plan.best.candidate],
            )
            output["servers_to_add"] = {
                "kind": added.kind,
                "rate": added.rate,
                "count": added.count,
                "max": added.cap,
                "plan": added.candidate.label if added.candidate else None,
                "scheduler_flags": added.candidate.scheduler_flags() if added.candidate else None,
                "attainment": added.attainment,
                "tried": [{"count": count, "met": met} for count, met in added.tried],
                "placement": placement_json(added.scenario.servers, added.placement)
                if added.scenario
                else None,
            }
    except CandidateError as error:
        raise Infeasible(str(error), []) from None
    except (ValueError, SimulationError) as error:  # PlanInputError is a ValueError too
        if isinstance(error, PlanInputError):
            raise
        raise PlanInputError(str(error)) from None
    return output


def _check(args: argparse.Namespace) -> None:
    if args.slo_ttft is None and args.slo_tpot is None:
        raise PlanInputError("give --slo-ttft and/or --slo-tpot")
    for name in ("rate", "at_rate"):
        value = getattr(args, name)
        if value is not None and not (math.isfinite(value) and value > 0):
            raise PlanInputError(f"--{name.replace('_', '-')} must be a positive number of requests/s")
    if args.link_mbps is not None and not (math.isfinite(args.link_mbps) and args.link_mbps > 0):
        raise PlanInputError("--link-mbps must be a positive number of Mbit/s")
    if not (math.isfinite(args.link_rtt_ms) and args.link_rtt_ms >= 0):
        raise PlanInputError("--link-rtt-ms must be >= 0")
    if (args.servers_to_add is None) != (args.at_rate is None):
        raise PlanInputError("--servers-to-add and --at-rate go together")
    if args.seeds < 1 or args.l_in < 1 or (args.l_out is not None and args.l_out < 1):
        raise PlanInputError("--seeds, --l-in and --l-out must be at least 1")
    if min(args.max_servers_to_add, args.bisections, args.refine_rounds) < 0:
        raise PlanInputError("--max-servers-to-add, --bisections and --refine-rounds must be >= 0")


def _swarm(args: argparse.Namespace, text: bytes) -> tuple[Scenario, float | None]:
    if args.scenario is not None:
        if args.client is not None:
            raise PlanInputError("--client is for problem.json on stdin; scenarios have one client")
        scenario = named_swarm(
            args.scenario,
            client_cluster=args.client_cluster,
            l_in=args.l_in,
            l_out=args.l_out or 128,
            seed=args.scenario_seed,
        )
        return scenario, args.rate
    problem = parse_problem(text)
    scenario = problem_swarm(problem, client=args.client, l_in=args.l_in, l_out=args.l_out)
    return scenario, args.rate if args.rate is not None else problem.arrival_rate


def _target(value: tuple[float, bool] | None, idle: float) -> float | None:
    if value is None:
        return None
    amount, relative = value
    return amount * idle if relative else amount


def candidate_document(result: CandidateResult) -> dict[str, Any]:
    search = result.search
    document: dict[str, Any] = {
        "plan": result.candidate.label,
        "policy": result.candidate.policy,
        "parameter": result.candidate.parameter,
        "goodput": result.goodput if search is not None else None,
        "attainment_at_rate": result.attainment_at_rate,
    }
    if search is None:
        document["error"] = result.error
        return document
    document["probes"] = [[rate, attained] for rate, attained in search.probes]
    if result.bounded:  # runs stopped once the target was out of reach: these attainments are upper bounds
        document["upper_bounds_at"] = list(result.bounded)
    if search.capped:
        document["capped"] = True  # met the target at the highest rate probed: goodput is at least this
    if search.pruned:
        document["pruned"] = True  # stopped once it could not win: goodput is a lower bound
    return document


def plan_document(plan: GoodputPlan, scenario: Scenario, slo: Slo, rate: float | None) -> dict[str, Any]:
    best = plan.best
    defaults = {r.candidate.policy: r.goodput for r in plan.results if r.candidate.default and r.search}
    return {
        "swarm": scenario.name,
        "servers": len(scenario.servers),
        "l_in": scenario.l_in,
        "l_out": scenario.l_out,
        "slo": {"ttft": slo.ttft_s, "tpot": slo.tpot_s},
        "idle": {"ttft": plan.idle.ttft, "tpot": plan.idle.tpot, "total": plan.idle.total},
        "rate": rate,
        "best": {
            "plan": best.candidate.label,
            "policy": best.candidate.policy,
            "parameter": best.candidate.parameter,
            "goodput": best.goodput,
            "attainment_at_rate": best.attainment_at_rate,
            "scheduler_flags": best.candidate.scheduler_flags(),
            "placement": placement_json(scenario.servers, plan.placement),
        },
        "default_policies": defaults,
        "gain_over_best_default": json_number(best.goodput / max(defaults.values()))
        if defaults and max(defaults.values()) > 0
        else None,
        "candidates": [candidate_document(r) for r in plan.results],
        "start_rate": plan.start_rate,
        "simulations": plan.simulations,
        "search_s": round(plan.search_s, 3),
    }
