"""One simulated cell (scenario x policy x workload) averaged over Monte Carlo seeds.

Every seed draws its own random quantities from `numpy.random.default_rng(seed)` in a fixed order
(scenario placement, then arrivals, then PETALS' join order), so a run is a pure function of its
`CellConfig` and seed, and two policies with the same seed see the same servers and arrivals.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from llm_swarm.scheduler.sim import contended_run, hetero, scenarios, workload
from llm_swarm.scheduler.sim.discrete_events import SimResult, simulate
from llm_swarm.scheduler.sim.length_info import TRACE_MAX_NEW_TOKENS, check_length_info, length_source
from llm_swarm.scheduler.sim.metrics import Slo, average, summarize
from llm_swarm.scheduler.sim.policies import NONE, PAPER000, POLICIES, build_dispatcher

SCENARIOS = ("clustered", "abovenet", "bellcanada", "gtsce", "ripe", "hetero")
SETUPS = ("paper", "none")  # session set-up delays: Sun et al.'s calibrated ones, or none


@dataclass(frozen=True)
class CellConfig:
    scenario: str = "clustered"
    policy: str = "cg-bp"
    client_cluster: int = 0
    rate: float = 0.5
    l_in: int = 20
    l_out: int = 128
    requests: int = 100
    num_servers: int | None = None  # topology scenarios: C (default: Table 5's deployment)
    fast_fraction: float | None = None  # eta
    arrivals: str = "poisson"  # or "azure" (trace replay)
    # Trace replay: caps on each request's own lengths (None: keep them). `l_in`/`l_out` above stay
    # the nominal lengths the cache size s_c and the planners use (docs/reference.md 2).
    max_l_in: int | None = None
    max_l_out: int | None = None
    compute_scale: float = 1.0  # multiplies every per-block time (`scenarios.scale_compute`)
    slo_ttft: float | None = None  # SLOs of docs/reference.md 6 (seconds); either one adds `slo_attainment`
    slo_tpot: float | None = None
    setup: str = "paper"  # "paper": Sun et al.'s calibrated session set-up delays; "none"
    length_info: str = "oracle"  # the l_out WS-RR routes by (`scheduler.sim.length_info`)
    # Contended servers (`scheduler.sim.contended_run`; None: Sun et al.'s model, eq. 1)
    contended: str | None = None  # the accelerator model: "serial" or "overlap"
    batch_wait_ms: float = 2.0
    prefill_chunk: int = 256
    roles: str | None = None  # e.g. "prefill*2,decode*6" (`scheduler.sim.contended_roles.parse_roles`)
    link_mbps: float | None = None  # between every two servers (None: the scenario's own links)
    link_rtt_ms: float = 10.0
    disaggregate: str = "auto"

    def __post_init__(self) -> None:
        """Every value checked where the config is made (messages name `swarm-sim`'s flags)."""
        if self.scenario not in SCENARIOS or self.policy not in POLICIES or self.setup not in SETUPS:
            raise ValueError(
                f"unknown scenario, policy or setup {self.scenario!r}/{self.policy!r}/{self.setup!r}"
            )
        # `not x > 0` also rejects nan
        for name in ("rate", "l_in", "l_out", "requests", "compute_scale"):
            if not getattr(self, name) > 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive")
        for name in ("max_l_in", "max_l_out", "slo_ttft", "slo_tpot", "num_servers"):
            if getattr(self, name) is not None and not getattr(self, name) > 0:
                flag = {"num_servers": "servers"}.get(name, name)
                raise ValueError(f"--{flag.replace('_', '-')} must be positive")
        if self.fast_fraction is not None and not 0 <= self.fast_fraction <= 1:
            raise ValueError(f"--eta must be in [0, 1], got {self.fast_fraction}")
        check_length_info(self.length_info)
        if self.contended is not None:
            self.contended_options()  # checks the contended flags
        elif self.roles is not None or self.link_mbps is not None:
            raise ValueError("--roles and --link-mbps need --contended serial|overlap")

    def contended_options(self) -> contended_run.ContendedOptions:
        return contended_run.ContendedOptions(
            self.contended, self.batch_wait_ms, self.prefill_chunk, self.roles, self.link_mbps,
            self.link_rtt_ms, self.disaggregate,
        )  # fmt: skip

    @property
    def declared_l_out(self) -> int | None:
        """What clients declare as max_new_tokens (None: each request's own l_out)."""
        if self.max_l_out is not None:
            return self.max_l_out
        return TRACE_MAX_NEW_TOKENS if self.arrivals.startswith("azure") else None  # trace lengths


@lru_cache(maxsize=8)
def _topology_rtts(name: str) -> np.ndarray:
    return scenarios.topology_rtts(name)


@lru_cache(maxsize=1)
def _ripe() -> np.ndarray:
    return scenarios.ripe_latencies()


@lru_cache(maxsize=1)
def _azure() -> tuple[workload.TraceRecord, ...]:
    return tuple(workload.load_azure_trace())


def make_scenario(config: CellConfig, rng: np.random.Generator) -> scenarios.Scenario:
    return scenarios.scale_compute(_base_scenario(config, rng), config.compute_scale)


def _base_scenario(config: CellConfig, rng: np.random.Generator) -> scenarios.Scenario:
    if config.scenario == "clustered":
        return scenarios.clustered(config.client_cluster, config.l_in, config.l_out)
    if config.scenario in scenarios.TOPOLOGY_FILES:
        rtts = _topology_rtts(config.scenario)
        return scenarios.topology_zoo(
            config.scenario, rtts, rng, config.num_servers, config.fast_fraction, config.l_in, config.l_out
        )
    if config.scenario == "ripe":
        return scenarios.ripe_atlas(_ripe(), rng, config.l_in, config.l_out)
    if config.scenario == "hetero":
        return hetero.hetero(config.l_in, config.l_out)
    raise ValueError(f"unknown scenario {config.scenario!r}; choose from {', '.join(SCENARIOS)}")


def make_requests(config: CellConfig, rng: np.random.Generator) -> list[workload.Request]:
    if config.arrivals == "poisson":
        return workload.poisson(config.rate, config.requests, config.l_in, config.l_out, rng)
    if config.arrivals == "azure":
        return workload.trace_replay(list(_azure()), config.requests, config.max_l_in, config.max_l_out, rng)
    if config.arrivals == "azure-lengths":  # Poisson at `rate`, each request a trace record's lengths
        records = list(_azure())
        return hetero.poisson_trace_lengths(
            config.rate, config.requests, records, config.max_l_in, config.max_l_out, rng
        )
    raise ValueError(f"unknown arrival process {config.arrivals!r}")


def run_seed(config: CellConfig, seed: int) -> SimResult:
    """One Monte Carlo run."""
    rng = np.random.default_rng(seed)
    scenario = make_scenario(config, rng)
    requests = make_requests(config, rng)
    rate = config.rate
    if config.arrivals == "azure" and len(requests) > 1:  # the scheduler plans for the trace's rate
        rate = (len(requests) - 1) / max(requests[-1].arrival - requests[0].arrival, 1e-9)
    setup = PAPER000 if config.setup == "paper" else NONE
    lengths = length_source(config.length_info, config.l_out, config.declared_l_out)
    if config.contended is not None:
        return contended_run.simulate_contended(
            scenario,
            config.contended_options(),
            requests,
            lambda decode: build_dispatcher(config.policy, decode, rate, rng, setup, lengths),
        )
    dispatcher = build_dispatcher(config.policy, scenario, rate, rng, setup, lengths)
    return simulate(scenario.servers, scenario.model, dispatcher, requests, scenario.prefill)


def run_cell(
    config: CellConfig, seeds: int, first_seed: int = 0, progress: Callable[[], None] | None = None
) -> dict[str, float]:
    """docs/reference.md 6 summary averaged over seeds `first_seed .. first_seed + seeds - 1`."""
    if seeds < 1:
        raise ValueError(f"seeds must be >= 1, got {seeds}")
    slo = Slo(config.slo_ttft, config.slo_tpot)
    summaries = []
    for seed in range(first_seed, first_seed + seeds):
        summaries.append(summarize(run_seed(config, seed).records, slo))
        if progress is not None:
            progress()
    return average(summaries)
