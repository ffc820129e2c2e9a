"""The dialing side of a direct stream (`swarm.direct_listener`): TLS to the address a peer announced,
a check that the certificate's key is that peer's, then the hello that proves our own id."""

from __future__ import annotations

import asyncio
from contextlib import suppress

from hivemind.utils.crypto import RSAPrivateKey

from llm_swarm.swarm.direct_hello import (
    HelloRefused,
    check_challenge,
    check_welcome,
    make_hello,
    read_frame,
    write_frame,
)
from llm_swarm.swarm.direct_listener import READ_BUFFER
from llm_swarm.swarm.direct_tls import certificate_peer_id, client_context

MAX_ADDRESS_CHARS = 64


class DirectUnavailable(Exception):
    """No direct stream to that peer: unreachable, someone else at its address, or refused."""


def split_address(address: str) -> tuple[str, int]:
    """("host", port) of an announced "host:port" ("[v6]:port" for IPv6); ValueError if malformed."""
    if len(address) > MAX_ADDRESS_CHARS:
        raise ValueError(f"address of {len(address)} characters")
    host, separator, port_text = address.rpartition(":")
    if not separator or not host or not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ValueError(f"not host:port: {address!r}")
    return host.removeprefix("[").removesuffix("]"), int(port_text)


class DirectDialer:
    def __init__(self, private_key: RSAPrivateKey):
        self.private_key = private_key
        self._context = client_context()

    async def open(
        self, peer_id: str, address: str, handle: str, timeout: float
    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """A stream to `handle` of `peer_id` at `address`, ready for the handler's framing; raises
        DirectUnavailable (within `timeout` seconds) when it cannot be had."""
        writer: asyncio.StreamWriter | None = None
        try:
            host, port = split_address(address)
            async with asyncio.timeout(timeout):
                reader, writer = await asyncio.open_connection(
                    host,
                    port,
                    ssl=self._context,
                    server_hostname=None,
                    ssl_handshake_timeout=timeout,
                    limit=READ_BUFFER,
                )
                certificate = writer.get_extra_info("ssl_object").getpeercert(binary_form=True)
                if certificate_peer_id(certificate) != peer_id:
                    raise HelloRefused("another peer answers at this address")
                nonce = check_challenge(await read_frame(reader))
                write_frame(writer, make_hello(self.private_key, peer_id, handle, nonce))
                check_welcome(await read_frame(reader))
            return reader, writer
        except (HelloRefused, ValueError, TimeoutError, asyncio.IncompleteReadError, OSError) as error:
            if writer is not None:
                writer.close()
                with suppress(Exception):
                    await asyncio.wait_for(writer.wait_closed(), 1.0)
            raise DirectUnavailable(f"{peer_id[-8:]} at {address}: {error or type(error).__name__}") from None
