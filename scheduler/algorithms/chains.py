"""Server chain composition: GBP-CR block placement and GCA cache allocation (Sun, He and Hou, Alg. 1-2;
docs/reference.md 3.4).

Sun, He and Hou's servers are described by `tau_c` (communication time per request) and `tau_p`
(computation time per block per request); a chain's mean service time is eq. 2,
`T_k = sum over hops (tau_c_j + tau_p_j * q_ij)`.
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
    floor_ratio,
    placement_cache_slots,
)
from llm_swarm.scheduler.algorithms.routing_graph import ChainHop, RoutingGraph

DEFAULT_RHO_BAR = 0.7  # Sun, He and Hou, section 4.1: target maximum load


@dataclass(frozen=True)
class GbpCrPlacement:
    """A GBP-CR placement; `spans` is aligned with the input servers (None = no blocks)."""

    spans: tuple[Span | None, ...]
    order: tuple[int, ...]  # servers that received blocks, in placement order
    chains: tuple[tuple[int, ...], ...]  # the completed disjoint chains, servers in block order
    rate_met: bool  # the chains reach the required scaled service rate lambda/(rho_bar*c)


@dataclass(frozen=True)
class ServerChain:
    """A composed "job server" (Sun, He and Hou, section 2.2): a chain, blocks per hop, capacity,
    service time."""

    servers: tuple[int, ...]
    blocks: tuple[int, ...]  # q per hop
    capacity: int  # c_k: jobs it runs concurrently
    service_time: float  # T_k, eq. 2

    @property
    def service_rate(self) -> float:
        """`mu_k = 1/T_k`."""
        return math.inf if self.service_time == 0 else 1 / self.service_time


def request_times(
    rtt_prefill: float, rtt: float, tau_prefill: float, tau: float, l_out: int
) -> tuple[float, float]:
    """Sun, He and Hou's `(tau_c, tau_p)` from Sun et al.'s per-token times, so that a chain's eq. 2 time
    is exactly eq. 1's for a request of `l_out` tokens."""
    return rtt_prefill + (l_out - 1) * rtt, tau_prefill + (l_out - 1) * tau


def reserved_block_count(server: ServerSpec, model: ModelSpec, capacity: int) -> int:
    """Eq. 8: `m_j(c) = min(floor(M_j / (s_m + s_c*c)), L)`, reserving c cache slots per block."""
    per_block = model.block_bytes + model.cache_bytes * capacity
    return max(min(floor_ratio(server.memory_bytes, per_block), model.num_blocks), 0)


def hop_time(server: ServerSpec, blocks: int | np.ndarray) -> float | np.ndarray:
    """`tau_c_j + tau_p_j * q`: a server's share of a chain's service time (eq. 2, eq. 9)."""
    return server.tau_c + server.tau_p * blocks


def gbp_cr(
    servers: Sequence[ServerSpec],
    model: ModelSpec,
    capacity: int,
    arrival_rate: float | None = None,
    rho_bar: float = DEFAULT_RHO_BAR,
) -> GbpCrPlacement:
    """GBP-CR for required capacity `c` (docs/reference.md 3.4). Without an arrival rate every server is used.

    Servers, fastest amortized time `t_j(c)/m_j(c)` first, fill chains left to right; the last
    server of a chain is shifted back to keep its full `m_j` (overlapping its predecessor). Chains
    stop once `nu = sum 1/T >= lambda/(rho_bar*c)`; an unfinished last chain keeps its servers.
    """
    if capacity < 1:
        raise ValueError(f"capacity c must be >= 1, got {capacity}")
    if any(server.tau_c is None or server.tau_p is None for server in servers):
        raise ValueError("GBP-CR needs tau_c and tau_p for every server")
    num_blocks = model.num_blocks
    counts = [reserved_block_count(server, model, capacity) for server in servers]
    hosts = [j for j, count in enumerate(counts) if count > 0]
    times = {j: hop_time(servers[j], counts[j]) for j in hosts}
    order = sorted(hosts, key=lambda j: times[j] / counts[j])  # stable
    required_rate = math.inf if arrival_rate is None else arrival_rate / (rho_bar * capacity)

    spans: list[Span | None] = [None] * len(servers)
    placed: list[int] = []
    chains: list[tuple[int, ...]] = []
    cursor, chain_time, rate = 0, 0.0, 0.0  # a, T, nu of Alg. 1 (0-based cursor)
    chain: list[int] = []
    for j in order:
        count = counts[j]
        start = min(cursor, num_blocks - count)
        spans[j] = Span(start, start + count)
        placed.append(j)
        chain.append(j)
        chain_time += times[j]
        cursor = min(cursor + count - 1, num_blocks - 1) + 1
        if cursor > num_blocks - 1:
            chains.append(tuple(chain))
            rate += math.inf if chain_time == 0 else 1 / chain_time
            if rate >= required_rate:
                break
            cursor, chain_time, chain = 0, 0.0, []
    return GbpCrPlacement(tuple(spans), tuple(placed), tuple(chains), rate >= required_rate)


def gca(servers: Sequence[ServerSpec], model: ModelSpec, placement: Placement) -> tuple[ServerChain, ...]:
    """Greedy Cache Allocation (Sun, He and Hou, Alg. 2; docs/reference.md 3.4) on any placement.

    Repeatedly take the fastest chain among links (i, j) whose server j still has `q_ij` free slots,
    give it as many concurrent jobs as its tightest hop allows, and charge the slots. A link is
    usable exactly while `residual_j >= q_ij` (docs/reference.md 3.4: "usable only while"); dropping
    exhausted links as soon as they are exhausted, rather than after a zero-capacity path exposes
    them, yields the same chains, since a zero-capacity path only ever removes links no
    positive-capacity chain could use.
    """
    graph = RoutingGraph(placement, model.num_blocks)
    residual = np.array(placement_cache_slots(servers, model, placement), dtype=np.int64)
    links, blocks = graph.link_server, graph.link_blocks
    tau_c = np.array([s.tau_c if s.tau_c is not None else math.nan for s in servers])
    tau_p = np.array([s.tau_p if s.tau_p is not None else math.nan for s in servers])
    if len(links) and np.isnan(tau_c[links] + tau_p[links]).any():
        raise ValueError("GCA needs tau_c and tau_p for every server holding blocks")
    link_time = tau_c[links] + tau_p[links] * blocks
    usable = residual[links] >= blocks

    chains: list[ServerChain] = []
    while True:
        chain = graph.shortest_chain(np.where(usable, link_time, math.inf))
        if chain is None:
            break
        capacity = min(int(residual[hop.server]) // hop.num_blocks for hop in chain.hops)
        for hop in chain.hops:
            residual[hop.server] -= hop.num_blocks * capacity
            server_links = graph.server_links(hop.server)
            usable[server_links] &= residual[hop.server] >= blocks[server_links]
        chains.append(
            ServerChain(
                tuple(hop.server for hop in chain.hops),
                tuple(hop.num_blocks for hop in chain.hops),
                capacity,
                chain.cost,
            )
        )
    return tuple(chains)


def chain_hops(chain: ServerChain, spans: Sequence[Span | None]) -> tuple[ChainHop, ...]:
    """A GCA chain as hops: each server processes the `q` blocks ending at its span's end."""
    hops = []
    for server, blocks in zip(chain.servers, chain.blocks, strict=True):
        end = spans[server].end
        hops.append(ChainHop(server, end - blocks, end))
    return tuple(hops)
