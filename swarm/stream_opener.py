"""Which path a stream to a peer takes: direct (`swarm.direct_dialer`) when the peer announced an
address for it and is near, libp2p otherwise and whenever the direct path fails.

A direct stream saves both p2p daemons on every message: worth it where they cost as much as the
network (one host, a LAN). Opening one costs TCP, TLS and the hello (three round trips, against about
one for a libp2p stream over the connection the DHT already holds), so a far peer keeps libp2p, whose
connections also cross NATs and relays. An address that failed is not dialed again for `retry_after`
seconds: a firewalled port costs one connect timeout per peer, not one per stream.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from hivemind.p2p import P2P, PeerID

from llm_swarm.swarm.direct_dialer import DirectDialer, DirectUnavailable

logger = logging.getLogger(__name__)

CONNECT_TIMEOUT = 1.0  # seconds for a direct stream's TCP, TLS and hello, to a near peer
RETRY_AFTER = 300.0  # seconds an address that failed is left alone

# the direct address to use for a peer now, or None (not announced, not near, or turned off)
DirectAddress = Callable[[str], str | None]


def stream_path(writer: asyncio.StreamWriter) -> str:
    """Which path a stream `StreamOpener.open` gave takes: direct streams are TLS, libp2p's are not."""
    return "direct" if writer.get_extra_info("ssl_object") is not None else "libp2p"


class StreamOpener:
    def __init__(
        self,
        p2p: P2P,
        dialer: DirectDialer | None,
        direct_address: DirectAddress,
        *,
        connect_timeout: float = CONNECT_TIMEOUT,
        retry_after: float = RETRY_AFTER,
    ):
        self.p2p, self.dialer, self.direct_address = p2p, dialer, direct_address
        self.connect_timeout, self.retry_after = connect_timeout, retry_after
        self.opened = {"direct": 0, "libp2p": 0}  # streams opened each way (tests and benchmarks)
        self._failed_at: dict[tuple[str, str], float] = {}

    async def open(
        self, peer_id: str, handle: str, timeout: float
    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """A stream to `handle` of `peer_id`, by whichever path works, within `timeout` seconds per
        path; a libp2p failure raises what libp2p raised."""
        address = self.direct_address(peer_id) if self.dialer is not None else None
        if address and not self._failed_recently(peer_id, address):
            try:
                reader, writer = await self.dialer.open(
                    peer_id, address, handle, min(timeout, self.connect_timeout)
                )
                self.opened["direct"] += 1
                return reader, writer
            except DirectUnavailable as error:
                now = time.monotonic()
                # forget failures older than the retry window: the table stays as small as its peers
                self._failed_at = {
                    key: at for key, at in self._failed_at.items() if now - at < self.retry_after
                }
                self._failed_at[peer_id, address] = now
                logger.info("no direct stream to %s; libp2p for %.0f s", error, self.retry_after)
        _, reader, writer = await asyncio.wait_for(
            self.p2p.call_binary_stream_handler(PeerID.from_base58(peer_id), handle), timeout
        )
        self.opened["libp2p"] += 1
        return reader, writer

    def _failed_recently(self, peer_id: str, address: str) -> bool:
        failed_at = self._failed_at.get((peer_id, address))
        if failed_at is None:
            return False
        if time.monotonic() - failed_at < self.retry_after:
            return True
        del self._failed_at[peer_id, address]
        return False
