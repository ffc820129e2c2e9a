"""The performance and memory model of docs/reference.md section 2 (Sun et al., section 2.2).

Pure arithmetic: no torch modules are built here and nothing touches the network, so the
scheduler, the simulator and the servers all share one definition of every formula.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch costs seconds to import; the planning tools never need it
    import torch


def dtype_bytes(dtype: torch.dtype) -> int:
    """Bytes per element of a torch dtype."""
    return dtype.itemsize


def kv_dim(hidden_size: int, num_attention_heads: int, num_key_value_heads: int | None = None) -> int:
    """Width `d_kv` of one cached key (or value) vector.

    Multi-head attention caches the full hidden size; grouped-query attention caches only
    `num_key_value_heads * head_dim`, which is what makes GQA models cheap to serve.
    """
    if num_key_value_heads is None or num_key_value_heads == num_attention_heads:
        return hidden_size
    head_dim = hidden_size // num_attention_heads
    return num_key_value_heads * head_dim


def cache_bytes_per_block(d_kv: int, num_tokens: int, bytes_per_element: int) -> int:
    """`s_c = 2 * d_kv * (l_in + l_out) * dtype_bytes` for one session in one block.

    `num_tokens` is `l_in + l_out` (or a session's `max_length`); the factor 2 is keys + values.
    Multiply by the batch size for a batched session.
    """
    if d_kv <= 0 or num_tokens < 0 or bytes_per_element <= 0:
        raise ValueError(
            f"invalid cache size arguments: d_kv={d_kv} tokens={num_tokens} bytes={bytes_per_element}"
        )
    return 2 * d_kv * num_tokens * bytes_per_element


# positions a sliding-window block keeps beyond the `window - 1` a new query can still see, so that a
# step may overwrite its last positions (a speculative round, a retried step)
REWIND_RESERVE = 64


def ring_capacity(window: int | None, max_length: int) -> int:
    """Positions a block of attention `window` (None: the whole prefix) keeps for a session of
    `max_length` positions."""
    return max_length if window is None else min(max_length, window - 1 + REWIND_RESERVE)


def cached_positions(block_windows: Sequence[int | None], first: int, last: int, num_tokens: int) -> int:
    """Positions blocks `[first, last)` keep together for a session of `num_tokens` positions: a block
    of sliding attention its ring, the others every position. `block_windows`: each block's window
    (None: full attention); blocks past its end attend fully (what a reader without the config knows)."""
    return sum(
        ring_capacity(block_windows[index] if index < len(block_windows) else None, num_tokens)
        for index in range(first, last)
    )


def module_parameter_bytes(module: torch.nn.Module) -> int:
    """`s_m`: the bytes of a loaded block's parameters, as they sit in memory (after any quantization:
    packed weights plus their scales)."""
    from llm_swarm.swarm.quantization import quantization_state_bytes

    return sum(p.numel() * p.element_size() + quantization_state_bytes(p) for p in module.parameters())


def cache_slots(memory_bytes: float, block_bytes: float, num_blocks: int, cache_bytes: float) -> int:
    """Cache slots `n_j = floor((M_j - s_m*m_j) / s_c)`: how many (session, block) caches fit."""
    free = memory_bytes - block_bytes * num_blocks
    if free <= 0:
        return 0
    return math.floor(free / cache_bytes)


@dataclass(frozen=True)
class HopCost:
    """One server on a request's chain, as eq. 1 sees it."""

    rtt: float  # t_cj: per-token round trip client <-> server, seconds
    rtt_prefill: float  # t_prefill_cj(l_in): round trip of the whole input sequence, seconds
    tau: float  # per-block, per-token decode time, seconds
    tau_prefill: float  # per-block prefill time for l_in tokens, seconds
    num_blocks: int  # k_j: blocks this server processes for the request


def request_time(hops: Iterable[HopCost], l_out: int) -> float:
    """Eq. 1: total time of a request through a chain.

    `sum_j (t_prefill_cj + k_j*tau_prefill_j) + (l_out - 1) * sum_j (t_cj + k_j*tau_j)`.
    """
    if l_out < 1:
        raise ValueError(f"l_out must be >= 1, got {l_out}")
    hops = list(hops)
    prefill = sum(h.rtt_prefill + h.num_blocks * h.tau_prefill for h in hops)
    decode = sum(h.rtt + h.num_blocks * h.tau for h in hops)
    return prefill + (l_out - 1) * decode


def link_time_all_tokens(hop: HopCost, l_out: int) -> float:
    """`l_out * t^c_ij` with `t^c_ij` the all-token average of eq. 8: one hop's share of eq. 1."""
    return request_time([hop], l_out)


def per_token_time(hops: Iterable[HopCost], l_out: int) -> float:
    """Eq. 1 divided by `l_out`: Sun et al.'s primary metric for one request."""
    return request_time(hops, l_out) / l_out
