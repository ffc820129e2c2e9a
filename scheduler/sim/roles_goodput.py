"""Goodput of colocated serving against prefill/decode roles on the `hetero` swarm, pure.

Each configuration is a `CellConfig` of the contended model (serial accelerators, the live server's
loop) on `scheduler.sim.hetero` with Poisson arrivals whose lengths are the Azure code trace's;
`goodput.search_rates` finds the highest rate at which >= 90% of requests meet both SLOs, each
probe averaging `seeds` runs.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from llm_swarm.scheduler.sim.goodput import GoodputResult, search_rates
from llm_swarm.scheduler.sim.metrics import Slo, average, summarize
from llm_swarm.scheduler.sim.monte_carlo import CellConfig, run_seed

ROLES = "prefill*2,decode*6"  # the two A100s take prompts only; the older cards decode


@dataclass(frozen=True)
class RolesCase:
    label: str
    roles: str | None  # None: every server colocates (role both)
    link_mbps: float


def base_config(
    slo_ttft: float, slo_tpot: float, requests: int, policy: str = "cg-bp", max_l_in: int = 2048
) -> CellConfig:
    """The comparison's cell: nominal lengths 2048 + 128 (the caches' size and the planners' view),
    each request its trace record's lengths capped at those."""
    return CellConfig(
        scenario="hetero",
        policy=policy,
        rate=0.05,
        l_in=max_l_in,
        l_out=128,
        requests=requests,
        arrivals="azure-lengths",
        max_l_in=max_l_in,
        max_l_out=128,
        slo_ttft=slo_ttft,
        slo_tpot=slo_tpot,
        setup="none",
        contended="serial",
        link_mbps=1000.0,
    )


def case_config(base: CellConfig, case: RolesCase) -> CellConfig:
    return replace(base, roles=case.roles, link_mbps=case.link_mbps)


def probe(config: CellConfig, rate: float, seeds: int) -> dict[str, float]:
    """The averaged summary at `rate` (200 s of arrivals at least, as `goodput.cell_goodput`), plus
    the share of hops whose prompt ran on a prefill server."""
    cell = replace(config, rate=rate, requests=max(config.requests, round(200 * rate)))
    slo = Slo(cell.slo_ttft, cell.slo_tpot)
    summaries = []
    for seed in range(seeds):
        result = run_seed(cell, seed)
        summary = summarize(result.records, slo)
        hops = max(sum(r.num_hops for r in result.records), 1)
        summary["handoff_share"] = result.service_stats.get("handoffs", 0.0) / hops
        summaries.append(summary)
    return average(summaries)


def case_goodput(config: CellConfig, seeds: int, start: float = 0.05) -> GoodputResult:
    return search_rates(lambda rate: probe(config, rate, seeds)["slo_attainment"], start, doublings=7)
