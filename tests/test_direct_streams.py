"""Direct streams (swarm/direct_listener.py): TLS under the server's identity key, then a hello in which
the client proves its peer id. A hostile process claims another peer's id, signs for another server,
replays a hello that worked, announces a gigabyte, sends garbage and opens connections it never
finishes: every one is refused or closed, and an honest client is served with its proven id. A
dialer that finds another peer at an address refuses it, and the stream goes over libp2p instead."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest
from hivemind.p2p import P2P
from hivemind.utils.crypto import RSAPrivateKey

from llm_swarm.swarm.direct_dialer import DirectDialer, DirectUnavailable, split_address
from llm_swarm.swarm.direct_listener import DirectListener
from llm_swarm.swarm.identity import peer_id_of_key, public_key_text
from llm_swarm.swarm.stream_opener import StreamOpener

pytestmark = pytest.mark.version_neutral

HOSTILE = Path(__file__).with_name("hostile_direct_peer.py")


def new_peer() -> tuple[RSAPrivateKey, str]:
    key = RSAPrivateKey()
    return key, peer_id_of_key(public_key_text(key))


async def reversing(info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, seen: list[str]):
    """A stream handler that answers five bytes reversed and records who it served."""
    seen.append(str(info.peer_id))
    writer.write((await reader.readexactly(5))[::-1])
    await writer.drain()
    writer.close()


def test_only_a_peer_that_proves_its_id_is_served_and_no_forged_or_stalled_handshake_is(tmp_path):
    async def scenario():
        server_key, server_id = new_peer()
        client_key, client_id = new_peer()
        seen: list[str] = []
        listener = DirectListener(server_key, server_id, "127.0.0.1", 0, handshake_timeout=1.0)
        await listener.start()
        listener.add_handler("reverse", lambda *stream: reversing(*stream, seen))
        address = f"127.0.0.1:{listener.port}"
        try:
            hostile = await asyncio.create_subprocess_exec(
                sys.executable,
                str(HOSTILE),
                "127.0.0.1",
                str(listener.port),
                server_id,
                "reverse",
                public_key_text(client_key),
                stdout=asyncio.subprocess.PIPE,
            )
            try:
                out, _ = await asyncio.wait_for(hostile.communicate(), 120)
            finally:
                if hostile.returncode is None:
                    hostile.kill()
                    await hostile.wait()
            attacks = json.loads(out)
            attacker_id = seen[0] if seen else None  # its own hello, honestly signed, is served

            dialer = DirectDialer(client_key)
            reader, writer = await dialer.open(server_id, address, "reverse", 10.0)
            writer.write(b"hello")
            answer = await reader.readexactly(5)
            writer.close()
            _, someone_else = new_peer()
            with pytest.raises(DirectUnavailable, match="another peer answers"):
                await dialer.open(someone_else, address, "reverse", 10.0)
            with pytest.raises(DirectUnavailable, match="no stream handler"):
                await dialer.open(server_id, address, "no-such-handle", 10.0)
            return attacks, attacker_id, seen, answer, client_id, listener.refused
        finally:
            await listener.close()

    attacks, attacker_id, seen, answer, client_id, refused = asyncio.run(scenario())
    for attack in ("claims another's id", "signed for another server", "replayed hello"):
        assert attacks[attack].startswith("refused: the hello's signature does not match"), attacks
    assert attacks["oversized hello"].startswith("refused: a handshake message of 1,073,741,824 bytes")
    assert attacks["garbage hello"].startswith("refused:"), attacks
    assert attacks["own hello, first time"] == "welcomed"
    assert attacks["silent after TLS"].startswith("refused: TimeoutError"), attacks
    assert attacks["silent TCP"].startswith("closed"), attacks
    assert answer == b"olleh"
    assert seen == [attacker_id, client_id]  # the attacker as itself, then the honest client
    assert refused >= 7  # the six refused hellos and the impostor check's, besides the silent TCP


def test_another_peer_at_a_direct_address_sends_the_stream_over_libp2p_and_is_not_dialed_again():
    async def scenario():
        server = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        maddrs = [str(maddr) for maddr in await server.get_visible_maddrs()]
        client = await P2P.create(initial_peers=maddrs, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        impostor_key, impostor_id = new_peer()
        impostor = DirectListener(impostor_key, impostor_id, "127.0.0.1", 0)
        await impostor.start()
        seen: list[str] = []
        impostor.add_handler("reverse", lambda *stream: reversing(*stream, seen))
        await server.add_binary_stream_handler("reverse", lambda *stream: reversing(*stream, seen))
        client_key, _ = new_peer()
        address = f"127.0.0.1:{impostor.port}"
        opener = StreamOpener(client, DirectDialer(client_key), lambda _peer: address)
        try:
            answers = []
            for _ in range(2):
                reader, writer = await opener.open(server.peer_id.to_base58(), "reverse", 10.0)
                writer.write(b"abcde")
                answers.append(await reader.readexactly(5))
                writer.close()
            return answers, opener.opened, impostor.refused, seen, client.peer_id.to_base58()
        finally:
            await impostor.close()
            await client.shutdown()
            await server.shutdown()

    answers, opened, impostor_refused, seen, client_id = asyncio.run(scenario())
    assert answers == [b"edcba", b"edcba"]
    assert opened == {"direct": 0, "libp2p": 2}
    assert impostor_refused == 1  # dialed once: the failed address is left alone afterwards
    assert seen == [client_id, client_id]  # served by the real server, over libp2p


@pytest.mark.parametrize(
    ("address", "expected"),
    [("127.0.0.1:5000", ("127.0.0.1", 5000)), ("[::1]:443", ("::1", 443)), ("host.lan:1", ("host.lan", 1))],
)
def test_an_announced_address_is_host_and_port(address, expected):
    assert split_address(address) == expected


@pytest.mark.parametrize("address", ["127.0.0.1", ":80", "host:0", "host:65536", "host:x", "a" * 70 + ":1"])
def test_a_malformed_announced_address_is_refused(address):
    with pytest.raises(ValueError):
        split_address(address)
