"""The swarm as operators see it: servers, spans and block coverage (pure; shared by the scheduler's
status and `swarm-health`, which has only the DHT)."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

from llm_swarm.scheduler.algorithms.problem import Span, uncovered_blocks
from llm_swarm.scheduler.service.view import SwarmView


def describe_servers(
    view: SwarmView,
    assignment: Mapping[str, Span | None],
    capacity_of: Callable[[str], int],
    in_use_of: Callable[[str], float],
) -> dict:
    """`servers` (one entry per known server), `coverage` (live servers per block), `uncovered_blocks`."""
    num_blocks = view.shape.num_blocks
    live = view.live()
    live_spans = view.live_spans(live)
    coverage = [0] * num_blocks
    for span in live_spans:
        if span is not None:
            for block in range(span.start, span.end):
                coverage[block] += 1
    servers = []
    for peer in sorted(view.records):
        info = view.records[peer]
        assigned = assignment.get(peer)
        servers.append(
            {
                "peer_id": peer,
                "public_name": info.public_name,
                "state": str(info.state),
                "managed": info.managed,
                "start": info.start if info.has_blocks else -1,
                "end": info.end if info.has_blocks else -1,
                "assigned_start": assigned.start if assigned else -1,
                "assigned_end": assigned.end if assigned else -1,
                "memory_bytes": float(info.memory_bytes),
                "tau": info.tau or 0.0,
                "tau_prefill": info.tau_prefill or 0.0,
                "cache_slots": capacity_of(peer),
                # sessions hold fractions of slots; the status counts the whole slots they touch
                "slots_in_use": math.ceil(round(in_use_of(peer), 6)),
                "active_sessions": info.active_sessions,
                "reachability": str(info.reachability),
            }
        )
    return {
        "servers": servers,
        "coverage": coverage,
        "uncovered_blocks": uncovered_blocks(live_spans, num_blocks),
    }


def announced_capacity(view: SwarmView) -> tuple[Callable[[str], int], Callable[[str], int]]:
    """Cache slots and slots in use as the servers announce them (for views without a scheduler)."""
    model = view.model_spec()

    def capacity(peer: str) -> int:
        info = view.records.get(peer)
        if model is None or info is None or not info.has_blocks:
            return 0
        return max(
            math.floor((info.memory_bytes - model.block_bytes * info.num_blocks) / model.cache_bytes), 0
        )

    def in_use(peer: str) -> float:
        return view.used_units(peer, model) if model is not None else 0.0

    return capacity, in_use
