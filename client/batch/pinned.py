"""Sessions pinned to one chain's servers, with the client's failover intact.

`PinnedConnection` is a view of the client's `SwarmConnection` whose routing prefers one chain: a
session opened through it routes its blocks over that chain's servers whenever they are online and
not banned, and over whatever routing finds otherwise (a server of the chain failed or left: the
session's failover replaces it as usual, and the job still finishes). Everything else (records,
round trips, bans, the P2P daemon) is the connection's own, shared by every chain. Sessions opened
through it do not go through the scheduler: the batch planned its chains itself.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

from llm_swarm.client.backend import BlockSession
from llm_swarm.client.connection import SwarmConnection
from llm_swarm.client.remote import RemoteBlockSession
from llm_swarm.client.routing import Candidate, choose_chain
from llm_swarm.client.session import InferenceSession
from llm_swarm.swarm.route_request import RouteHop, SessionShape

logger = logging.getLogger(__name__)


class PinnedConnection:
    """`connection`, with `route` preferring the servers `peer_ids` (see the module docstring)."""

    scheduler = None  # pinned sessions never ask the scheduler for a route

    def __init__(self, connection: SwarmConnection, peer_ids: Sequence[str]):
        object.__setattr__(self, "_connection", connection)
        object.__setattr__(self, "_peers", tuple(peer_ids))
        object.__setattr__(self, "fallbacks", 0)  # routes that had to leave the chain

    def __getattr__(self, name: str):
        return getattr(self._connection, name)

    def __setattr__(self, name: str, value) -> None:
        setattr(self._connection, name, value)  # counters sessions update belong to the connection

    async def route(
        self, start: int, end: int, shape: SessionShape, phase: str = "decode", patient: bool = True
    ) -> list[RouteHop]:
        chain = await self._pinned_route(start, end, shape, phase)
        if chain is not None:
            return chain
        object.__setattr__(self, "fallbacks", self.fallbacks + 1)
        logger.info(
            "blocks %d:%d: the chain's servers cannot take the session now; routing anywhere", start, end
        )
        return await self._connection.chains.route(start, end, shape, phase, patient)

    async def _pinned_route(
        self, start: int, end: int, shape: SessionShape, phase: str
    ) -> list[RouteHop] | None:
        connection = self._connection
        routable = connection.chains.routable_among(await connection.roster.servers(), phase)
        peers = [peer for peer in self._peers if peer in routable]
        if not peers:
            return None
        rtts = await asyncio.gather(*(connection.probes.rtt(peer) for peer in peers))
        candidates = [Candidate(peer, routable[peer], rtt) for peer, rtt in zip(peers, rtts, strict=True)]
        # the announced free cache is not checked: our own sessions use it, and a server that really
        # has no room says so, which the session waits out (and bans a server that keeps refusing)
        return choose_chain(candidates, start, end, shape, need_cache_room=False)


def open_pinned_session(
    connection: PinnedConnection, prompt_tokens: int, new_tokens: int
) -> InferenceSession:
    """A one-sequence inference session for a prompt of `prompt_tokens` and `new_tokens` more,
    routed over `connection`'s chain; `generate(..., session=...)` runs in it."""
    max_length = prompt_tokens + new_tokens
    blocks: BlockSession = RemoteBlockSession(
        connection, 1, max_length, prompt_tokens=prompt_tokens, expected_new_tokens=new_tokens
    )
    return InferenceSession(blocks, 1, max_length)
