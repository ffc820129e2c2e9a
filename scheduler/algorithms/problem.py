"""Inputs and outputs shared by the placement and routing algorithms (docs/reference.md sections 2 and 3).

Plain data: nothing here parses JSON or does I/O (that is `scheduler.plan.problem_io`). Units are seconds
and bytes; block spans are 0-based and half-open, `[start, end)`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field


def floor_ratio(numerator: float, denominator: float) -> int:
    """`floor(numerator / denominator)` as the memory formulas of docs/reference.md 2-3 mean it.

    Deliberately `math.floor(a / b)` and not `a // b`: for decimal inputs Python's float `//`
    floors the exact binary quotient, so `1.0 // 0.1 == 9.0`, while the formulas (and Sun, He and Hou,
    Fig. 2: 10 cache slots from 1 unit of memory at s_c = 0.1) mean the real quotient, 10.
    For the integer byte counts of real deployments both agree.
    """
    if denominator <= 0:
        raise ValueError(f"denominator must be positive, got {denominator}")
    return math.floor(numerator / denominator)


@dataclass(frozen=True)
class ModelSpec:
    """The served model: `L` blocks of `s_m` bytes, `s_c` cache bytes per block per session."""

    num_blocks: int  # L
    block_bytes: float  # s_m
    cache_bytes: float  # s_c = 2 * d_kv * (l_in + l_out) * dtype_bytes (swarm.cost.cache_bytes_per_block)
    # Only the PETALS baseline (docs/reference.md 3.3) needs these: its block count reserves memory for a
    # fixed-size attention cache and an autograd buffer that scale with the model's width.
    hidden_size: int | None = None
    kv_dim: int | None = None  # d_kv; None means multi-head attention (d_kv = hidden_size)
    dtype_bytes: int = 2


@dataclass(frozen=True)
class ServerSpec:
    """One server as the scheduler sees it (docs/reference.md 2; tau_c/tau_p: Sun, He and Hou, section 2.1).

    Every algorithm reads only the fields it needs; `plan_io` checks those are present.
    """

    name: str
    memory_bytes: float  # M_j, the effective memory budget
    tau: float | None = None  # per-block, per-token decode time
    tau_prefill: float | None = None  # per-block prefill time for l_in tokens
    rtt: Mapping[str, float] = field(default_factory=dict)  # client -> per-token round trip t_cj
    rtt_prefill: Mapping[str, float] = field(default_factory=dict)  # client -> t_prefill_cj(l_in)
    tau_c: float | None = None  # Sun, He and Hou: communication time per request
    tau_p: float | None = None  # Sun, He and Hou: computation time per block per request
    # PETALS' own measurements (docs/reference.md 3.3); defaults derived from tau are documented in petals.py.
    forward_rps: float | None = None
    network_rps: float | None = None
    inference_rps: float | None = None
    # What each other session decoding on the server at the same time adds to `tau` (seconds per
    # block per token, measured by the server: `server.decode_load`); None: nothing (Sun et al.'s
    # model, where a server's per-token time does not depend on its load)
    tau_per_session: float | None = None

    def worst_rtt(self) -> float:
        """`t*_j = max_c t_cj` (eq. 14): the farthest client's per-token round trip (0 if none known)."""
        return max(self.rtt.values(), default=0.0)


@dataclass(frozen=True)
class Span:
    """A consecutive range of blocks `[start, end)` held (or processed) by one server."""

    start: int
    end: int

    def __post_init__(self) -> None:
        if not 0 <= self.start < self.end:
            raise ValueError(f"invalid span [{self.start}, {self.end})")

    @property
    def length(self) -> int:
        return self.end - self.start


# A block placement: one entry per server, in the order of the server list; None = no blocks.
Placement = Sequence[Span | None]


def cache_slots(server: ServerSpec, model: ModelSpec, num_blocks: int) -> int:
    """Cache slots `n_j = floor((M_j - s_m*m_j) / s_c)` (docs/reference.md 3.2; Sun, He and Hou, eq. 3), never
    negative."""
    return max(floor_ratio(server.memory_bytes - model.block_bytes * num_blocks, model.cache_bytes), 0)


def placement_cache_slots(servers: Sequence[ServerSpec], model: ModelSpec, placement: Placement) -> list[int]:
    """`n_j` of every server under a placement (a server without blocks keeps all its memory)."""
    return [
        cache_slots(server, model, span.length if span else 0)
        for server, span in zip(servers, placement, strict=True)
    ]


def uncovered_blocks(placement: Placement, num_blocks: int) -> list[int]:
    """Blocks that no span of the placement holds: why a placement is infeasible
    (docs/reference.md 3.1 step 5)."""
    covered = [False] * num_blocks
    for span in placement:
        if span is not None:
            for block in range(span.start, min(span.end, num_blocks)):
                covered[block] = True
    return [block for block, is_covered in enumerate(covered) if not is_covered]
