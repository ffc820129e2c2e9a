"""The swarm a goodput plan is searched on, as the simulator's `Scenario`.

Two sources:

- a named scenario of `swarm-sim` (`named_swarm`), with its random deployment (the RIPE anchors,
  the topology nodes) drawn once from a seed: a plan is for one swarm, so every candidate and every
  Monte Carlo run sees the same servers and links, and only the arrivals change between runs;
- the swarm as the scheduler sees it (`problem_swarm`): a `swarm-plan` problem document, such as the
  `plan_input` of the scheduler's status. Its servers carry `tau`, `tau_prefill` (already for the
  planned prompt length) and round trips to one or more clients; the simulator has one client, so
  one of them is chosen (`choose_client`). The prefill terms are taken as they are for every
  request (Poisson arrivals of the planned lengths), and PETALS' router sees the measured round
  trip as its ping (a scheduler measures no other).

`with_added_servers` answers "what if there were n more servers like this one" (Aladdin's question):
copies of a server of the swarm, its hardware and its link.
"""

from __future__ import annotations

import dataclasses
import statistics

import numpy as np

from llm_swarm.scheduler.algorithms.placing import PlanInputError, PlanProblem, server_where
from llm_swarm.scheduler.sim.monte_carlo import CellConfig, make_scenario
from llm_swarm.scheduler.sim.prefill import PrefillModel, affine_prefill
from llm_swarm.scheduler.sim.scenarios import Scenario
from llm_swarm.scheduler.sim.single_client import seen_by_client

DEFAULT_L_OUT = 128  # swarm-sim's default, for a problem document without `l_out`


def named_swarm(
    name: str,
    *,
    client_cluster: int = 0,
    l_in: int = 20,
    l_out: int = DEFAULT_L_OUT,
    seed: int = 0,
    compute_scale: float = 1.0,
) -> Scenario:
    """`swarm-sim --scenario NAME` with its random deployment drawn from `seed`."""
    config = CellConfig(
        scenario=name, client_cluster=client_cluster, l_in=l_in, l_out=l_out, compute_scale=compute_scale
    )
    return make_scenario(config, np.random.default_rng(seed))


def choose_client(problem: PlanProblem, client: str | None = None) -> str:
    """The client to plan for: `client` if given, else the worst placed one (the largest mean round
    trip over the servers that know it), so a plan that serves it serves the nearer ones too."""
    known = sorted({name for server in problem.servers for name in server.rtt})
    if not known:
        raise PlanInputError("servers: no server has an rtt to any client (the goodput plan needs one)")
    if client is not None:
        if client not in known:
            raise PlanInputError(f"--client: no server has an rtt to {client!r}; known: {', '.join(known)}")
        return client

    def mean_rtt(name: str) -> float:
        return statistics.fmean(s.rtt[name] for s in problem.servers if name in s.rtt)

    return max(known, key=lambda name: (mean_rtt(name), name))


def problem_swarm(
    problem: PlanProblem, *, client: str | None = None, l_in: int = 20, l_out: int | None = None
) -> Scenario:
    """The problem document's swarm as seen from one client (`choose_client`).

    Every server needs `tau`, `tau_prefill` and an `rtt` to that client (`rtt_prefill` defaults to
    the `rtt`). `l_out` defaults to the problem's own; `model.cache_bytes` stays the problem's `s_c`.
    """
    name = choose_client(problem, client)
    servers, pings, tau_lines, rtt_lines = [], [], [], []
    for j, server in enumerate(problem.servers):
        where = server_where(j, server.name)
        for field in ("tau", "tau_prefill"):
            if getattr(server, field) is None:
                raise PlanInputError(f"{where}.{field}: required for the goodput plan")
        if name not in server.rtt:
            raise PlanInputError(f"{where}.rtt: no round trip to client {name!r} (needed to simulate it)")
        rtt = server.rtt[name]
        rtt_prefill = server.rtt_prefill.get(name, rtt)
        servers.append(seen_by_client(server, rtt, rtt_prefill))
        pings.append(rtt)
        tau_lines.append((server.tau_prefill, 0.0))  # already for the planned prompt: constant
        rtt_lines.append((rtt_prefill, 0.0))
    planned_l_out = l_out if l_out is not None else problem.l_out or DEFAULT_L_OUT
    return Scenario(
        name=f"problem:{name}",
        model=problem.model,
        servers=tuple(servers),
        ping_rtt=tuple(pings),
        gpu_names=tuple(s.name for s in servers),
        l_in=l_in,
        l_out=planned_l_out,
        prefill=affine_prefill(tau_lines, rtt_lines),
    )


def server_kinds(scenario: Scenario) -> list[str]:
    """What `with_added_servers` accepts as a kind: the GPU kinds, then the servers' names."""
    kinds = list(dict.fromkeys(scenario.gpu_names))
    return kinds + [s.name for s in scenario.servers if s.name not in kinds]


def with_added_servers(scenario: Scenario, kind: str, count: int) -> Scenario:
    """The swarm plus `count` copies of the first server whose GPU kind or name is `kind` (same
    memory, compute times and link to the client)."""
    if count < 0:
        raise ValueError(f"the number of servers to add must be >= 0, got {count}")
    template = _template(scenario, kind)
    if count == 0:
        return scenario
    base = scenario.servers[template]
    copies = tuple(
        dataclasses.replace(base, name=f"added{k}-{scenario.gpu_names[template]}") for k in range(count)
    )
    taken = {s.name for s in scenario.servers}
    if taken & {s.name for s in copies}:
        raise PlanInputError(f"server names starting with 'added' clash with the copies of {kind!r}")
    prefill = scenario.prefill
    return dataclasses.replace(
        scenario,
        servers=scenario.servers + copies,
        ping_rtt=scenario.ping_rtt + (scenario.ping_rtt[template],) * count,
        gpu_names=scenario.gpu_names + (scenario.gpu_names[template],) * count,
        prefill=PrefillModel(
            prefill.tau_base + (prefill.tau_base[template],) * count,
            prefill.tau_per_token + (prefill.tau_per_token[template],) * count,
            prefill.rtt_base + (prefill.rtt_base[template],) * count,
            prefill.rtt_per_token + (prefill.rtt_per_token[template],) * count,
        ),
    )


def _template(scenario: Scenario, kind: str) -> int:
    for j, gpu in enumerate(scenario.gpu_names):
        if gpu == kind:
            return j
    for j, server in enumerate(scenario.servers):
        if server.name == kind:
            return j
    raise PlanInputError(
        f"--servers-to-add: unknown kind {kind!r}; choose a GPU kind or a server: "
        f"{', '.join(server_kinds(scenario))}"
    )
