"""CG-BP: Conservative Greedy Block Placement (Sun et al., Alg. 1 lines 1-8; docs/reference.md 3.1).

CG-BP sizes every server for the worst case of `R` concurrent sessions each using all of its blocks
(so memory never runs out while at most R sessions are active, eq. 6b), then hands out block ranges
fastest server first (amortized time eq. 14), each to the blocks that "need service the most".

Choosing R (docs/reference.md 3.1, Sun et al., section 3.3.1) needs the service time `T1` of one request under
CG-BP with R = 1. The paper leaves the client and the output length open; we take the per-request time
of eq. 1 over the WS-RR shortest route (no other session), for the *slowest* client, i.e. the
client the placement is made robust for, with the caller's `l_out`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from llm_swarm.scheduler.algorithms.problem import ModelSpec, ServerSpec, Span, floor_ratio
from llm_swarm.scheduler.algorithms.windows import lexicographic_min_window, max_sum_window
from llm_swarm.scheduler.algorithms.wsrr import RoutingState


@dataclass(frozen=True)
class CgBpResult:
    """A CG-BP placement; `spans` is aligned with the input servers (None = no blocks)."""

    spans: tuple[Span | None, ...]
    num_requests: int  # R
    order: tuple[int, ...]  # servers that received blocks, in placement order (increasing tt_j)
    block_capacity: tuple[int, ...]  # C_b: total f_j of the servers holding block b
    uncovered_blocks: tuple[int, ...]  # blocks with C_b < R (empty iff feasible, step 5)
    bound: float | None  # eq. 17 guaranteed per-token time; None when infeasible

    @property
    def feasible(self) -> bool:
        return not self.uncovered_blocks


def conservative_block_count(server: ServerSpec, model: ModelSpec, num_requests: int) -> int:
    """Step 1: `m_j = min(floor(M_j / (s_m + s_c*R)), L)`, room for R sessions on every block."""
    per_block = model.block_bytes + model.cache_bytes * num_requests
    return max(min(floor_ratio(server.memory_bytes, per_block), model.num_blocks), 0)


def amortized_time(server: ServerSpec, num_blocks: int) -> float:
    """Eq. 14: `tt_j = tau_j + t*_j / m_j`, the worst client's per-token time per hosted block."""
    return server.tau + server.worst_rtt() / num_blocks


def session_capacity(server: ServerSpec, model: ModelSpec, num_blocks: int) -> int:
    """Eq. 15: `f_j = floor((M_j - s_m*m_j) / (s_c*m_j))` sessions using all m_j blocks (>= R by step 1)."""
    return floor_ratio(server.memory_bytes - model.block_bytes * num_blocks, model.cache_bytes * num_blocks)


def cg_bp(servers: Sequence[ServerSpec], model: ModelSpec, num_requests: int) -> CgBpResult:
    """Run CG-BP for `R = num_requests` (docs/reference.md 3.1 steps 1-6). Servers need `tau` and `rtt`."""
    if num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests}")
    if any(server.tau is None for server in servers):
        raise ValueError("CG-BP needs tau for every server")
    num_blocks = model.num_blocks
    block_counts = [conservative_block_count(server, model, num_requests) for server in servers]
    hosts = [j for j, count in enumerate(block_counts) if count > 0]
    amortized = {j: amortized_time(servers[j], block_counts[j]) for j in hosts}
    order = sorted(hosts, key=amortized.__getitem__)  # stable: ties keep input order

    # Step 3: a dummy server 0, slower than all, initially serves every block for all R requests.
    dummy_time = max(amortized.values(), default=0.0) + 1.0
    capacity = np.zeros(num_blocks, dtype=np.int64)  # C_b
    total_time = np.full(num_blocks, dummy_time * num_requests)  # T_b

    spans: list[Span | None] = [None] * len(servers)
    covered_after: int | None = None  # K - 1: position in `order` after which every C_b >= R
    for position, j in enumerate(order):
        width = block_counts[j]
        underserved = capacity < num_requests
        if underserved.any():
            start = max_sum_window(total_time, width, underserved)
        else:
            start = lexicographic_min_window(capacity, width)
        window = slice(start, start + width)
        sessions = session_capacity(servers[j], model, width)
        # Step 4: requests the dummy still serves on these blocks move to j, at most f_j of them.
        total_time[window] -= (dummy_time - amortized[j]) * np.minimum(
            np.maximum(num_requests - capacity[window], 0), sessions
        )
        capacity[window] += sessions
        spans[j] = Span(start, start + width)
        if covered_after is None and not (capacity < num_requests).any():
            covered_after = position

    uncovered = tuple(int(b) for b in np.flatnonzero(capacity < num_requests))
    bound = None
    if covered_after is not None:
        first_k = order[: covered_after + 1]
        bound = guaranteed_per_token_time(
            [servers[j] for j in first_k], [block_counts[j] for j in first_k], num_blocks
        )
    return CgBpResult(
        tuple(spans), num_requests, tuple(order), tuple(int(c) for c in capacity), uncovered, bound
    )


def guaranteed_per_token_time(
    first_servers: Sequence[ServerSpec], block_counts: Sequence[int], num_blocks: int
) -> float:
    """Eq. 17 over servers 1..K in placement order: `sum (tau_j*m_j + t*_j) - tau_K*(sum m_j - L)`.

    The per-token time of the chain 1..K for the client farthest from every server; the last server
    only processes the blocks its predecessors left, hence the subtracted overlap.
    """
    total = sum(
        server.tau * count + server.worst_rtt()
        for server, count in zip(first_servers, block_counts, strict=True)
    )
    return total - first_servers[-1].tau * (sum(block_counts) - num_blocks)


def max_requests(servers: Sequence[ServerSpec], model: ModelSpec) -> int:
    """Eq. 19: `R <= floor((sum_j M_j - s_m*(L + J)) / (s_c*(L + J)))`, enough for eq. 18 to hold."""
    nodes = model.num_blocks + len(servers)
    total_memory = sum(server.memory_bytes for server in servers)
    return floor_ratio(total_memory - model.block_bytes * nodes, model.cache_bytes * nodes)


def choose_num_requests(
    servers: Sequence[ServerSpec], model: ModelSpec, arrival_rate: float, l_out: int
) -> int | None:
    """Default R (docs/reference.md 3.1): `min(round(mean + std), R_max)`, Poisson `mean = lambda*T1`,
    `std = sqrt(mean)`.

    T1 is one request's eq. 1 time under CG-BP with R = 1 on its shortest route, for the slowest
    client (module docstring). Servers need `tau_prefill` and `rtt_prefill` as well. Returns None
    when even R = 1 cannot be placed, so T1 does not exist. The result is at least 1.
    """
    single = cg_bp(servers, model, 1)
    if not single.feasible:
        return None
    service_time = slowest_client_request_time(servers, model, single.spans, l_out)
    if not math.isfinite(service_time):
        return None
    mean = arrival_rate * service_time
    return max(min(round(mean + math.sqrt(mean)), max_requests(servers, model)), 1)


def slowest_client_request_time(
    servers: Sequence[ServerSpec], model: ModelSpec, spans: Sequence[Span | None], l_out: int
) -> float:
    """Eq. 1 time of the shortest route of the worst-off client (inf if one cannot be served)."""
    state = RoutingState(servers, model, spans)
    clients = sorted({client for server in servers for client in server.rtt})
    times = []
    for client in clients:
        route = state.route(client, l_out)
        times.append(route.completion if route is not None else math.inf)
    return max(times, default=math.inf)
