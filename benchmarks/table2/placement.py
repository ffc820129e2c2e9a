"""Each policy's placement of the paper's 70 blocks, through `swarm-plan place` (the CLI a user
runs), and the cache slots each server then has on the paper's GPUs."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

from benchmarks.netem.scenario import Scenario
from llm_swarm.scheduler.algorithms import petals
from llm_swarm.scheduler.algorithms.cgbp import choose_num_requests
from llm_swarm.scheduler.algorithms.chains import request_times
from llm_swarm.scheduler.algorithms.problem import ModelSpec, ServerSpec, Span, cache_slots
from llm_swarm.scheduler.plan.problem_io import dumps, parse_problem
from llm_swarm.scheduler.sim.discrete_events import CLIENT

from .inputs import ServerPlan, TinyCosts

PLANNING_OVERHEAD_S = 0.004  # per-hop software overhead assumed when placing (measured later)


def problem_document(
    plans: list[ServerPlan],
    model: ModelSpec,
    scenario: Scenario,
    client_site: str,
    scale: float,
    tiny: TinyCosts,
) -> dict:
    """problem.json (docs/reference.md 4) at the paper's memory scale with the emulation's times."""
    servers = []
    for plan in plans:
        rtt = scenario.link(client_site, plan.site).rtt_ms / 1e3 + PLANNING_OVERHEAD_S
        servers.append(
            {
                "name": plan.name,
                "memory_bytes": plan.memory_paper,
                "tau": tiny.tau_cpu + plan.compute_delay,
                "tau_prefill": tiny.tau_prefill_cpu + plan.compute_delay,
                "rtt": {CLIENT: rtt},
                "rtt_prefill": {CLIENT: rtt},
            }
        )
    return {"model": dataclasses.asdict(model), "servers": servers}


def swarm_plan(algo: str, document: dict) -> tuple[int, dict]:
    """`swarm-plan place --algo ALGO` on `document` (the CLI itself: the same path a user takes)."""
    result = subprocess.run(
        [sys.executable, "-m", "llm_swarm.scheduler.plan.cli", "place", "--algo", algo],
        input=json.dumps(document),
        capture_output=True,
        text=True,
    )
    return result.returncode, json.loads(result.stdout) if result.stdout.strip() else {"error": result.stderr}


def with_chain_times(document: dict, l_out: int) -> dict:
    """Sun, He and Hou's per-request times on every server, so that a chain's eq. 2 time is eq. 1's."""
    servers = []
    for server in document["servers"]:
        (rtt,), (rtt_prefill,) = server["rtt"].values(), server["rtt_prefill"].values()
        tau_c, tau_p = request_times(rtt_prefill, rtt, server["tau_prefill"], server["tau"], l_out)
        servers.append({**server, "tau_c": tau_c, "tau_p": tau_p})
    return {**document, "servers": servers}


def place(
    policy: str, document: dict, model: ModelSpec, rate: float, l_out: int, parameter: int | None = None
) -> dict:
    """`policy`'s placement for `rate`: R (cg-bp) or c (chains) chosen from the rate as the scheduler
    does, or fixed to `parameter` (a plan of `swarm-plan goodput`: placed as given, or an error)."""
    if policy in ("petals", "chains"):
        algo, problem = "petals", document
        if policy == "chains":  # GBP-CR with c tuned for this rate (Theorem 3.7's lower bound), or fixed
            capacity = "auto" if parameter is None else parameter
            problem = {**with_chain_times(document, l_out), "c": capacity, "arrival_rate": rate}
            algo = "gbp-cr"
        code, output = swarm_plan(algo, problem)
        if code != 0:
            raise RuntimeError(f"swarm-plan place --algo {algo} failed: {output}")
        return output
    if parameter is not None:  # a fixed R: CG-BP places exactly that many, as the goodput plan simulated
        code, output = swarm_plan("cg-bp", {**document, "num_requests": parameter})
        if code != 0:
            raise RuntimeError(f"swarm-plan place --algo cg-bp with R={parameter} failed: {output}")
        return output
    problem = parse_problem(dumps(document))
    requests = choose_num_requests(problem.servers, model, rate, l_out) or 1
    while True:  # like the scheduler: the largest R <= the chosen one that CG-BP can place
        code, output = swarm_plan("cg-bp", {**document, "num_requests": requests})
        if code == 0:
            return output
        if code != 3 or requests == 1:
            raise RuntimeError(f"swarm-plan place --algo cg-bp failed: {output}")
        requests -= 1


def cache_slot_counts(
    policy: str, plans: list[ServerPlan], model: ModelSpec, spans: list[Span | None]
) -> list[int]:
    """Sessions' cache slots per server on the paper's GPUs: eq. 2's `n_j` (cg-bp) or PETALS'
    fixed 4096-token cache (docs/reference.md 3.3)."""
    counts = []
    for plan, span in zip(plans, spans, strict=True):
        spec = ServerSpec(plan.name, plan.memory_paper)
        blocks = span.length if span else 0
        if policy == "petals":
            counts.append(petals.cache_capacity_slots(spec, model, blocks))
        else:
            counts.append(cache_slots(spec, model, blocks))
    return counts
