"""The simulator's side of `benchmarks/roles/emulated.py`: the emulated swarm as a `Scenario`,
its prediction by the contended model with the same arrivals and lengths, the role planner's choice,
and the goodput and attainment arithmetic of the measured runs (pure, no processes).

The emulated servers cost, per block, `max(--compute-delay, per-token delay x tokens)` of sleep
(`server/emulated_delay.py`) after the real CPU forward of the tiny block on the server's one compute
thread. The contended model (`scheduler.sim.contended`) gets the same two parts: the *device* (the
sleep: a decode iteration `compute_delay`, a prefill `per_token x tokens`; exact while a decode batch
has at most `compute_delay / per_token` rows) and the *host* (the CPU forward, measured on this
machine before the run, one iteration at a time). Routing is WS-RR (Sun et al.) on the servers that
decode: the least eq. 1 time among servers with cache room, waiting when none has room, which is what
the live client's own routing does (`client/routing.py`) and the scheduler's (`--scheduler`; cg-bp
routes by WS-RR). Where each prompt runs: the client's rule (`disaggregate="auto"`), or with the
scheduler its plan (`"scheduler"`: the same cost rule plus each prefill server's queue of the prompts
planned before, `scheduler/service/prefill_routing.py`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from benchmarks.table2.plans import measured_times  # noqa: F401  (the measured side, shared with Table 2)
from llm_swarm.scheduler.algorithms.problem import Span
from llm_swarm.scheduler.algorithms.wsrr import RoutingState
from llm_swarm.scheduler.sim.contended import ContendedService
from llm_swarm.scheduler.sim.contended_roles import split, subset, uniform_links
from llm_swarm.scheduler.sim.contended_run import ContendedOptions
from llm_swarm.scheduler.sim.discrete_events import RequestRecord, simulate
from llm_swarm.scheduler.sim.metrics import GOODPUT_ATTAINMENT, Slo, goodput, per_request, slo_attainment
from llm_swarm.scheduler.sim.policies import WsRrRouting
from llm_swarm.scheduler.sim.profiles import GpuProfile, ModelProfile
from llm_swarm.scheduler.sim.scenarios import CLIENT, Link, Scenario, build_scenario
from llm_swarm.scheduler.sim.server_costs import IterationCost, ServerCost
from llm_swarm.scheduler.sim.workload import Request, TraceRecord
from llm_swarm.swarm.prefill_cost import STREAM_CHUNK_TOKENS

SERVER_NAMES = ("rich0", "rich1", "slow0", "slow1")  # 2 compute-rich, then 2 prefill-slow
OPERATOR_ROLES = "prefill*2,decode*2"


@dataclass(frozen=True)
class CpuCosts:
    """What one tiny block really costs on this CPU (one torch thread), per block."""

    decode: float  # a one-row decode step
    decode_per_row: float  # each further row of a batched decode step
    prefill_per_token: float
    block_bytes: int
    cache_token_bytes: int  # keys + values of one token in one block


@dataclass(frozen=True)
class EmulatedSwarm:
    """The emulated swarm's numbers (the command line's)."""

    compute_delay: float  # seconds per block per step (decode floor), every server but see below
    rich_per_token: float  # seconds per block per prompt token, compute-rich servers
    slow_per_token: float  # the same, prefill-slow servers
    client_rtt_s: float
    uplink_mbps: float
    link_rtt_s: float  # between servers
    link_mbps: float
    memory_bytes: float
    num_blocks: int
    hidden: int
    cpu: CpuCosts
    prefill_memory_bytes: float | None = None  # servers with the prefill role (None: memory_bytes)
    # the compute-rich servers' decode floor (None: compute_delay; more: slower at decoding, the
    # `split` swarm's compute-rich, bandwidth-poor GPUs)
    rich_compute_delay: float | None = None

    def per_token(self, j: int) -> float:
        return self.rich_per_token if j < 2 else self.slow_per_token

    def decode_delay(self, j: int) -> float:
        if j < 2 and self.rich_compute_delay is not None:
            return self.rich_compute_delay
        return self.compute_delay


def model_profile(swarm: EmulatedSwarm) -> ModelProfile:
    # float32 cache, kv_dim = the hidden size (8 KV heads of 64: no grouping)
    return ModelProfile(
        "tiny-llama-512", swarm.num_blocks, swarm.cpu.block_bytes, swarm.hidden, swarm.hidden, 4
    )


def scenario(swarm: EmulatedSwarm, l_in: int, l_out: int, rtts: Sequence[float] | None = None) -> Scenario:
    """The four servers as the simulator sees them: decode `tau` = delay + CPU step, prefill per token =
    delay + CPU per token; `rtts`: the client's measured round trip to each (else the configured one)."""
    cpu = swarm.cpu
    gpus = [
        GpuProfile(
            name,
            swarm.memory_bytes,
            tau=swarm.decode_delay(j) + cpu.decode,
            prefill_base=0.0,
            prefill_per_token=swarm.per_token(j) + cpu.prefill_per_token,
        )
        for j, name in enumerate(SERVER_NAMES)
    ]
    links = [Link(swarm.client_rtt_s, swarm.uplink_mbps * 1e6)] * len(gpus)
    built = build_scenario("roles-netem", model_profile(swarm), gpus, links, l_in, l_out)
    servers = []
    for j, server in enumerate(built.servers):
        rtt = rtts[j] if rtts is not None else server.rtt[CLIENT]
        extra = server.rtt_prefill[CLIENT] - server.rtt[CLIENT]  # the prompt's upload
        servers.append(
            dataclasses.replace(
                server, name=SERVER_NAMES[j], rtt={CLIENT: rtt}, rtt_prefill={CLIENT: rtt + extra}
            )
        )
    links_between = uniform_links(len(servers), swarm.link_rtt_s, swarm.link_mbps * 1e6)
    return dataclasses.replace(built, servers=tuple(servers), server_links=links_between)


def server_costs(swarm: EmulatedSwarm, j: int) -> ServerCost:
    cpu = swarm.cpu
    device = IterationCost(fixed=swarm.decode_delay(j), prefill_per_token=swarm.per_token(j))
    host = IterationCost(
        fixed=cpu.decode, per_row=cpu.decode_per_row, prefill_per_token=cpu.prefill_per_token
    )
    return ServerCost(device, host)


def simulate_swarm(
    swarm: EmulatedSwarm,
    roles: str | None,
    requests: Sequence[Request],
    setup_s: float = 0.0,
    rtts: Sequence[float] | None = None,
    disaggregate: str = "auto",
    stream_chunk: int = STREAM_CHUNK_TOKENS,
    load_routing: bool = True,
    early_first_token: bool = True,
) -> tuple[list[RequestRecord], dict[str, float]]:
    """The contended model (serial: the emulation's delay sleeps on the compute thread) on the swarm,
    every server holding every block, WS-RR on the servers that decode; returns the records and the
    service's stats (`handoffs`: hops whose prompt ran on a prefill server). `disaggregate`: "auto"
    (the client's rule) or "scheduler" (the scheduler's queue-aware plan). `stream_chunk`: tokens
    per streamed part of a prompt's cache (0: handed off after the prompt, runs before streaming).
    `load_routing`: WS-RR counts each decoding session's cost on its server (`tau_per_session`;
    False: runs made before servers announced it). `early_first_token`: the first token returns
    before the prompt's hand-offs end (False: runs before 2026-11-26's client, where it waited)."""
    # nominal lengths: the mean, so that WS-RR's cache slots (memory / one nominal session's cache)
    # hold about as many sessions as the live servers' byte budgets do
    l_in = round(float(np.mean([r.l_in for r in requests])))
    l_out = round(float(np.mean([r.l_out for r in requests])))
    base = scenario(swarm, l_in, l_out, rtts)
    if roles is not None:
        from llm_swarm.scheduler.sim.contended_roles import parse_roles

        parsed = tuple(str(r) for r in parse_roles(roles, len(base.servers)))
        memory = swarm.prefill_memory_bytes or swarm.memory_bytes
        servers = tuple(
            dataclasses.replace(s, memory_bytes=memory) if role == "prefill" else s
            for s, role in zip(base.servers, parsed, strict=True)
        )
        base = dataclasses.replace(base, roles=parsed, servers=servers)
    options = ContendedOptions("serial", disaggregate=disaggregate)
    decode, order, disaggregation = split(base, options.disaggregate, stream_chunk)
    ordered = subset(base, order)
    if disaggregation is not None:
        disaggregation.first_token_waits = not early_first_token
    on_prefill: dict[str, float] = {}  # prompts per prefill server (by name)
    if disaggregation is not None:
        plan = disaggregation.plan

        def counted(request, hops, now):
            chosen = plan(request, hops, now)
            for server, hop in zip(chosen, hops, strict=True):
                if server != hop.server:
                    name = f"prompts_on:{SERVER_NAMES[order[server]]}"
                    on_prefill[name] = on_prefill.get(name, 0.0) + 1
            return chosen

        disaggregation.plan = counted
    service = ContendedService(
        ordered.servers,
        [server_costs(swarm, j) for j in order],
        options.config(),
        ordered.prefill,
        disaggregation,
    )
    spans = [Span(0, swarm.num_blocks)] * len(decode.servers)
    # each session holds the cache of its own lengths, as the live servers reserve it, and is routed
    # and admitted for that room, as the live scheduler does (one nominal slot each let sessions of
    # long prompts fit where they do not)
    nominal = l_in + l_out

    def cache_units(request: Request) -> float:
        return (request.l_in + request.l_out) / nominal

    # routed as the live scheduler routes: each decoding session adds its row's host cost per block
    # (`tau_per_session`, what a live server measures of itself without other processes' load)
    per_session = swarm.cpu.decode_per_row if load_routing else None
    loaded = [dataclasses.replace(s, tau_per_session=per_session) for s in decode.servers]
    dispatcher = WsRrRouting(
        RoutingState(loaded, decode.model, spans),
        spans,
        setup_s,
        decode.prefill,
        cache_units=cache_units,
    )
    result = simulate(
        decode.servers, decode.model, dispatcher, list(requests), decode.prefill, service, cache_units
    )
    return list(result.records), {**result.service_stats, **on_prefill}


def planner_choice(swarm: EmulatedSwarm, slo: Slo, l_in: int, l_out: int, requests_at) -> str:
    """`scheduler.algorithms.role_split.plan_roles` on this swarm (the live planner's algorithm, scored in
    the contended model, cg-bp): 'colocated' or its roles text."""
    from llm_swarm.scheduler.sim.role_planning import RoleSearch, plan_scenario_roles, roles_text

    search = RoleSearch(link_rtt_s=swarm.link_rtt_s, min_requests=40, horizon_s=60.0)
    plan, _ = plan_scenario_roles(scenario(swarm, l_in, l_out), slo, search, requests_at)
    return "colocated" if plan.colocated else roles_text(plan.roles)


# --- measured runs ------------------------------------------------------------------------------------------
def attainment(ttft: Sequence[float], tpot: Sequence[float], failed: int, slo: Slo) -> float:
    """Share of all requests (failed ones count as misses) within both targets."""
    total = len(ttft) + failed
    if total == 0:
        return math.nan
    met = slo_attainment(ttft, tpot, slo) * len(ttft) if ttft else 0.0
    return met / total


def rate_goodput(rates: Sequence[float], attainments: Sequence[float]) -> float:
    """DistServe's goodput on the probed rates, not interpolated: the highest probed rate at which it
    and every lower probed rate reach 90% attainment (`scheduler.sim.metrics.goodput`); NaN attainments
    (a rate not run) end the prefix."""
    clean = [(r, a if math.isfinite(a) else -1.0) for r, a in zip(rates, attainments, strict=True)]
    return goodput([r for r, _ in clean], [a for _, a in clean], GOODPUT_ATTAINMENT)


def percentiles(values: Sequence[float]) -> tuple[float, float]:
    if not len(values):
        return math.nan, math.nan
    return float(np.percentile(values, 50)), float(np.percentile(values, 99))


def simulated_summary(records: Sequence[RequestRecord], slo: Slo) -> dict[str, float]:
    values = per_request(records)
    ttft50, ttft99 = percentiles(values["ttft"])
    tpot50, tpot99 = percentiles(values["tpot"])
    return {
        "ttft_p50": ttft50,
        "ttft_p99": ttft99,
        "tpot_p50": tpot50,
        "tpot_p99": tpot99,
        "attainment": slo_attainment(values["ttft"], values["tpot"], slo),
    }


def trace_requests(
    records: Sequence[TraceRecord],
    rate: float,
    count: int,
    scale: int,
    max_l_in: int,
    max_l_out: int,
    seed: int,
) -> list[Request]:
    """Poisson arrivals at `rate` (the first at 0), lengths drawn from the trace's records: prompts
    divided by `scale` and capped at `max_l_in` (at least 2 tokens), answers capped at `max_l_out`
    (at least 2, so that every request has a TPOT)."""
    rng = np.random.default_rng(seed)
    gaps = rng.exponential(1 / rate, size=count)
    gaps[0] = 0.0
    picks = rng.integers(len(records), size=count)
    out = []
    for i, (t, k) in enumerate(zip(np.cumsum(gaps), picks, strict=True)):
        record = records[int(k)]
        l_in = max(2, min(max_l_in, record.l_in // scale))
        out.append(Request(i, float(t), l_in, max(2, min(max_l_out, record.l_out))))
    return out
