"""Round trips to servers, measured by an info call and cached (what routing ranks servers by)."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable

from llm_swarm.client.options import ClientOptions

logger = logging.getLogger(__name__)


class ServerProbes:
    """The last round trip to each server (inf: it did not answer), one ping in flight per server.

    `ping(peer_id)` is the call whose round trip is measured: an info request (its serialization
    included) that raises when the server does not answer within `options.ping_timeout`."""

    def __init__(self, ping: Callable[[str], Awaitable[object]], options: ClientOptions):
        self._ping_call, self.options = ping, options
        self._rtts: dict[str, tuple[float, float]] = {}  # peer -> (rtt seconds, measured at)
        self._pinging: dict[str, asyncio.Future] = {}  # peer -> its ping in flight (callers share it)

    def measured(self) -> dict[str, float]:
        """Every server pinged and its last round trip (inf: it did not answer)."""
        return {peer: rtt for peer, (rtt, _measured_at) in self._rtts.items()}

    def answered(self) -> dict[str, float]:
        """The servers that answered their last ping, and its round trip."""
        return {peer: rtt for peer, (rtt, _measured_at) in self._rtts.items() if rtt < math.inf}

    def forget(self, peer_id: str) -> None:
        """Measure `peer_id` afresh next time (it failed, or a measurement wants a new sample)."""
        self._rtts.pop(peer_id, None)

    def recently_unanswered(self, peer_id: str) -> bool:
        """Whether `peer_id` failed to answer within the last `failed_ping_ttl` seconds."""
        cached = self._rtts.get(peer_id)
        return (
            cached is not None
            and cached[0] == math.inf
            and time.monotonic() - cached[1] < self.options.failed_ping_ttl
        )

    async def rtt(self, peer_id: str) -> float:
        """Round trip of an info call, cached; inf if the peer does not answer within `ping_timeout`
        (a record may name a peer that does not exist). A failure is cached only for
        `failed_ping_ttl`: a server still starting up answers a moment later."""
        cached = self._rtts.get(peer_id)
        if cached is not None:
            ttl = self.options.rtt_ttl if cached[0] < math.inf else self.options.failed_ping_ttl
            if time.monotonic() - cached[1] < ttl:
                return cached[0]
        if peer_id not in self._pinging:  # the warm-up and a route may want the same server at once
            self._pinging[peer_id] = asyncio.ensure_future(self._ping(peer_id))
            self._pinging[peer_id].add_done_callback(lambda _: self._pinging.pop(peer_id, None))
        return await asyncio.shield(self._pinging[peer_id])

    async def _ping(self, peer_id: str) -> float:
        started = time.perf_counter()
        try:
            await self._ping_call(peer_id)
            rtt = time.perf_counter() - started
        except Exception as error:
            logger.info("server %s does not answer: %s", peer_id[-8:], str(error) or type(error).__name__)
            rtt = math.inf
        self._rtts[peer_id] = (rtt, time.monotonic())
        return rtt

    def cancel(self) -> None:
        """Stop the pings in flight (the connection is closing)."""
        for ping in list(self._pinging.values()):
            ping.cancel()
