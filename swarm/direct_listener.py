"""A server's direct streams: the binary stream handlers it serves over libp2p, also served over one
TLS port of its own, to peers that can reach it.

Over libp2p a message crosses the sender's p2p daemon, a libp2p stream and the receiver's daemon; on
one host or a LAN those two daemons cost more than the network. Here a stream is one TCP connection
with TLS 1.3 under the server's identity key (`swarm.direct_tls`), a handshake in which the peer
proves its own id (`swarm.direct_hello`), then the same framing and the same handler as over libp2p:
every bound and check of the stream's protocol applies unchanged, with the proven peer id as the
remote id. A connection that does not finish TLS or the handshake within `handshake_timeout` is
closed; at most `max_handshakes` handshakes run at once (more are closed at once), so a peer that
opens connections and says nothing holds a bounded number of sockets for a bounded time.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from contextlib import suppress

from hivemind.p2p import PeerID
from hivemind.p2p.p2p_daemon_bindings.datastructures import StreamInfo
from hivemind.utils.crypto import RSAPrivateKey
from hivemind.utils.multiaddr import Multiaddr

from llm_swarm.swarm.direct_hello import NONCE_BYTES, HelloRefused, check_hello, read_frame, write_frame
from llm_swarm.swarm.direct_tls import server_context

logger = logging.getLogger(__name__)

HANDSHAKE_TIMEOUT = 5.0  # seconds for TLS and the hello together
MAX_HANDSHAKES = 64  # connections still in their handshake at once
# bytes a stream's reader buffers before it stops reading the socket until they are consumed: asyncio's
# default (64 KiB) stops and restarts reading every 128 KiB of a prompt's megabytes
READ_BUFFER = 1 << 20
REFUSAL_LOG_PERIOD = 60.0  # refused handshakes are logged at most once per period, with a count

StreamHandler = Callable[[StreamInfo, asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


class DirectListener:
    def __init__(
        self,
        private_key: RSAPrivateKey,
        peer_id: str,
        host: str,
        port: int = 0,
        *,
        handshake_timeout: float = HANDSHAKE_TIMEOUT,
        max_handshakes: int = MAX_HANDSHAKES,
    ):
        self.private_key, self.peer_id = private_key, peer_id
        self.host, self.port = host, port
        self.handshake_timeout, self.max_handshakes = handshake_timeout, max_handshakes
        self.refused = 0  # handshakes refused since the start (tests and the log read it)
        self.served = 0  # streams handed to their handler (the server's metrics read it)
        self._handlers: dict[str, StreamHandler] = {}
        self._server: asyncio.Server | None = None
        self._handshaking = 0
        self._refusals_logged_at = -REFUSAL_LOG_PERIOD
        self._refusals_unlogged = 0

    async def start(self) -> None:
        self._server = await asyncio.start_server(
            self._serve,
            self.host,
            self.port,
            ssl=server_context(self.private_key),
            ssl_handshake_timeout=self.handshake_timeout,
            limit=READ_BUFFER,
        )
        self.port = self._server.sockets[0].getsockname()[1]
        logger.info("direct streams on %s:%d (TLS)", self.host, self.port)

    def add_handler(self, name: str, handler: StreamHandler) -> None:
        self._handlers[name] = handler

    def remove_handler(self, name: str) -> None:
        self._handlers.pop(name, None)

    async def close(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.close()
            # open streams end with their handlers (their sessions close, or the server's process ends)
            with suppress(Exception):
                await asyncio.wait_for(server.wait_closed(), 1.0)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._handshaking >= self.max_handshakes:
            self._refuse(writer, "too many handshakes at once")
            return
        self._handshaking += 1
        try:
            nonce = secrets.token_bytes(NONCE_BYTES)
            write_frame(writer, {"nonce": nonce})
            async with asyncio.timeout(self.handshake_timeout):
                handle, peer_id = check_hello(await read_frame(reader), self.peer_id, nonce)
            handler = self._handlers.get(handle)
            if handler is None:
                raise HelloRefused(f"no stream handler {handle!r} here")
        except (HelloRefused, TimeoutError, asyncio.IncompleteReadError, OSError) as error:
            self._refuse(writer, str(error) or type(error).__name__)
            return
        finally:
            self._handshaking -= 1
        write_frame(writer, {"ok": True})
        self.served += 1
        host, port = (writer.get_extra_info("peername") or ("0.0.0.0", 0))[:2]
        address = Multiaddr(f"/ip{6 if ':' in host else 4}/{host}/tcp/{port}")
        await handler(StreamInfo(PeerID.from_base58(peer_id), address, handle), reader, writer)

    def _refuse(self, writer: asyncio.StreamWriter, why: str) -> None:
        self.refused += 1
        self._refusals_unlogged += 1
        now = time.monotonic()
        if now - self._refusals_logged_at >= REFUSAL_LOG_PERIOD:
            peer = writer.get_extra_info("peername")
            logger.info(
                "direct stream from %s refused: %s (%d refused since the last such line)",
                peer[0] if peer else "?",
                why,
                self._refusals_unlogged,
            )
            self._refusals_logged_at, self._refusals_unlogged = now, 0
        with suppress(Exception):
            write_frame(writer, {"ok": False, "error": why[:200]})
        writer.close()
