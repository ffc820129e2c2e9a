"""Request arrivals: Poisson (Sun et al., section 4.1) or replay of the Azure LLM trace (Sun, He and
Hou, section 4.2)."""

from __future__ import annotations

import csv
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import numpy as np

from llm_swarm.scheduler.sim.data_dir import DATA_DIR

AZURE_TRACE = DATA_DIR / "azure_llm_inference_trace_code_2023.csv"


@dataclass(frozen=True)
class Request:
    """One request: arrives at `arrival`, wants `l_out` tokens after an `l_in`-token prompt."""

    id: int
    arrival: float
    l_in: int
    l_out: int


def poisson(rate: float, count: int, l_in: int, l_out: int, rng: np.random.Generator) -> list[Request]:
    """`count` requests with exponential inter-arrival times of mean `1/rate`; the first arrives at 0."""
    if rate <= 0 or count < 0:
        raise ValueError(f"need rate > 0 and count >= 0, got {rate}, {count}")
    gaps = rng.exponential(1 / rate, size=count)
    if count:
        gaps[0] = 0.0  # like Sun et al.'s simulator: the run starts with an arrival
    return [Request(i, float(t), l_in, l_out) for i, t in enumerate(np.cumsum(gaps))]


@dataclass(frozen=True)
class TraceRecord:
    offset: float  # seconds since the first record
    l_in: int
    l_out: int


def load_azure_trace(path: Path = AZURE_TRACE) -> list[TraceRecord]:
    """Rows `TIMESTAMP,ContextTokens,GeneratedTokens`; malformed rows are skipped."""
    records: list[TraceRecord] = []
    first: datetime | None = None
    with path.open(newline="") as handle:
        for row in csv.DictReader(handle):
            try:
                stamp = datetime.fromisoformat(row["TIMESTAMP"].strip()[:26])
                l_in, l_out = int(row["ContextTokens"]), int(row["GeneratedTokens"])
            except (KeyError, ValueError, TypeError):
                continue
            first = first or stamp
            records.append(TraceRecord((stamp - first).total_seconds(), max(l_in, 1), max(l_out, 1)))
    if not records:
        raise ValueError(f"no usable rows in {path}")
    return records


def trace_replay(
    records: list[TraceRecord],
    count: int,
    max_l_in: int | None,
    max_l_out: int | None,
    rng: np.random.Generator,
) -> list[Request]:
    """`count` consecutive trace records from a random start, re-based to t = 0.

    Each request keeps its own lengths (its prefill is charged for its own `l_in`, see `prefill`),
    clipped only where a cap is given: with caches allocated statically for a maximum sequence
    length (Sun, He and Hou, section 2.1) a deployment may refuse longer requests, which a cap models.
    """
    if not 0 < count <= len(records):
        raise ValueError(f"count must be in [1, {len(records)}], got {count}")
    start = int(rng.integers(len(records) - count + 1))
    window = records[start : start + count]
    base = window[0].offset
    return [
        Request(i, r.offset - base, _clip(r.l_in, max_l_in), _clip(r.l_out, max_l_out))
        for i, r in enumerate(window)
    ]


def _clip(length: int, cap: int | None) -> int:
    return length if cap is None else min(length, cap)
