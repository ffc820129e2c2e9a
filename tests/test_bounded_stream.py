"""The size-bounded stream transport (server/bounded_stream.py) over real libp2p daemons.

A cache push or a link probe sends its header and its first 1 MiB chunk back to back. On a busy
server the transport used to read the chunk's length before the handler had read the header and
raised the stream's limit, and refused the chunk (found on netem: 8 of 12 hand-offs fell back to
replay). Now an oversized message waits, unread, until the handler asks for the next message, and is
checked then; one still over the limit is refused as before.
"""

from __future__ import annotations

import asyncio

from hivemind.p2p import P2P
from hivemind.proto import runtime_pb2

from server.bounded_stream import add_bounded_stream_handler
from swarm.wire import decode_metadata

HANDLE = "test_bounded_stream"
CHUNK = 1 << 20


async def slow_handler(requests, context, limit):
    """Reads a header, takes its time (a busy event loop), then allows chunks only if the header
    asked for it."""
    header = await anext(requests)
    await asyncio.sleep(0.5)
    if header.metadata == b"raise":
        limit.max_bytes = 2 * CHUNK
    yield runtime_pb2.ExpertResponse(metadata=b"header read")
    chunk = await anext(requests)
    yield runtime_pb2.ExpertResponse(metadata=f"chunk of {len(chunk.metadata)} bytes".encode())


async def send_back_to_back(header: bytes) -> list[bytes]:
    server = await P2P.create()
    client = await P2P.create(initial_peers=await server.get_visible_maddrs())
    try:
        await add_bounded_stream_handler(server, HANDLE, slow_handler)
        _, reader, writer = await client.call_binary_stream_handler(server.peer_id, HANDLE)
        await P2P.send_protobuf(runtime_pb2.ExpertRequest(metadata=header), writer)
        await P2P.send_protobuf(runtime_pb2.ExpertRequest(metadata=b"x" * CHUNK), writer)
        replies = []
        for _ in range(2):
            reply, _ = await asyncio.wait_for(P2P.receive_protobuf(runtime_pb2.ExpertResponse, reader), 30)
            replies.append(reply.metadata)
        writer.close()
        return replies
    finally:
        await client.shutdown()
        await server.shutdown()


def test_a_chunk_sent_right_after_its_header_waits_for_the_handler_to_raise_the_limit():
    assert asyncio.run(send_back_to_back(b"raise")) == [b"header read", f"chunk of {CHUNK} bytes".encode()]


def test_a_chunk_the_handler_does_not_allow_is_still_refused_unread():
    header_reply, refusal = asyncio.run(send_back_to_back(b"keep the limit"))
    assert header_reply == b"header read"
    error = decode_metadata(refusal)
    assert error["type"] == "error" and error["code"] == "bad_request"
    assert "exceeds this session's limit of 65,536" in error["message"]
