"""The PETALS baseline: what PETALS itself does, for comparison (docs/reference.md 3.3; Sun et al.
section 4.1).

Inputs PETALS' rules do not fix, and what we chose:

- The block count needs the model's width: `model.hidden_size` (autograd reserve
  `2 GiB * hidden_size / 14336`), `model.kv_dim` (d_kv; defaults to hidden_size, i.e. multi-head
  attention; a smaller d_kv means GQA and a 16384-token cache) and `model.dtype_bytes` (default 2,
  PETALS keeps the cache in the 16-bit model dtype).
- Throughput `min(forward_rps / ((m_j + 1)/2), network_rps)`: servers may give `forward_rps` and
  `network_rps`; by default `forward_rps = 1/tau_j` (block-tokens per second, the decode speed we
  know) and `network_rps = inf` (the scheduler has no bandwidth figure; PETALS derives it from a
  speed test we do not run).
- Routing charges `1/inference_rps` per block, by default `tau_j`. "No cache room" means PETALS'
  fixed attention cache (`m_j` blocks x `attn_cache_tokens` tokens) has fewer free slots (in units
  of `s_c`) than the blocks the server would process. Without `hidden_size` the router falls back
  to the memory model's `n_j` (docs/reference.md 3.2).
- A route's cost is PETALS' own path weight; PETALS predicts no waiting time (it retries with
  backoff, `retry_delay`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from llm_swarm.scheduler.algorithms.problem import (
    ModelSpec,
    Placement,
    ServerSpec,
    Span,
    cache_slots,
    floor_ratio,
    uncovered_blocks,
)
from llm_swarm.scheduler.algorithms.routing_graph import Chain, RoutingGraph
from llm_swarm.scheduler.algorithms.windows import lexicographic_min_window

HOP_OVERHEAD_S = 0.018  # added to every hop's rtt/2 by PETALS' router
NO_CACHE_ROOM_PENALTY_S = 10.0
ATTN_CACHE_TOKENS = 4096
ATTN_CACHE_TOKENS_GQA = 16384
AUTOGRAD_RESERVE_BYTES_AT_14336 = 2 * 1024**3  # 2 GiB for a BLOOM-176B-wide model, scaled by width
MAX_RETRY_DELAY_S = 60.0


@dataclass(frozen=True)
class PetalsPlacement:
    spans: tuple[Span | None, ...]  # aligned with the input servers
    order: tuple[int, ...]  # join order of the servers that hold blocks (= input order)
    block_throughput: tuple[float, ...]  # sum of the throughputs of the servers holding each block
    uncovered_blocks: tuple[int, ...]

    @property
    def feasible(self) -> bool:
        return not self.uncovered_blocks


def cache_bytes_per_block(model: ModelSpec) -> float:
    """`2 * d_kv * attn_cache_tokens * dtype_bytes`: PETALS' fixed attention cache per hosted block."""
    kv_dim = model.kv_dim if model.kv_dim is not None else _hidden_size(model)
    tokens = ATTN_CACHE_TOKENS_GQA if kv_dim < _hidden_size(model) else ATTN_CACHE_TOKENS
    return 2 * kv_dim * tokens * model.dtype_bytes


def autograd_reserve_bytes(model: ModelSpec) -> float:
    return AUTOGRAD_RESERVE_BYTES_AT_14336 * _hidden_size(model) / 14336


def block_count(server: ServerSpec, model: ModelSpec) -> int:
    """`floor((M_j - autograd_reserve) / (s_m + cache_bytes_per_block))`, at most L and never negative."""
    usable = server.memory_bytes - autograd_reserve_bytes(model)
    count = floor_ratio(usable, model.block_bytes + cache_bytes_per_block(model))
    return max(min(count, model.num_blocks), 0)


def throughput(server: ServerSpec, num_blocks: int) -> float:
    """`min(forward_rps / ((m_j + 1)/2), network_rps)`: PETALS' announced server throughput."""
    forward_rps = server.forward_rps if server.forward_rps is not None else _rate(server.tau)
    network_rps = server.network_rps if server.network_rps is not None else math.inf
    return min(forward_rps / ((num_blocks + 1) / 2), network_rps)


def place(servers: Sequence[ServerSpec], model: ModelSpec) -> PetalsPlacement:
    """Servers join one by one in input order, each on the least-served window (docs/reference.md 3.3)."""
    block_throughput = np.zeros(model.num_blocks)
    spans: list[Span | None] = [None] * len(servers)
    order = []
    for j, server in enumerate(servers):
        count = block_count(server, model)
        if count == 0:
            continue
        start = lexicographic_min_window(block_throughput, count)
        block_throughput[start : start + count] += throughput(server, count)
        spans[j] = Span(start, start + count)
        order.append(j)
    uncovered = tuple(uncovered_blocks(spans, model.num_blocks))
    return PetalsPlacement(tuple(spans), tuple(order), tuple(float(t) for t in block_throughput), uncovered)


def cache_capacity_slots(server: ServerSpec, model: ModelSpec, num_blocks: int) -> int:
    """Sessions' cache slots (units of `s_c`) that fit PETALS' fixed cache on `num_blocks` blocks."""
    if model.hidden_size is None:
        return cache_slots(server, model, num_blocks)
    return floor_ratio(num_blocks * cache_bytes_per_block(model), model.cache_bytes)


def route(
    servers: Sequence[ServerSpec],
    model: ModelSpec,
    placement: Placement,
    client: str,
    used_slots: Sequence[int],
) -> Chain | None:
    """PETALS' Dijkstra (docs/reference.md 3.3): per hop `rtt/2 + 0.018 s + q/inference_rps` (+10 s without
    cache room).

    `used_slots[j]` counts the cache slots active sessions hold at server j. Servers without an
    RTT to `client` are unreachable. Returns None when no chain covers the model.
    """
    graph = RoutingGraph(placement, model.num_blocks)
    per_server_rtt = np.array([s.rtt.get(client, math.inf) for s in servers], dtype=float)
    per_block_time = np.array([_per_block_time(s) for s in servers], dtype=float)
    free_slots = np.array(
        [
            cache_capacity_slots(s, model, span.length if span else 0) - used
            for s, span, used in zip(servers, placement, used_slots, strict=True)
        ],
        dtype=np.int64,
    )
    links, blocks = graph.link_server, graph.link_blocks
    cost = per_server_rtt[links] / 2 + HOP_OVERHEAD_S + blocks * per_block_time[links]
    cost = cost + np.where(free_slots[links] < blocks, NO_CACHE_ROOM_PENALTY_S, 0.0)
    return graph.shortest_chain(cost)


def retry_delay(attempt: int) -> float:
    """Client backoff before retry number `attempt` (1-based): `min(1 s * 2^(n-1), 60 s)`."""
    if attempt < 1:
        raise ValueError(f"attempt numbers start at 1, got {attempt}")
    return min(2.0 ** min(attempt - 1, 64), MAX_RETRY_DELAY_S)  # the cap also avoids float overflow


def _per_block_time(server: ServerSpec) -> float:
    if server.inference_rps is not None:
        return 1 / server.inference_rps
    return server.tau


def _rate(seconds: float | None) -> float:
    if seconds is None:
        raise ValueError("PETALS throughput needs tau (or forward_rps)")
    return math.inf if seconds == 0 else 1 / seconds


def _hidden_size(model: ModelSpec) -> int:
    if model.hidden_size is None:
        raise ValueError("the PETALS block count needs model.hidden_size")
    return model.hidden_size
