"""One contended run of a cell (`swarm-sim --contended serial|overlap`): roles split off, the servers'
costs derived, the dispatcher built on the servers that decode, and the engine run with the
contended service (`scheduler.sim.contended`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from llm_swarm.scheduler.sim.contended import ContendedConfig, ContendedService
from llm_swarm.scheduler.sim.contended_roles import (
    SCHEDULER_POLICY,
    decoding,
    parse_roles,
    split,
    subset,
    uniform_links,
)
from llm_swarm.scheduler.sim.discrete_events import Dispatcher, SimResult, simulate
from llm_swarm.scheduler.sim.scenarios import Scenario
from llm_swarm.scheduler.sim.server_costs import ACCELERATOR_MODELS, from_scenario
from llm_swarm.scheduler.sim.workload import Request
from llm_swarm.swarm.prefill_cost import DISAGGREGATE_POLICIES
from llm_swarm.swarm.step_scheduler import SchedulerPolicy


@dataclasses.dataclass(frozen=True)
class ContendedOptions:
    """The cell's contended-mode settings (`CellConfig` fields of the same names)."""

    contended: str  # the accelerator model: serial or overlap
    batch_wait_ms: float = 2.0
    prefill_chunk: int = 256
    roles: str | None = None  # `--roles`, see `scheduler.sim.contended_roles.parse_roles`
    link_mbps: float | None = None  # bandwidth between every two servers (None: the scenario's links)
    link_rtt_ms: float = 10.0
    disaggregate: str = "auto"

    def __post_init__(self) -> None:
        check(self.contended, self.batch_wait_ms, self.prefill_chunk, self.link_mbps, self.link_rtt_ms)
        if self.disaggregate not in (*DISAGGREGATE_POLICIES, SCHEDULER_POLICY):
            raise ValueError(f"--disaggregate must be one of {(*DISAGGREGATE_POLICIES, SCHEDULER_POLICY)}")

    def config(self) -> ContendedConfig:
        rule = SchedulerPolicy(batch_wait=self.batch_wait_ms / 1e3)
        return ContendedConfig(self.contended, rule, self.prefill_chunk)


def check(
    contended: str | None,
    batch_wait_ms: float,
    prefill_chunk: int,
    link_mbps: float | None,
    link_rtt_ms: float,
) -> None:
    """`CellConfig`'s check of the contended flags (messages name `swarm-sim`'s flags)."""
    if contended is not None and contended not in ACCELERATOR_MODELS:
        raise ValueError(f"--contended must be one of {ACCELERATOR_MODELS}, got {contended!r}")
    if not batch_wait_ms >= 0 or prefill_chunk < 0:
        raise ValueError("--batch-wait-ms and --prefill-chunk must be >= 0")
    if link_mbps is not None and not link_mbps > 0:
        raise ValueError("--link-mbps must be positive")
    if not link_rtt_ms >= 0:
        raise ValueError("--link-rtt-ms must be >= 0")


def with_roles(scenario: Scenario, options: ContendedOptions) -> Scenario:
    """The scenario with `--roles` and `--link-mbps` / `--link-rtt-ms` applied."""
    if options.roles is not None:
        roles = parse_roles(options.roles, len(scenario.servers))
        scenario = dataclasses.replace(scenario, roles=tuple(str(r) for r in roles))
    if options.link_mbps is not None:
        links = uniform_links(len(scenario.servers), options.link_rtt_ms / 1e3, options.link_mbps * 1e6)
        scenario = dataclasses.replace(scenario, server_links=links)
    return scenario


def placed_spans(dispatcher) -> list | None:
    """The spans a dispatcher routes over (a wrapper's inner one's), or None when it has none."""
    while dispatcher is not None:
        spans = getattr(dispatcher, "spans", None)
        if spans is not None:
            return list(spans)
        dispatcher = getattr(dispatcher, "inner", None)
    return None


def simulate_contended(
    scenario: Scenario,
    options: ContendedOptions,
    requests: Sequence[Request],
    make_dispatcher: Callable[[Scenario], Dispatcher],
) -> SimResult:
    """Run `requests` with the servers' loops; the dispatcher is built on the servers that decode."""
    scenario = with_roles(scenario, options)
    dispatcher = make_dispatcher(decoding(scenario))
    # prefill servers that cannot hold the whole model pair with the decode spans just placed
    decode, order, disaggregation = split(
        scenario, options.disaggregate, decode_spans=placed_spans(dispatcher)
    )
    ordered = subset(scenario, order)
    service = ContendedService(
        ordered.servers,
        from_scenario(ordered.servers, ordered.model, ordered.prefill),
        options.config(),
        ordered.prefill,
        disaggregation,
    )
    return simulate(decode.servers, decode.model, dispatcher, requests, decode.prefill, service)
