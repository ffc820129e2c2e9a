"""A peer that attacks a direct stream's handshake (tests/test_direct_streams.py), run as a process.

    python tests/hostile_direct_peer.py HOST PORT SERVER_PEER_ID HANDLE VICTIM_PUBLIC_KEY

Prints one JSON object: for each attack, what the server did ("refused: ...", "closed" or, if the
attack worked, "welcomed").
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

from hivemind.utils.crypto import RSAPrivateKey

from llm_swarm.swarm.direct_hello import make_hello, read_frame, write_frame
from llm_swarm.swarm.direct_tls import client_context

SILENT_WAIT = 30.0  # seconds a silent connection waits for the server to close it


async def _connect(host: str, port: int):
    return await asyncio.open_connection(host, port, ssl=client_context(), server_hostname=None)


async def _outcome(reader: asyncio.StreamReader) -> str:
    try:
        welcome = await asyncio.wait_for(read_frame(reader), SILENT_WAIT)
    except (asyncio.IncompleteReadError, ConnectionError):
        return "closed"
    except TimeoutError:
        return "left open"
    return "welcomed" if welcome.get("ok") is True else f"refused: {welcome.get('error')}"


async def _hello_attack(host: str, port: int, make) -> tuple[str, dict | None]:
    """Send the hello `make(nonce)` builds; the server's answer, and the hello sent."""
    reader, writer = await _connect(host, port)
    try:
        nonce = (await read_frame(reader))["nonce"]
        hello = make(nonce)
        write_frame(writer, hello)
        return await _outcome(reader), hello
    finally:
        writer.close()


async def attacks(host: str, port: int, server: str, handle: str, victim_key: str) -> dict[str, str]:
    mine = RSAPrivateKey()
    results: dict[str, str] = {}

    def impersonating(nonce: bytes) -> dict:  # the victim's key, our signature
        return {**make_hello(mine, server, handle, nonce), "key": victim_key}

    results["claims another's id"], _ = await _hello_attack(host, port, impersonating)
    results["signed for another server"], _ = await _hello_attack(
        host, port, lambda nonce: make_hello(mine, server[::-1], handle, nonce)
    )
    # a hello that worked once, sent again on a new connection (the server's nonce is new)
    honest, recorded = await _hello_attack(host, port, lambda nonce: make_hello(mine, server, handle, nonce))
    results["own hello, first time"] = honest
    results["replayed hello"], _ = await _hello_attack(host, port, lambda _nonce: recorded)

    reader, writer = await _connect(host, port)  # announces a gigabyte and sends nothing more
    await read_frame(reader)
    writer.write((1 << 30).to_bytes(4, "big"))
    results["oversized hello"] = await _outcome(reader)
    writer.close()

    reader, writer = await _connect(host, port)  # garbage where msgpack belongs
    await read_frame(reader)
    writer.write((16).to_bytes(4, "big") + b"\xc1" * 16)
    results["garbage hello"] = await _outcome(reader)
    writer.close()

    started = time.monotonic()  # TLS done, then silence
    reader, writer = await _connect(host, port)
    await read_frame(reader)
    outcome = await _outcome(reader)
    results["silent after TLS"] = f"{outcome} after {time.monotonic() - started:.1f} s"
    writer.close()

    started = time.monotonic()  # TCP only, never TLS
    reader, writer = await asyncio.open_connection(host, port)
    try:
        data = await asyncio.wait_for(reader.read(), SILENT_WAIT)
        outcome = "closed" if not data else "answered"
        results["silent TCP"] = f"{outcome} after {time.monotonic() - started:.1f} s"
    except (ConnectionError, TimeoutError) as error:
        results["silent TCP"] = f"{type(error).__name__} after {time.monotonic() - started:.1f} s"
    writer.close()
    return results


if __name__ == "__main__":
    host, port, server, handle, victim = sys.argv[1:6]
    print(json.dumps(asyncio.run(attacks(host, int(port), server, handle, victim))))
