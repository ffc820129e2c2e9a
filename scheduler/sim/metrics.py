"""Per-run summary of docs/reference.md 6: per-token time, TTFT, TPOT, waiting, service, percentiles,
throughput, SLO attainment and goodput (the definitions of DistServe: a request meets its SLOs when
both its TTFT and its TPOT are within bounds; goodput is the highest arrival rate at which at least
90% of requests do)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from llm_swarm.scheduler.sim.discrete_events import RequestRecord

PERCENTILES = (50, 95, 99)
# Per-request quantities summarized with mean and percentiles.
PER_REQUEST = ("per_token_time", "ttft", "tpot", "waiting", "service", "total")
GOODPUT_ATTAINMENT = 0.9  # docs/reference.md 6


@dataclass(frozen=True)
class Slo:
    """Latency objectives in seconds; None leaves that metric unconstrained."""

    ttft_s: float | None = None
    tpot_s: float | None = None

    def __post_init__(self) -> None:
        for bound in (self.ttft_s, self.tpot_s):
            if bound is not None and not bound > 0:
                raise ValueError(f"SLOs must be positive seconds, got {bound}")

    @property
    def active(self) -> bool:
        return self.ttft_s is not None or self.tpot_s is not None


def per_request(records: Sequence[RequestRecord]) -> dict[str, np.ndarray]:
    """docs/reference.md 6 per request: per-token time (total / l_out, Sun et al.'s metric), TTFT, TPOT,
    waiting, ..."""
    arrival = np.array([r.arrival for r in records])
    setup = np.array([r.setup for r in records])
    start = np.array([r.start for r in records])
    first = np.array([r.first_token for r in records])
    finish = np.array([r.finish for r in records])
    l_out = np.array([r.l_out for r in records], dtype=float)
    decode_tokens = np.maximum(l_out - 1, 1)  # TPOT: mean time per output token after the first
    return {
        "per_token_time": (finish - arrival) / l_out,
        "ttft": first - arrival,
        "tpot": np.where(l_out > 1, (finish - first) / decode_tokens, 0.0),
        # routing/cache wait only (the set-up delay is separate); clamp float noise of exact starts
        "waiting": np.maximum(start - arrival - setup, 0.0),
        "service": finish - start,
        "total": finish - arrival,
    }


def slo_attainment(ttft: Sequence[float], tpot: Sequence[float], slo: Slo) -> float:
    """Fraction of requests whose TTFT and TPOT both meet `slo` (bounds inclusive)."""
    ttft_a, tpot_a = np.asarray(ttft, dtype=float), np.asarray(tpot, dtype=float)
    if ttft_a.shape != tpot_a.shape or ttft_a.size == 0:
        raise ValueError("need one TTFT and one TPOT per request, at least one request")
    ok = np.ones(ttft_a.shape, dtype=bool)
    if slo.ttft_s is not None:
        ok &= ttft_a <= slo.ttft_s
    if slo.tpot_s is not None:
        ok &= tpot_a <= slo.tpot_s
    return float(ok.mean())


def goodput(
    rates: Sequence[float], attainments: Sequence[float], target: float = GOODPUT_ATTAINMENT
) -> float:
    """Highest probed rate such that it and every lower probed rate reach `target` attainment.

    Requiring the whole prefix (not just one lucky rate above a failing one) keeps Monte Carlo noise
    from overstating goodput. 0.0 when even the lowest rate misses.
    """
    if len(rates) != len(attainments):
        raise ValueError("one attainment per rate")
    best = 0.0
    for rate, attained in sorted(zip(rates, attainments, strict=True)):
        if attained < target:
            break
        best = rate
    return best


def summarize(records: Sequence[RequestRecord], slo: Slo | None = None) -> dict[str, float]:
    """Means, p50/p95/p99 of every per-request metric, throughput (tokens/s), the request count and,
    when `slo` constrains anything, `slo_attainment`."""
    if not records:
        raise ValueError("no requests to summarize")
    values = per_request(records)
    summary: dict[str, float] = {"requests": float(len(records))}
    for name in PER_REQUEST:
        summary[f"{name}_mean"] = float(values[name].mean())
        for q in PERCENTILES:
            summary[f"{name}_p{q}"] = float(np.percentile(values[name], q))
    span = max(r.finish for r in records) - min(r.arrival for r in records)
    tokens = sum(r.l_out for r in records)
    summary["throughput_tokens_per_s"] = tokens / span if span > 0 else float("inf")
    summary["retries_mean"] = float(np.mean([r.retries for r in records]))
    if slo is not None and slo.active:
        summary["slo_attainment"] = slo_attainment(values["ttft"], values["tpot"], slo)
    return summary


def average(summaries: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """Monte Carlo average over seeds (Sun et al. averages 20 runs), key by key."""
    if not summaries:
        raise ValueError("no runs to average")
    return {key: float(np.mean([s[key] for s in summaries])) for key in summaries[0]}
