"""The scheduler's role planner against colocated serving and operator-chosen roles.

    .venv/bin/python -m benchmarks.scheduling.role_planning [--seeds 3] [--requests 100] [--write]

For each swarm, link rate and SLO pair, `scheduler.algorithms.role_split.plan_roles` chooses roles
(prefill / both per server) with its own small goodput search in the contended simulator
(`scheduler.sim.role_planning`, 1 seed, 60 requests per run, the search `swarm-plan goodput
--link-mbps` and `swarm-scheduler --roles auto` run, here on each case's own arrivals); then every
configuration's goodput is measured side by side with a larger search (`--seeds` runs per probed
rate, `--requests` requests per run at least, 200 s of arrivals, no pruning), the same arrivals for
all:

- `hetero` (`scheduler.sim.hetero`: 2 A100s, 6 older 24 GB cards; Azure code lengths capped at
  2048 + 128, as BENCHMARKS.md's "A simulator of contended servers" section (b)): colocated,
  the operator's roles of that section (A100s prefill, the rest decode) and the planner's choice;
- `split` (`role_planning.split_swarm`: 4 compute-rich, bandwidth-poor and 4 bandwidth-rich,
  compute-poor 80 GB GPUs; Poisson arrivals of 2048-token prompts and 64-token answers): a swarm
  built so that roles should pay, for an honest test of the 1.3x target; operator roles there are
  the compute-rich GPUs prefill.

Target: where links allow it, roles give >= 1.3x colocated goodput; where they do not,
the planner keeps colocated serving and goodput is not lower than colocated.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

import numpy as np

from benchmarks.common import bench_parser, parse_positive, rerun_command, write_timed_section
from benchmarks.markdown import ROOT
from llm_swarm.scheduler.sim import hetero, workload
from llm_swarm.scheduler.sim.contended_roles import parse_roles, uniform_links
from llm_swarm.scheduler.sim.metrics import Slo
from llm_swarm.scheduler.sim.role_planning import (
    GoodputOfRoles,
    RoleSearch,
    plan_scenario_roles,
    roles_text,
    split_swarm,
)

HEADER = "## The scheduler places prefill/decode roles"


def hetero_case(link_mbps: float):
    scenario = hetero.hetero(2048, 128)
    links = uniform_links(len(scenario.servers), 0.010, link_mbps * 1e6)
    scenario = dataclasses.replace(scenario, server_links=links)
    records = workload.load_azure_trace()

    def requests(minimum: int):
        def make(rate: float, seed: int):
            count = max(minimum, round(200 * rate))
            rng = np.random.default_rng(seed)
            return hetero.poisson_trace_lengths(rate, count, records, 2048, 128, rng)

        return make

    return scenario, "prefill*2,decode*6", requests


def split_case(link_mbps: float):
    scenario = split_swarm(2048, 64, link_mbps)

    def requests(minimum: int):
        def make(rate: float, seed: int):
            count = max(minimum, round(200 * rate))
            return workload.poisson(rate, count, 2048, 64, np.random.default_rng(seed))

        return make

    return scenario, "prefill*4,both*4", requests


CASES = (
    ("hetero", hetero_case, (1000.0, 20.0), ((10.0, 0.3), (20.0, 0.3))),
    ("split", split_case, (10000.0, 1000.0, 20.0), ((10.0, 0.2), (5.0, 0.2))),
)


def run(seeds: int, requests: int) -> list[str]:
    lines = [
        "| swarm | links | SLOs: TTFT, TPOT (s) | planner's choice (plan time) | colocated (req/s) "
        "| operator roles | planner | planner vs colocated | target |",
        "|---|---|---|---|---:|---:|---:|---:|---|",
    ]
    for name, case, link_rates, slos in CASES:
        for link_mbps in link_rates:
            scenario, operator, make = case(link_mbps)
            for ttft, tpot in slos:
                slo = Slo(ttft, tpot)
                started = time.perf_counter()
                plan, planning = plan_scenario_roles(scenario, slo, RoleSearch(), make(60))
                plan_s = time.perf_counter() - started
                check = GoodputOfRoles(
                    scenario, slo, RoleSearch(seeds=seeds, bisections=4), make(requests), prune=False
                )
                colocated = check(("both",) * len(scenario.servers))
                by_operator = check(tuple(str(r) for r in parse_roles(operator, len(scenario.servers))))
                chosen = check(plan.roles)
                ratio = chosen / colocated if colocated > 0 else float("inf") if chosen > 0 else 1.0
                if plan.colocated:
                    verdict = "kept colocated: met" if chosen >= colocated else "kept colocated: MISSED"
                else:
                    verdict = "roles >= 1.3x: met" if ratio >= 1.3 else "roles >= 1.3x: MISSED"
                link = f"{link_mbps / 1000:g} Gbit/s" if link_mbps >= 1000 else f"{link_mbps:g} Mbit/s"
                choice = "colocated" if plan.colocated else roles_text(plan.roles)
                lines.append(
                    f"| {name} | {link} | {ttft:g}, {tpot:g} | {choice} ({plan_s:.1f} s, "
                    f"{planning.simulations} runs) | {colocated:.3f} | {by_operator:.3f} ({operator}) "
                    f"| {chosen:.3f} | {ratio:.2f}x | {verdict} |"
                )
                print(lines[-1], flush=True)
    return lines


def main() -> int:
    parser = bench_parser(__doc__)
    parser.add_argument("--seeds", type=int, default=3, help="runs averaged per probed rate (the check)")
    parser.add_argument("--requests", type=int, default=100, help="requests per run at least (the check)")
    parser.add_argument("--write", action="store_true", help="write the table into BENCHMARKS.md")
    args = parse_positive(parser, "seeds", "requests")
    started = time.perf_counter()
    lines = run(args.seeds, args.requests)
    wall = time.perf_counter() - started
    print(f"{wall:.0f} s")
    if args.write:
        command = rerun_command(__file__, argparse.Namespace(seeds=args.seeds, requests=args.requests))
        parts = [__doc__.split("\n\n", 2)[2].strip(), "\n".join(lines)]
        write_timed_section(HEADER, command, wall, parts, ROOT / "results/role_planning_notes.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
