"""JFFC over the live swarm: the `chains` policy's routing (Sun, He and Hou, Alg. 2-3; docs/reference.md
3.4), pure.

The policy places blocks with GBP-CR, composes job-server chains on the spans the servers serve
now with GCA (each chain gets a capacity `c_k` of concurrent sessions, carved out of its servers'
cache slots so that the chains never over-commit a server), and dispatches sessions with
Join-the-Fastest-Free-Chain: a new session starts on the fastest chain with a free slot, or waits
in one central FIFO queue; when a session ends, the head of the queue takes the fastest free chain.

Unlike WS-RR, a waiting session has no chain yet: its chain is chosen when it is admitted, and the
client learns it from the admission reply.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from llm_swarm.scheduler.algorithms.chains import chain_hops, gca
from llm_swarm.scheduler.algorithms.problem import ModelSpec, ServerSpec, Span
from llm_swarm.swarm.route_request import RouteHop


@dataclass(frozen=True)
class LiveChain:
    """A GCA job server over live peers."""

    hops: tuple[RouteHop, ...]
    capacity: int  # c_k: concurrent sessions of one cache slot per block
    service_time: float  # T_k (eq. 2): seconds one request spends on the chain


def compose_live_chains(
    peers: Sequence[str], specs: Sequence[ServerSpec], model: ModelSpec, spans: Sequence[Span | None]
) -> tuple[LiveChain, ...]:
    """GCA on the live spans (`specs` carry `tau_c`, `tau_p`); chains in GCA's order, fastest first."""
    return tuple(
        LiveChain(
            tuple(RouteHop(peers[hop.server], hop.start, hop.end) for hop in chain_hops(chain, spans)),
            chain.capacity,
            chain.service_time,
        )
        for chain in gca(specs, model, spans)
    )


def fastest_free_chain(
    chains: Sequence[LiveChain],
    busy: Sequence[float],
    units: float,
    has_room: Callable[[LiveChain], bool],
) -> int | None:
    """JFFC's pick: the chain with the shortest `T_k` (ties: the lowest index, the tie rule of
    docs/reference.md 3) with `units` of its capacity free whose servers also have that room (they may
    hold sessions routed without the scheduler); None: every chain is full."""
    for k in sorted(range(len(chains)), key=lambda k: chains[k].service_time):
        if busy[k] + units <= chains[k].capacity + 1e-9 and has_room(chains[k]):
            return k
    return None


def queue_start_times(
    now: float, running_ends: Sequence[float], service_time: float, count: int
) -> list[float]:
    """Predicted start times of the first `count` queued sessions: each takes the slot that frees
    first (the running sessions' expected ends), and frees it again `service_time` later.
    A rough estimate, as JFFC has no closed form per session; `inf` when nothing runs to free a slot."""
    frees = [max(end, now) for end in running_ends]
    heapq.heapify(frees)
    starts = []
    for _ in range(count):
        if not frees:
            starts.append(float("inf"))
            continue
        start = heapq.heappop(frees)
        starts.append(start)
        heapq.heappush(frees, start + service_time)
    return starts


def timings_moved(
    old: Sequence[ServerSpec],
    new: Sequence[ServerSpec],
    tolerance: float = 0.1,
    fields: tuple[str, ...] = ("tau_c", "tau_p"),
) -> bool:
    """Whether some server's `fields` moved by more than `tolerance` (relative): re-compose the chains
    (or rebuild WS-RR's state, with `tau` and `tau_prefill`) then, not on every jitter of a measured
    round trip (chains would flap)."""
    if len(old) != len(new):
        return True
    for before, after in zip(old, new, strict=True):
        for a, b in ((getattr(before, name), getattr(after, name)) for name in fields):
            if (a is None) != (b is None):
                return True
            if a is not None and b is not None and abs(b - a) > tolerance * max(abs(a), abs(b), 1e-9):
                return True
    return False
