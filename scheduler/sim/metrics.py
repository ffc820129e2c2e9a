"""Per-run summary of SPEC 6: per-token time, TTFT, TPOT, waiting, service, percentiles, throughput."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from scheduler.sim.engine import RequestRecord

PERCENTILES = (50, 95, 99)
# Per-request quantities summarized with mean and percentiles.
PER_REQUEST = ("per_token_time", "ttft", "tpot", "waiting", "service", "total")


def per_request(records: Sequence[RequestRecord]) -> dict[str, np.ndarray]:
    """SPEC 6 per request: per-token time (total / l_out, paper 000's metric), TTFT, TPOT, waiting, ..."""
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


def summarize(records: Sequence[RequestRecord]) -> dict[str, float]:
    """Means, p50/p95/p99 of every per-request metric, throughput (tokens/s) and the request count."""
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
    return summary


def average(summaries: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """Monte Carlo average over seeds (paper 000 averages 20 runs), key by key."""
    if not summaries:
        raise ValueError("no runs to average")
    return {key: float(np.mean([s[key] for s in summaries])) for key in summaries[0]}
