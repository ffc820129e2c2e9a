"""Client-side routing without a scheduler: the chain of servers with the least eq. 1 time.

Pure: takes what the DHT and RTT probes said, returns hops. The graph and its shortest path are the
scheduler's (`scheduler.algorithms.routing_graph`), with link costs of eq. 8 times `l_out`; a link
into a server without cache room for the blocks it would process is removed (docs/reference.md section 2).
Routing a sub-range `[start, end)` (to replace a failed server) clips every span to that range,
which our servers allow because a session may ask any server for any blocks inside its span.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence, Set
from dataclasses import dataclass

import numpy as np

from llm_swarm.scheduler.algorithms.chain_cost import announced_server_rtts, pushed_handover
from llm_swarm.scheduler.algorithms.problem import Span
from llm_swarm.scheduler.algorithms.routing_graph import RoutingGraph
from llm_swarm.scheduler.algorithms.wsrr import link_request_time
from llm_swarm.swarm.cost import cached_positions
from llm_swarm.swarm.route_request import RouteHop, SessionShape
from llm_swarm.swarm.server_info import ServerInfo


@dataclass(frozen=True)
class Candidate:
    peer_id: str
    info: ServerInfo
    rtt: float  # measured per-token round trip, seconds


def _usable(candidate: Candidate, start: int, end: int) -> bool:
    info = candidate.info
    return (
        info.routable
        and info.has_blocks
        and info.tau is not None
        and info.start < end
        and info.end > start
        and info.max_length >= 1
    )


def probe_shortlist(
    servers: Mapping[str, ServerInfo],
    measured: Mapping[str, float],
    start: int,
    end: int,
    per_block: int,
    live: Set[str] = frozenset(),
) -> list[str]:
    """The servers worth pinging (or reusing a cached ping of) to route blocks `[start, end)`, so
    that a client's routing work does not grow with the swarm: for each block, `per_block` servers
    holding it. Servers already measured come first, best estimated time first (cached round trip
    plus announced decode time: free to reuse), then unmeasured ones: the `live` ones first (they
    answered this client's DHT node or its p2p daemon connected to them, while a record of a peer
    that is gone costs a slow failed lookup), then by announced promise (cache room first, then the
    fastest `tau`, then peer id, so repeated calls ask the same servers).
    When no chain forms among them the caller widens `per_block`; with `per_block >= len(servers)`
    this is every server holding a block of the range."""
    holders: dict[int, list[tuple]] = {}
    for peer, info in servers.items():
        if not info.has_blocks:
            continue
        tau = info.tau if info.tau is not None else math.inf
        if peer in measured:
            rank = (0, measured[peer] + tau * info.num_blocks, peer)
        else:
            rank = (1, (peer not in live, info.cache_bytes_left <= 0, tau), peer)
        for block in range(max(info.start, start), min(info.end, end)):
            holders.setdefault(block, []).append(rank)
    chosen: set[str] = set()
    for ranks in holders.values():
        ranks.sort()
        chosen.update(rank[2] for rank in ranks[:per_block])
    return sorted(chosen)


def choose_chain(
    candidates: list[Candidate],
    start: int,
    end: int,
    shape: SessionShape,
    need_cache_room: bool = True,
    prefill_servers: Mapping[str, ServerInfo] | None = None,
    block_windows: Sequence[int | None] = (),
    pushed: bool = False,
) -> list[RouteHop] | None:
    """Fastest chain covering blocks `[start, end)`, or None if none exists (with cache room, if asked).
    `prefill_servers`: `--role prefill` servers the session's prompts may run on; a server whose
    blocks one of them holds is priced with the faster of the two prefills, since the prompt goes
    there (as the scheduler's WS-RR prices it: `SwarmView.routing_specs`). `block_windows`: each
    block's sliding window (None: full attention), so a sliding block's room is counted for its ring.
    `pushed`: a chain session, priced with what its servers announce of their round trips to the
    servers after them (`chain_cost.pushed_handover`) instead of eq. 1's round trip per hop."""
    usable = [c for c in candidates if _usable(c, start, end) and c.info.max_length >= shape.max_length]
    if not usable:
        return None
    placement = [Span(max(c.info.start, start) - start, min(c.info.end, end) - start) for c in usable]
    graph = RoutingGraph(placement, end - start)
    servers = graph.link_server
    blocks = graph.link_blocks
    rtt = np.array([usable[j].rtt for j in servers], dtype=float)
    tau = np.array([_loaded_tau(usable[j].info) for j in servers], dtype=float)
    prefill = [_routed_prefill(c, start, end, shape.l_in, prefill_servers or {}) for c in usable]
    tau_prefill = np.array([prefill[j] for j in servers], dtype=float)
    hop_rtt = np.zeros_like(rtt) if pushed else rtt  # a pushed chain prices its hand-overs apart
    cost = link_request_time(hop_rtt, tau_prefill, hop_rtt, tau, blocks.astype(float), shape.l_out)
    if need_cache_room:
        positions = [
            cached_positions(block_windows, start + first, start + first + count, shape.max_length)
            for first, count in zip(graph.link_from.tolist(), blocks.tolist(), strict=True)
        ]
        needed = (
            np.array([usable[j].info.cache_token_bytes for j in servers])
            * np.array(positions)
            * shape.batch_size
        )
        room = np.array([usable[j].info.cache_bytes_left for j in servers])
        cost = np.where(needed <= room, cost, math.inf)
    if pushed:
        handover, exit_cost = pushed_handover(
            np.array([c.rtt for c in usable]),
            announced_server_rtts([c.peer_id for c in usable], {c.peer_id: c.info for c in usable}),
            shape.l_out,
        )
        chain = graph.shortest_pushed_chain(cost, handover, exit_cost)
    else:
        chain = graph.shortest_chain(cost)
    if chain is None:
        return None
    return [RouteHop(usable[hop.server].peer_id, hop.start + start, hop.end + start) for hop in chain.hops]


def _routed_prefill(
    candidate: Candidate, start: int, end: int, l_in: int, prefill_servers: Mapping[str, ServerInfo]
) -> float:
    """Per-block prefill time of the candidate's prompts: its own, or a prefill server's that holds
    its blocks of `[start, end)` and is faster (the hand-off's transfer is the per-session rule's)."""
    first, last = max(candidate.info.start, start), min(candidate.info.end, end)
    own = _prefill_time(candidate.info, l_in)
    elsewhere = [
        _prefill_time(info, l_in)
        for info in prefill_servers.values()
        if info.has_blocks and info.start <= first and last <= info.end
    ]
    return min([own, *elsewhere])


def _loaded_tau(info: ServerInfo) -> float:
    """Per-block decode time with the sessions the server announces open, each adding the
    slowdown it measured (`server.decode_load`; the scheduler's WS-RR counts the same way)."""
    return (info.tau or 0.0) + (info.tau_per_session or 0.0) * info.active_sessions


def _prefill_time(info: ServerInfo, l_in: int) -> float:
    """Per-block prefill time for `l_in` tokens, scaled from the announced measurement."""
    if info.tau_prefill is None or info.prefill_tokens <= 0:
        return (info.tau or 0.0) * l_in
    return info.tau_prefill * l_in / info.prefill_tokens


def uncovered_blocks(candidates: list[Candidate], start: int, end: int) -> list[int]:
    """Blocks of `[start, end)` that no online server holds."""
    covered = np.zeros(end - start, dtype=bool)
    for candidate in candidates:
        if _usable(candidate, start, end):
            covered[max(candidate.info.start, start) - start : min(candidate.info.end, end) - start] = True
    return [start + int(block) for block in np.flatnonzero(~covered)]


def chain_problem(hops: list[RouteHop], servers: Mapping[str, ServerInfo], num_blocks: int) -> str | None:
    """Why a chain someone else chose (the scheduler) cannot be right, or None if it can: it must
    cover blocks 0..L-1 in order, each hop inside the span that server's validated record holds."""
    if not hops:
        return "an empty chain"
    position = 0
    for hop in hops:
        info = servers.get(hop.peer_id)
        if hop.start != position or hop.end <= hop.start:
            return f"hop {hop.peer_id[-8:]}[{hop.start}:{hop.end}] does not continue at block {position}"
        if info is None or not info.routable or not info.has_blocks:
            return f"{hop.peer_id[-8:]} is not an online server of this model that clients can reach"
        if not info.start <= hop.start < hop.end <= info.end:
            return f"{hop.peer_id[-8:]} holds {info.start}:{info.end}, not {hop.start}:{hop.end}"
        position = hop.end
    if position != num_blocks:
        return f"the chain ends at block {position} of {num_blocks}"
    return None
