"""Prefill time from a server's announced measurement, and whether a prefill server pays (pure).

Shared by the client (`client/handoff_cost.py`, `client/remote.py`) and the simulator
(`scheduler/sim/contended_roles.py`), which must decide the way clients do.

A server announces `tau_prefill`, its per-block time for a prompt of `prefill_tokens` tokens; a
prompt of `tokens` tokens is charged that time scaled linearly. A session's hop may run its prompt
on a prefill server P and hand the cache to its decode server D (docs/architecture.md, "Prefill and
decode roles"): P's prefill and the cache's transfer over the P-to-D link (free when the link's
rate is unknown: the hand-off's own time limit then bounds the loss), overlapped as P streams the
cache while the prompt runs, against D's own prefill.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import TypeVar

from llm_swarm.swarm.cost import cached_positions
from llm_swarm.swarm.route_request import RouteHop
from llm_swarm.swarm.server_info import ServerInfo

DISAGGREGATE_POLICIES = ("auto", "always", "never")
# Servers compute long prompts in chunks of this many tokens (`swarm-server --prefill-chunk`'s
# default) and stream each chunk's cache to the decode server as soon as it is done; each server
# announces its own (`ServerInfo.prefill_chunk`), the simulator assumes this one
STREAM_CHUNK_TOKENS = 256
NEAR_TIE = 0.05  # prefill servers this much dearer than the cheapest count as alike (`spread`)

_K = TypeVar("_K", bound=Hashable)


def scaled_prefill_seconds(
    tau_prefill: float | None, prefill_tokens: int, tau: float | None, tokens: int
) -> float:
    """Per-block prefill seconds of `tokens` tokens from an announced `tau_prefill` measured on
    `prefill_tokens` tokens (without one: `tau` per token)."""
    if tau_prefill is None or prefill_tokens <= 0:
        return (tau or 0.0) * tokens
    return tau_prefill * tokens / prefill_tokens


def prefill_seconds(info: ServerInfo, tokens: int) -> float:
    """Per-block prefill time of `tokens` tokens, scaled from the server's announced measurement."""
    return scaled_prefill_seconds(info.tau_prefill, info.prefill_tokens, info.tau, tokens)


def disaggregated_seconds(
    prefill_per_block: float,
    blocks: int,
    cache_bytes: float,
    link_bytes_per_s: float | None,
    chunks: int = 1,
) -> float:
    """A prefill server's estimate for one hop: its prefill of the hop's blocks and the hand-off of
    `cache_bytes` at the link's rate (0 when the rate is unknown), the cache streamed in `chunks`
    parts as the prompt computes them (`streamed_seconds`; 1: the hand-off after the prompt)."""
    handoff = cache_bytes / link_bytes_per_s if link_bytes_per_s else 0.0
    return streamed_seconds(prefill_per_block * blocks, handoff, chunks)


def prompt_chunks(tokens: int, chunk_tokens: int = STREAM_CHUNK_TOKENS) -> int:
    """The parts a prompt of `tokens` tokens is computed, and its cache streamed, in."""
    return max(1, -(-tokens // chunk_tokens)) if chunk_tokens > 0 else 1


def streamed_seconds(prefill: float, transfer: float, chunks: int) -> float:
    """A prompt's prefill and its cache's hand-off when each of `chunks` equal parts of the cache is
    sent as soon as the prompt's chunk that computes it is done, while the next one computes
    (`HandOff.follow`): a two-stage pipeline, `(P + T) / n + (n - 1) / n * max(P, T)`; `P + T` for
    one part, `max(P, T)` in the limit. The link then costs only its last part after the prompt
    when it is faster than the compute (`T / n`), else what the compute could not hide."""
    if chunks < 1:
        raise ValueError(f"chunks must be >= 1, got {chunks}")
    return (prefill + transfer) / chunks + (chunks - 1) / chunks * max(prefill, transfer)


def announced_rate(sender: ServerInfo, receiver: str) -> float | None:
    """The link rate (bytes/s) `sender` announces to peer `receiver`, if it measured one."""
    return sender.links.get(receiver)


def hop_prefill_costs(
    hop: RouteHop,
    prefill_servers: Mapping[str, ServerInfo],
    l_in: int,
    batch_size: int,
    link_rate: Callable[[str, ServerInfo, str], float | None] | None = None,
    block_windows: Sequence[int | None] = (),
) -> dict[str, float]:
    """`disaggregated_seconds` of a prompt of `l_in` tokens (`batch_size` sequences) for `hop` on each
    of `prefill_servers` that holds the hop's blocks and has cache room. `link_rate(peer, info,
    decode_peer)`: bytes/s from a prefill server to the hop's server (default: what it announces).
    `block_windows`: each block's sliding window (None: full attention), whose ring is what moves."""
    blocks = hop.end - hop.start
    costs = {}
    for peer, info in prefill_servers.items():
        if not (info.start <= hop.start and hop.end <= info.end and info.cache_bytes_left > 0):
            continue
        rate = link_rate(peer, info, hop.peer_id) if link_rate else announced_rate(info, hop.peer_id)
        cache_bytes = (
            cached_positions(block_windows, hop.start, hop.end, l_in) * batch_size * info.cache_token_bytes
        )
        costs[peer] = disaggregated_seconds(
            prefill_seconds(info, l_in), blocks, cache_bytes, rate, prompt_chunks(l_in, info.prefill_chunk)
        )
    return costs


def choose_prefill_server(
    costs: Mapping[_K, float], colocated: float, policy: str = "auto", spread: Hashable | None = None
) -> _K | None:
    """The prefill server (key of `costs`, its `disaggregated_seconds`) a hop's prompt goes to, or
    None to prefill on the decode server (whose own prefill takes `colocated` seconds).

    "auto": the cheapest one if it beats `colocated`; "always": the cheapest one; "never": none.
    Without `spread`, ties go to the first key, as `min` keeps it. With one (a session id), the
    choice among the servers within `NEAR_TIE` of the cheapest is by its stable hash: clients that
    each see the same alike prefill servers (and not each other's prompts) then spread over them,
    where every one of them would otherwise pick the same server (measured on netem: 92 of 115
    prompts on one of two alike servers).
    """
    if policy not in DISAGGREGATE_POLICIES:
        raise ValueError(f"unknown disaggregation policy {policy!r}; choose from {DISAGGREGATE_POLICIES}")
    if policy == "never" or not costs:
        return None
    best = min(costs, key=costs.__getitem__)
    if policy == "auto" and costs[best] >= colocated:
        return None
    if spread is not None:
        near = sorted(
            (key for key in costs if costs[key] <= costs[best] * (1 + NEAR_TIE)), key=lambda key: str(key)
        )
        if policy == "auto":
            near = [key for key in near if costs[key] < colocated]
        return near[zlib.crc32(str(spread).encode()) % len(near)]
    return best
