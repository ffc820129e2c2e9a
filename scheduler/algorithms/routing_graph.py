"""The feasible routing topology of a placement and its shortest client -> client path.

Sun et al. (Alg. 1 line 9, Alg. 2) and Sun, He and Hou (Alg. 2) route over a graph whose nodes are the
servers plus a source and a sink client, with a link (i, j) wherever Lemma 3.1 allows it. That graph
has O(J^2) links, but every link cost we use (WS-RR eq. 20 + eq. 8, PETALS' weights, GCA's
`tau_c + tau_p*q`) depends on the predecessor i only through `end_i`, since `q_ij = end_j - end_i`.
So a link is identified by (server j, boundary e = end_i), and there are only `sum_j m_j` of them:
`RoutingGraph` stores exactly those, grouped by `end_j`. Ends strictly increase along a chain, so
processing servers in increasing `end_j` is a topological order and one pass computes all distances.

The result equals Dijkstra's with the tie rules of docs/reference.md 3 (heap ordered by
(distance, server index), relaxation with strict `<`): a node's predecessor is, among those
reaching it at the minimal cost, the one Dijkstra pops first, i.e. the smallest (distance, index).
Path reconstruction applies that rule explicitly, so ties resolve as they would in the plain
algorithm (links of zero cost aside).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from llm_swarm.scheduler.algorithms.feasibility import CLIENT_END, predecessor_ends
from llm_swarm.scheduler.algorithms.problem import Placement

_CLIENT_INDEX = -1  # the source client sorts before every server on ties (it is the only end-0 node)


@dataclass(frozen=True)
class ChainHop:
    """One server on a chain and the blocks `[start, end)` it processes for the request."""

    server: int  # index into the server list the placement is aligned with
    start: int
    end: int

    @property
    def num_blocks(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class Chain:
    """A client -> client path: hops in order, and its total link cost."""

    hops: tuple[ChainHop, ...]
    cost: float


def chain_fits(hops: Sequence[ChainHop], free_slots: Sequence[int]) -> bool:
    """Whether every server on the chain has a free cache slot (`free_slots[server]`) per block it
    processes (eq. 2 once the request starts)."""
    return all(free_slots[hop.server] >= hop.num_blocks for hop in hops)


@dataclass(frozen=True)
class _EndGroup:
    """The links into servers whose span ends at `end`, laid out contiguously server by server."""

    end: int
    links: slice
    segment_starts: np.ndarray  # offsets (relative to `links.start`) where each server's links begin
    servers: np.ndarray  # those servers, in increasing index order


class RoutingGraph:
    """Links `(server j, predecessor end e)` of a placement, as flat arrays (see module docstring).

    Link k goes into server `link_server[k]` from boundary `link_from[k]`, so j processes
    `link_blocks[k]` blocks. Callers build a cost array aligned with these links (np.inf removes
    a link) and call `shortest_chain`.
    """

    def __init__(self, placement: Placement, num_blocks: int):
        self.num_blocks = num_blocks
        self.placement = tuple(placement)
        placed = [j for j, span in enumerate(self.placement) if span is not None]
        placed.sort(key=lambda j: (self.placement[j].end, j))

        servers: list[int] = []
        froms: list[int] = []
        self._first_link: dict[int, int] = {}
        for j in placed:
            self._first_link[j] = len(servers)
            ends = predecessor_ends(self.placement[j])
            servers.extend([j] * len(ends))
            froms.extend(ends)
        self.link_server = np.array(servers, dtype=np.int64)
        self.link_from = np.array(froms, dtype=np.int64)
        link_end = np.array([self.placement[j].end for j in servers], dtype=np.int64)
        self.link_blocks = link_end - self.link_from

        self._groups: list[_EndGroup] = []
        for end, members in itertools.groupby(placed, key=lambda j: self.placement[j].end):
            group = list(members)
            first = self._first_link[group[0]]
            last = self._first_link[group[-1]] + self.placement[group[-1]].length
            starts = np.array([self._first_link[j] - first for j in group], dtype=np.int64)
            self._groups.append(_EndGroup(end, slice(first, last), starts, np.array(group, dtype=np.int64)))
        self._group_by_end = {group.end: group for group in self._groups}

    @property
    def num_links(self) -> int:
        return len(self.link_server)

    def server_links(self, server: int) -> slice:
        """The contiguous range of link indices into `server` (empty if it holds no blocks)."""
        span = self.placement[server]
        if span is None:
            return slice(0, 0)
        first = self._first_link[server]
        return slice(first, first + span.length)

    def link_index(self, server: int, prev_end: int) -> int:
        """Index of the link into `server` from boundary `prev_end` (Lemma 3.1 must allow it)."""
        span = self.placement[server]
        return self._first_link[server] + (prev_end - span.start)

    def shortest_chain(self, link_cost: np.ndarray) -> Chain | None:
        """Shortest client -> client chain under `link_cost` (aligned with the links; inf = no link).

        The last hop into the sink client costs 0 (docs/reference.md 3.2). Returns None when no chain exists.
        """
        if len(link_cost) != self.num_links:
            raise ValueError(f"expected {self.num_links} link costs, got {len(link_cost)}")
        boundary_dist = np.full(self.num_blocks + 1, math.inf)  # best distance of any node ending there
        boundary_dist[CLIENT_END] = 0.0
        server_dist = np.full(len(self.placement), math.inf)
        for group in self._groups:
            candidates = boundary_dist[self.link_from[group.links]] + link_cost[group.links]
            best = np.minimum.reduceat(candidates, group.segment_starts)
            server_dist[group.servers] = best
            boundary_dist[group.end] = best.min()
        if not math.isfinite(boundary_dist[self.num_blocks]):
            return None
        return Chain(
            self._backtrack(link_cost, boundary_dist, server_dist), float(boundary_dist[self.num_blocks])
        )

    def shortest_pushed_chain(
        self, link_cost: np.ndarray, handover: np.ndarray, exit_cost: np.ndarray
    ) -> Chain | None:
        """Shortest chain when what a hop costs also depends on the hop before it: a chain session's
        token goes from one server straight to the next (docs/reference.md, "Chain sessions").

        `link_cost` is aligned with the links (the hop's own time: compute, queueing; inf = no link);
        `handover[i + 1, j]` is the time from server i to server j (row 0: from the client), and
        `exit_cost[j]` the time from j back to the client. A node is then a server rather than a
        boundary, so one pass over the servers in increasing `end_j` still computes every distance,
        in O(links x servers sharing an end). Ties go to the smaller (distance, predecessor index),
        the client first."""
        servers = len(self.placement)
        if len(link_cost) != self.num_links:
            raise ValueError(f"expected {self.num_links} link costs, got {len(link_cost)}")
        if handover.shape != (servers + 1, servers) or exit_cost.shape != (servers,):
            raise ValueError(f"expected a ({servers + 1}, {servers}) handover and {servers} exit costs")
        server_dist = np.full(servers, math.inf)
        entered_from: dict[int, tuple[int, int]] = {}  # server -> (predecessor or client, boundary)
        ending_at: dict[int, np.ndarray] = {}
        for group in self._groups:
            for j in group.servers.tolist():
                best = (math.inf, _CLIENT_INDEX, -1)
                for prev_end in predecessor_ends(self.placement[j]):
                    cost = link_cost[self.link_index(j, prev_end)]
                    if not math.isfinite(cost):
                        continue
                    if prev_end == CLIENT_END:
                        best = min(best, (handover[0, j] + cost, _CLIENT_INDEX, prev_end))
                    before = ending_at.get(prev_end)
                    if before is None or not len(before):
                        continue
                    arrivals = server_dist[before] + handover[before + 1, j]
                    k = int(np.argmin(arrivals))
                    best = min(best, (float(arrivals[k]) + cost, int(before[k]), prev_end))
                if math.isfinite(best[0]):
                    server_dist[j] = best[0]
                    entered_from[j] = (best[1], best[2])
            ending_at[group.end] = group.servers[np.isfinite(server_dist[group.servers])]
        last = ending_at.get(self.num_blocks)
        if last is None or not len(last):
            return None
        totals = server_dist[last] + exit_cost[last]
        server = int(last[int(np.argmin(totals))])
        total = float(totals.min())
        if not math.isfinite(total):
            return None
        hops: list[ChainHop] = []
        while server != _CLIENT_INDEX:
            predecessor, prev_end = entered_from[server]
            hops.append(ChainHop(server, prev_end, self.placement[server].end))
            server = predecessor
        return Chain(tuple(reversed(hops)), total)

    def _representative(self, end: int, boundary_dist: np.ndarray, server_dist: np.ndarray) -> int:
        """The node Dijkstra pops first among those ending at `end` with the best distance."""
        if end == CLIENT_END:
            return _CLIENT_INDEX
        group = self._group_by_end[end]
        return int(group.servers[np.argmax(server_dist[group.servers] == boundary_dist[end])])

    def _backtrack(
        self, link_cost: np.ndarray, boundary_dist: np.ndarray, server_dist: np.ndarray
    ) -> tuple[ChainHop, ...]:
        hops: list[ChainHop] = []
        server = self._representative(self.num_blocks, boundary_dist, server_dist)
        while server != _CLIENT_INDEX:
            span = self.placement[server]
            reaching = [
                (
                    boundary_dist[prev_end],
                    self._representative(prev_end, boundary_dist, server_dist),
                    prev_end,
                )
                for prev_end in predecessor_ends(span)
                if boundary_dist[prev_end] + link_cost[self.link_index(server, prev_end)]
                == server_dist[server]
            ]
            _, predecessor, prev_end = min(reaching)
            hops.append(ChainHop(server, prev_end, span.end))
            server = predecessor
        return tuple(reversed(hops))
