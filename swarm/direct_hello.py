"""The handshake of a direct stream, once TLS is up: how a client proves its peer id to the server.

    server -> client  Challenge {nonce: 32 random bytes}
    client -> server  Hello     {handle, key: the client's RSA public key (OpenSSH text),
                                 signature of (PURPOSE, server peer id, handle, nonce) by that key}
    server -> client  Welcome   {ok: true} or {ok: false, error: why}

The signature names the server, so a server that receives a hello cannot use it elsewhere; it signs
the server's fresh nonce, so a hello recorded once is worth nothing later; and it travels inside TLS
to a server whose key the client checked, so nobody on the path reads or changes it. After a welcome
both sides speak the stream's own framing, exactly as over libp2p. Each message is a 4-byte length
and a msgpack map, at most MAX_HELLO_BYTES.
"""

from __future__ import annotations

import asyncio

import msgpack
from hivemind.utils.crypto import RSAPrivateKey, RSAPublicKey

from llm_swarm.swarm.identity import peer_id_of_key

PURPOSE = b"llm-swarm direct stream v1"
NONCE_BYTES = 32
MAX_HELLO_BYTES = 8192
MAX_HANDLE_CHARS = 256


class HelloRefused(Exception):
    """The other side of a direct stream's handshake broke the protocol or failed its proof."""


def signed_payload(server_peer_id: str, handle: str, nonce: bytes) -> bytes:
    return b"\0".join((PURPOSE, server_peer_id.encode(), handle.encode(), nonce))


def make_hello(private_key: RSAPrivateKey, server_peer_id: str, handle: str, nonce: bytes) -> dict:
    public_key = private_key.get_public_key().to_bytes().decode()
    signature = private_key.sign(signed_payload(server_peer_id, handle, nonce))
    return {"handle": handle, "key": public_key, "signature": signature}


def check_hello(message: dict, server_peer_id: str, nonce: bytes) -> tuple[str, str]:
    """The handle a hello asks for and the client's peer id it proves; HelloRefused unless the
    signature is good."""
    handle, key, signature = message.get("handle"), message.get("key"), message.get("signature")
    if not isinstance(handle, str) or not 0 < len(handle) <= MAX_HANDLE_CHARS:
        raise HelloRefused("the hello names no handle")
    if not isinstance(key, str) or not isinstance(signature, bytes):
        raise HelloRefused("the hello carries no key or no signature")
    peer_id = peer_id_of_key(key)
    if peer_id is None:
        raise HelloRefused("the hello's key is not an RSA public key of 2048-8192 bits")
    try:
        public_key = RSAPublicKey.from_bytes(key.encode())
    except ValueError:
        raise HelloRefused("the hello's key is not an RSA public key") from None
    if not public_key.verify(signed_payload(server_peer_id, handle, nonce), signature):
        raise HelloRefused("the hello's signature does not match its key, this server and this nonce")
    return handle, peer_id


def check_challenge(message: dict) -> bytes:
    nonce = message.get("nonce")
    if not isinstance(nonce, bytes) or len(nonce) != NONCE_BYTES:
        raise HelloRefused(f"the challenge carries no {NONCE_BYTES}-byte nonce")
    return nonce


def check_welcome(message: dict) -> None:
    if message.get("ok") is not True:
        error = message.get("error")
        raise HelloRefused(f"refused: {error[:200] if isinstance(error, str) else 'no reason given'}")


def write_frame(writer: asyncio.StreamWriter, message: dict) -> None:
    data = msgpack.packb(message, use_bin_type=True)
    writer.write(len(data).to_bytes(4, "big") + data)


async def read_frame(reader: asyncio.StreamReader) -> dict:
    """One handshake message; HelloRefused if it is oversized or not a msgpack map."""
    length = int.from_bytes(await reader.readexactly(4), "big")
    if length > MAX_HELLO_BYTES:
        raise HelloRefused(f"a handshake message of {length:,} bytes exceeds {MAX_HELLO_BYTES:,}")
    try:
        message = msgpack.unpackb(await reader.readexactly(length), raw=False)
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError):
        raise HelloRefused("a handshake message is not msgpack") from None
    if not isinstance(message, dict):
        raise HelloRefused("a handshake message is not a map")
    return message
