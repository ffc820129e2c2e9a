"""Disjoint chains through the model's blocks, and how fast each one runs a job. Pure.

A batch job keeps several chains busy at once, so it wants chains that share no server: a server
on two chains would serve both, and neither would run at the speed its plan assumed. The chains are
taken greedily, fastest first (the per-token time of eq. 1: round trip plus announced compute of
each hop), each one's servers then left out of the next; the routing graph is the scheduler's
(`scheduler.algorithms.routing_graph`), so a hop may enter a server's span part-way, as routing does.

A chain's job time is eq. 1 (`swarm.cost.request_time`) with the chain seen as one hop: a first step
that runs the prompt, then `l_out - 1` decode steps, each paying the chain's step overhead (round
trips and the client's own work per step) plus the blocks' compute.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from llm_swarm.scheduler.algorithms.problem import Span
from llm_swarm.scheduler.algorithms.routing_graph import RoutingGraph
from llm_swarm.swarm.cost import HopCost, cached_positions, request_time


@dataclass(frozen=True)
class ChainServer:
    """What the planner needs of one server (from its DHT record, or the scheduler's status)."""

    peer_id: str
    name: str
    start: int
    end: int
    rtt: float  # measured round trip, seconds
    tau: float  # announced decode compute, seconds per block per token
    tau_prefill: float | None  # announced prefill compute, seconds per block for `prefill_tokens`
    prefill_tokens: int
    max_length: int  # longest session it accepts
    cache_token_bytes: int = 0  # cache bytes per token per block per sequence
    cache_bytes_left: int = 0

    def prefill_block_seconds(self, tokens: int) -> float:
        """One block's compute for a prompt of `tokens`: the line through the two announced points,
        one token (`tau`) and `prefill_tokens` (`tau_prefill`); a fixed launch cost plus a cost per
        token, as a GPU forward costs."""
        if self.tau_prefill is None or self.prefill_tokens <= 1:
            return self.tau * tokens  # only the decode time is known: pessimistic, as routing is
        slope = max((self.tau_prefill - self.tau) / (self.prefill_tokens - 1), 0.0)
        return max(self.tau_prefill + slope * (tokens - self.prefill_tokens), 0.0)


@dataclass(frozen=True)
class ChainHop:
    server: ChainServer
    start: int  # the blocks this server runs for the chain's sessions
    end: int

    @property
    def num_blocks(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class ChainSpeed:
    """A chain's job time: eq. 1 with the chain as one hop, a first step that is a line in the prompt's
    length (a fixed cost, round trips included, plus a cost per token) and a constant decode step, plus
    what opening and closing the session costs."""

    first_fixed: float  # seconds of the step that runs the prompt: fixed part ...
    first_per_token: float  # ... plus this per prompt token
    decode_step: float  # seconds per generated token after the first
    session_overhead: float = 0.0  # seconds to open a session's streams and close them

    def first_step(self, prompt_tokens: int) -> float:
        """Seconds of the step that runs the prompt (and yields the first new token)."""
        return self.first_fixed + self.first_per_token * prompt_tokens

    def job_seconds(self, prompt_tokens: int, new_tokens: int) -> float:
        hop = HopCost(
            rtt=0.0,
            rtt_prefill=0.0,
            tau=self.decode_step,
            tau_prefill=self.first_step(prompt_tokens),
            num_blocks=1,
        )
        return self.session_overhead + request_time([hop], new_tokens)

    def lane_seconds(self, prompt_tokens: int, new_tokens: int, sessions: int) -> float:
        """What a job costs one of `sessions` concurrent sessions on the chain (a lane): its decode
        steps, batched with the others' and so no slower, and its prompt `sessions` times, since a
        server runs a prompt alone, stalling every other session's decode step meanwhile. Summed over
        a chain's jobs and divided by `sessions`, this is the chain's busy time."""
        return self.job_seconds(prompt_tokens, new_tokens) + (sessions - 1) * self.first_step(prompt_tokens)

    def measured(
        self, decode_step: float, first_steps: dict[int, float], session_overhead: float | None = None
    ) -> ChainSpeed:
        """This speed corrected by what was measured on the chain: the decode step, the first step through
        the measured (prompt tokens: seconds) points (through one point, the slope stays) and the session
        overhead (if measured)."""
        overhead = self.session_overhead if session_overhead is None else session_overhead
        points = sorted(first_steps.items())
        if not points:
            return ChainSpeed(self.first_fixed, self.first_per_token, decode_step, overhead)
        slope = self.first_per_token
        if len(points) > 1 and points[-1][0] > points[0][0]:
            (low, low_seconds), (high, high_seconds) = points[0], points[-1]
            slope = max((high_seconds - low_seconds) / (high - low), 0.0)
        tokens, seconds = points[0]
        return ChainSpeed(max(seconds - slope * tokens, 0.0), slope, decode_step, overhead)


@dataclass(frozen=True)
class BatchChain:
    """A complete route through every block, and what it can run."""

    hops: tuple[ChainHop, ...]
    speed: ChainSpeed

    @property
    def max_length(self) -> int:
        """The longest session every server of the chain accepts."""
        return min(hop.server.max_length for hop in self.hops)

    def session_room(self, session_tokens: int, block_windows: Sequence[int | None] = ()) -> int:
        """How many sessions of `session_tokens` positions the servers' announced free cache holds.
        `block_windows`: each block's sliding window (None: full attention), which keeps its ring."""
        room = []
        for hop in self.hops:
            kept = cached_positions(block_windows, hop.start, hop.end, session_tokens)
            per_session = hop.server.cache_token_bytes * kept
            room.append(hop.server.cache_bytes_left // per_session if per_session > 0 else 1 << 20)
        return int(min(room))

    def describe(self) -> str:
        return " -> ".join(
            f"{hop.server.name or hop.server.peer_id[-6:]}[{hop.start}:{hop.end}]" for hop in self.hops
        )


def announced_speed(hops: Sequence[ChainHop]) -> ChainSpeed:
    """A chain's speed from its servers' announced compute and measured round trips."""
    round_trips = sum(hop.server.rtt for hop in hops)
    # each hop's prefill is a line in the prompt's length: so is their sum, through its values at 1 and 65
    one = sum(hop.num_blocks * hop.server.prefill_block_seconds(1) for hop in hops)
    many = sum(hop.num_blocks * hop.server.prefill_block_seconds(65) for hop in hops)
    slope = max((many - one) / 64, 0.0)
    return ChainSpeed(
        first_fixed=round_trips + max(one - slope, 0.0),
        first_per_token=slope,
        decode_step=round_trips + sum(hop.num_blocks * hop.server.tau for hop in hops),
    )


def disjoint_chains(servers: Sequence[ChainServer], num_blocks: int) -> list[BatchChain]:
    """Chains through blocks `[0, num_blocks)` that share no server, fastest first (greedy: the
    fastest chain, then the fastest among the servers left, and so on)."""
    usable = [
        s
        for s in servers
        if 0 <= s.start < s.end <= num_blocks and math.isfinite(s.rtt) and s.tau > 0 and s.max_length >= 1
    ]
    if not usable:
        return []
    graph = RoutingGraph([Span(s.start, s.end) for s in usable], num_blocks)
    links = graph.link_server
    rtt = np.array([usable[j].rtt for j in links], dtype=float)
    tau = np.array([usable[j].tau for j in links], dtype=float)
    cost = rtt + tau * graph.link_blocks
    taken = np.zeros(len(usable), dtype=bool)
    chains: list[BatchChain] = []
    while True:
        chain = graph.shortest_chain(np.where(taken[links], math.inf, cost))
        if chain is None:
            return chains
        hops = tuple(ChainHop(usable[hop.server], hop.start, hop.end) for hop in chain.hops)
        taken[[hop.server for hop in chain.hops]] = True
        chains.append(BatchChain(hops, announced_speed(hops)))
