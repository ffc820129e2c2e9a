"""When moving a session's cache between servers beats rebuilding it by replay (pure arithmetic).

A server that leaves can push the session's attention cache to its replacement (a hand-off), or the
client can rebuild it there from the hidden states it kept (a replay, `ClientOptions.replay_mode`
"prefill": one catch-up prefill). The cache is large next to the hidden states (11 of 32 blocks of a
LLaMA-2-7B shape at fp16: 2 x 4096 x 2 bytes x 11 = 180 KB per token, against 16 KB of float32 hidden
states), so a hand-off pays only over a fast link between the servers, while a replay costs the
client's uplink and the replacement's prefill compute:

    replay   = rtt(client, B) + tokens x batch x hidden x 4 / client uplink + prefill(B, tokens) x blocks
    hand-off = 2 x rtt(client, A) + kept x batch x cache_token_bytes / link(A, B)

where `kept` is the positions the blocks hold together: `tokens x blocks`, less where a block of
sliding attention keeps only its ring (`swarm.cost.cached_positions`).

The A-to-B link is what only the servers can measure: a known rate (an earlier hand-off between the
same two servers) decides at once; an unknown one is tried, with the replay's estimate as the push's
time limit, which A enforces from B's acknowledgements while pushing (server/cache_sender.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from llm_swarm.swarm.prefill_cost import prefill_seconds
from llm_swarm.swarm.server_info import ServerInfo

__all__ = ["WIRE_BYTES_PER_VALUE", "MoveCosts", "move_costs", "prefill_seconds"]

WIRE_BYTES_PER_VALUE = 4  # the client sends hidden states as float32


@dataclass(frozen=True)
class MoveCosts:
    replay_seconds: float
    handoff_seconds: float | None  # None: the A-to-B link has not been measured yet

    @property
    def try_handoff(self) -> bool:
        return self.handoff_seconds is None or self.handoff_seconds < self.replay_seconds


def move_costs(
    *,
    tokens: int,
    batch_size: int,
    hidden_size: int,
    blocks: int,
    kept_positions: int,
    source: ServerInfo,
    target: ServerInfo,
    rtt_source: float,
    rtt_target: float,
    uplink_bytes_per_s: float,
    link_bytes_per_s: float | None,
) -> MoveCosts:
    """Estimated seconds to rebuild `tokens` positions of a session on `target` by replay (the prefill
    of every one of `blocks` blocks), and to push the `kept_positions` the blocks hold together from
    `source` (None when their link's rate is unknown)."""
    upload = tokens * batch_size * hidden_size * WIRE_BYTES_PER_VALUE / uplink_bytes_per_s
    replay = rtt_target + upload + prefill_seconds(target, tokens) * blocks
    handoff = None
    if link_bytes_per_s is not None and link_bytes_per_s > 0:
        cache_bytes = kept_positions * batch_size * source.cache_token_bytes
        handoff = 2 * rtt_source + cache_bytes / link_bytes_per_s
    return MoveCosts(replay, handoff)
