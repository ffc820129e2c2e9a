"""Choosing a span without a scheduler: what a joining PETALS server does (docs/reference.md 3.3).

A managed server normally takes its span from the scheduler, but the swarm must never depend on
the scheduler for liveness (docs/reference.md 1): when none answers, the server falls back to PETALS' own
rule.
It takes as many blocks as PETALS' memory formula allows (at least one, so it always adds
something) and puts them where the swarm is weakest: on the window whose per-block throughputs,
sorted ascending, are lexicographically smallest (uncovered blocks first, lowest start on ties).

Pure functions, no I/O: the server gathers the inputs (its memory, its probe's timings, the records
in the DHT) and logs the outcome, so the rule itself is tested on hand-made inputs.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np

from llm_swarm.scheduler.algorithms import petals
from llm_swarm.scheduler.algorithms.problem import ModelSpec, ServerSpec
from llm_swarm.scheduler.algorithms.windows import lexicographic_min_window
from llm_swarm.swarm.server_info import ServerInfo, ServerState

# States whose span counts as served: a MOVING server is about to leave its span and an OFFLINE
# one already has, so counting them would hide exactly the blocks that are about to lose service.
SERVING_STATES = (ServerState.ONLINE, ServerState.JOINING)


@dataclass(frozen=True)
class ServedSpan:
    """Another server's span and the throughput it announces for it (tokens/s through the span)."""

    start: int
    end: int
    throughput: float


@dataclass(frozen=True)
class BlockChoice:
    start: int
    end: int
    fitted: int  # PETALS' block count before the at-least-one rule (0: memory holds no full block set)
    block_throughput: tuple[float, ...]  # the others' summed throughput per block, as the choice saw it

    @property
    def num_blocks(self) -> int:
        return self.end - self.start


def petals_model_spec(
    *,
    num_blocks: int,
    block_bytes: int,
    hidden_size: int,
    kv_dim: int,
    dtype_bytes: int,
    cache_bytes: int,
) -> ModelSpec:
    """The `ModelSpec` PETALS' block count needs: width (autograd reserve), `d_kv` and the cache
    dtype (its fixed attention cache). `cache_bytes` (`s_c`) is carried along but unused by it."""
    return ModelSpec(
        num_blocks=num_blocks,
        block_bytes=block_bytes,
        cache_bytes=cache_bytes,
        hidden_size=hidden_size,
        kv_dim=kv_dim,
        dtype_bytes=dtype_bytes,
    )


def served_spans(servers: Mapping[str, ServerInfo], exclude: str | None = None) -> list[ServedSpan]:
    """The spans that currently serve clients, from DHT records (peer id -> record).

    Records without blocks or without a measured throughput (still measuring) add nothing, like in
    PETALS where a server counts only once it announces its throughput.
    """
    spans = []
    for peer_id, info in servers.items():
        if peer_id == exclude or not info.has_blocks or info.state not in SERVING_STATES:
            continue
        if info.throughput is None or info.throughput <= 0:
            continue
        spans.append(ServedSpan(info.start, info.end, info.throughput))
    return spans


def block_throughput(spans: Iterable[ServedSpan], num_blocks: int) -> np.ndarray:
    """Per-block throughput: each server's throughput added to every block of its span."""
    totals = np.zeros(num_blocks)
    for span in spans:
        if 0 <= span.start < span.end <= num_blocks:
            totals[span.start : span.end] += span.throughput
    return totals


def choose_blocks(
    model: ModelSpec, memory_bytes: float, tau: float, others: Iterable[ServedSpan]
) -> BlockChoice:
    """PETALS' choice for a server with `memory_bytes` and per-block decode time `tau`
    (docs/reference.md 3.3)."""
    fitted = petals.block_count(ServerSpec(name="self", memory_bytes=memory_bytes, tau=tau), model)
    count = min(max(fitted, 1), model.num_blocks)
    totals = block_throughput(others, model.num_blocks)
    start = lexicographic_min_window(totals, count)
    return BlockChoice(start, start + count, fitted, tuple(float(value) for value in totals))
