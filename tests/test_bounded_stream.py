"""The size-bounded stream transport (server/bounded_stream.py) over real libp2p daemons.

A cache push or a link probe sends its header and its first 1 MiB chunk back to back. The transport
reads a message only when the handler asks for it, so the chunk's length is checked against the limit
the handler set on reading the header, however busy the server is; a message still over the limit is
refused unread.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
from hivemind.p2p import P2P
from hivemind.proto import runtime_pb2

from llm_swarm.server.bounded_stream import add_bounded_stream_handler
from llm_swarm.swarm.step_frame import MARKER as FRAME_MARKER
from llm_swarm.swarm.step_frame import StepFrame
from llm_swarm.swarm.wire import decode_metadata

pytestmark = pytest.mark.version_neutral  # no transformers code: one leg runs it

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


@asynccontextmanager
async def serving(handler, step_frames: bool = False) -> AsyncIterator[tuple[P2P, P2P]]:
    """(server, client): two real p2p daemons, `handler` on the server's bounded stream HANDLE."""
    server = await P2P.create()
    client = await P2P.create(initial_peers=await server.get_visible_maddrs())
    try:
        await add_bounded_stream_handler(server, HANDLE, handler, step_frames=step_frames)
        yield server, client
    finally:
        await client.shutdown()
        await server.shutdown()


def request(metadata: bytes) -> bytes:
    return runtime_pb2.ExpertRequest(metadata=metadata).SerializeToString()


async def two_replies(handler, *messages: bytes | StepFrame, step_frames: bool = False) -> list[bytes]:
    """The metadata of `handler`'s first two replies to `messages` (serialized, whatever their bytes,
    or step frames under their own marker), sent back to back in the stream's framing."""
    async with serving(handler, step_frames) as (server, client):
        _, reader, writer = await client.call_binary_stream_handler(server.peer_id, HANDLE)
        for message in messages:
            marker = FRAME_MARKER if isinstance(message, StepFrame) else P2P.MESSAGE_MARKER
            data = b"".join(message.parts) if isinstance(message, StepFrame) else message
            writer.write(marker + len(data).to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER) + data)
        await writer.drain()
        replies = []
        for _ in range(2):
            reply, _ = await asyncio.wait_for(P2P.receive_protobuf(runtime_pb2.ExpertResponse, reader), 30)
            replies.append(reply.metadata)
        writer.close()
        return replies


async def send_back_to_back(header: bytes) -> list[bytes]:
    return await two_replies(slow_handler, request(header), request(b"x" * CHUNK))


def test_a_chunk_sent_right_after_its_header_waits_for_the_handler_to_raise_the_limit():
    assert asyncio.run(send_back_to_back(b"raise")) == [b"header read", f"chunk of {CHUNK} bytes".encode()]


def test_a_chunk_the_handler_does_not_allow_is_still_refused_unread():
    header_reply, refusal = asyncio.run(send_back_to_back(b"keep the limit"))
    assert header_reply == b"header read"
    error = decode_metadata(refusal)
    assert error["type"] == "error" and error["code"] == "bad_request"
    assert "exceeds this session's limit of 65,536" in error["message"]


async def refusing_handler(requests, context, limit):
    """Refuses at the first message, as a cache receiver refuses a header, and ends the stream."""
    await anext(requests)
    yield runtime_pb2.ExpertResponse(metadata=b"refused")


async def reply_while_client_still_sends(rounds: int) -> list[bytes]:
    """A header, then messages the handler never reads: each round's one reply must reach the client."""
    replies = []
    async with serving(refusing_handler) as (server, client):
        for _ in range(rounds):
            _, reader, writer = await client.call_binary_stream_handler(server.peer_id, HANDLE)
            try:
                await P2P.send_protobuf(runtime_pb2.ExpertRequest(metadata=b"header"), writer)
                for _ in range(8):
                    await P2P.send_protobuf(runtime_pb2.ExpertRequest(metadata=b"x" * 60_000), writer)
            except ConnectionError:
                pass
            try:
                receiving = P2P.receive_protobuf(runtime_pb2.ExpertResponse, reader)
                reply, _ = await asyncio.wait_for(receiving, 30)
                replies.append(reply.metadata)
            except (asyncio.IncompleteReadError, ConnectionError):
                replies.append(b"closed")
            writer.close()
    return replies


def test_a_handler_that_ends_first_still_gets_its_reply_to_a_client_that_is_still_sending():
    """A refused cache push lost its error (CI, once): the server closed the stream while the sender's
    chunk was unread, and the stream's reset overtook the reply. The server now lets the client read."""
    assert asyncio.run(reply_while_client_still_sends(10)) == [b"refused"] * 10


async def echo_handler(requests, context, limit):
    """Answers each request with its metadata (a step frame with its kind and size)."""
    async for message in requests:
        if isinstance(message, StepFrame):
            yield runtime_pb2.ExpertResponse(
                metadata=f"frame of kind {message.parts[0][0]}, {message.nbytes} bytes".encode()
            )
        else:
            yield runtime_pb2.ExpertResponse(metadata=message.metadata)


def test_a_message_that_is_no_request_gets_a_clear_refusal_after_the_answers_before_it():
    garbage = b"\x0a\xff\xff\xff\xff\x0f"  # a field whose length runs past the message
    answer, refusal = asyncio.run(two_replies(echo_handler, request(b"fine"), garbage))
    assert answer == b"fine"
    error = decode_metadata(refusal)
    assert error["type"] == "error" and error["code"] == "bad_request"
    assert "not a request" in error["message"]


def test_a_step_frame_reaches_a_handler_that_takes_them_and_is_refused_by_one_that_does_not():
    frame = StepFrame.received(bytes([1]) + bytes(39))
    answers = asyncio.run(two_replies(echo_handler, frame, request(b"after"), step_frames=True))
    assert answers == [b"frame of kind 1, 40 bytes", b"after"]
    answer, refusal = asyncio.run(two_replies(echo_handler, request(b"before"), frame))
    assert answer == b"before"
    error = decode_metadata(refusal)
    assert error["code"] == "bad_request" and "invalid message marker b'\\x02'" in error["message"], error
