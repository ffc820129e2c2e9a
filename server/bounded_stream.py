"""The inference stream's transport with a size limit checked *before* a message is read.

hivemind's protobuf stream handler reads each message whole (`readexactly(length)`) before the
handler sees it, so a peer could announce a terabyte and make the server buffer whatever it sends.
This handler speaks the same framing (a marker byte, an 8-byte length, the protobuf), so clients
keep using hivemind's stub unchanged, but compares the announced length with the stream's current
limit first: the handler raises the limit once a session is open (to what its shape allows) and an
oversized message gets a BAD_REQUEST reply and the stream is closed, unread.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import closing, suppress
from dataclasses import dataclass

from google.protobuf.message import DecodeError
from hivemind.p2p import P2P, P2PContext
from hivemind.p2p.p2p_daemon_bindings.datastructures import StreamInfo
from hivemind.proto import runtime_pb2

from llm_swarm.swarm.direct_listener import DirectListener
from llm_swarm.swarm.framing import send_message
from llm_swarm.swarm.step_frame import MARKER as FRAME_MARKER
from llm_swarm.swarm.step_frame import StepFrame
from llm_swarm.swarm.wire import Error, ErrorCode, encode

logger = logging.getLogger(__name__)

OPEN_MESSAGE_LIMIT = 64 * 1024  # before a session is open, only an Open message is expected
DISCARD_SECONDS = 5.0  # after refusing a message, how long the client may keep sending into the void


@dataclass
class StreamLimit:
    """The largest message the stream accepts now; the handler raises it once it knows the session."""

    max_bytes: int = OPEN_MESSAGE_LIMIT


Request = runtime_pb2.ExpertRequest | StepFrame
Handler = Callable[
    [AsyncIterator[Request], P2PContext, StreamLimit],
    AsyncIterator[runtime_pb2.ExpertResponse | StepFrame],
]


async def add_bounded_stream_handler(
    p2p: P2P, name: str, handler: Handler, direct: DirectListener | None = None, step_frames: bool = False
) -> None:
    """Serve `handler` under `name` over libp2p and, with `direct`, over its direct streams too.
    `step_frames`: the handler takes step frames (`swarm.step_frame`) besides protobuf requests;
    without it a frame is refused as any unknown marker is.

    A message is read when the handler asks for the next one, on the handler's own task: a step costs
    no hand-off from a reading task through a queue (an event loop iteration each), and the limit a
    header is checked against is the one the handler set after the messages before it (a cache push's
    or a link probe's sender writes its header and its first 1 MiB chunk back to back). The socket's
    and the stream reader's buffers hold what arrives meanwhile. A closed connection or a refused
    message raises out of the handler's read, as the end of its task: its cleanup runs, and a refused
    message gets its `Error` reply after it."""

    async def handle_stream(
        stream_info: StreamInfo, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        context = P2PContext(handle_name=name, local_id=p2p.peer_id, remote_id=stream_info.peer_id)
        limit = StreamLimit()
        client_ended = False  # the client sent its end-of-stream marker: nothing more will come

        async def read_requests() -> AsyncIterator[runtime_pb2.ExpertRequest]:
            nonlocal client_ended
            while (request := await _receive(reader, limit, step_frames)) is not None:
                yield request
            client_ended = True

        with closing(writer):
            try:
                async for response in handler(read_requests(), context, limit):
                    await send_message(response, writer)
            except (asyncio.IncompleteReadError, ConnectionError):  # the client closed the connection
                return
            except _Refused as error:
                logger.warning("peer %s: %s; stream closed", str(stream_info.peer_id)[-8:], error)
                reply = encode(Error(code=ErrorCode.BAD_REQUEST, message=str(error)), request=False)
                with suppress(Exception):
                    await P2P.send_protobuf(reply, writer)
                    # closing now would reset the stream under the client, losing the reply: let it
                    # see the reply first, dropping (not keeping) what it still sends
                    await asyncio.wait_for(_discard(reader), DISCARD_SECONDS)
                return
            except Exception:  # the caller went away mid-reply: nothing more to tell it
                logger.debug("stream %s ended while replying", name, exc_info=True)
                return
            if not client_ended:
                # the handler ended first (an error, a refused push): the client may still be sending,
                # and closing on unread data resets the stream, which can overtake the reply just
                # written; let the client read it, dropping what it still sends until its
                # end-of-stream marker (a TLS stream has no half-close to wait for instead) or the end
                # of the connection
                with suppress(Exception):
                    async with asyncio.timeout(DISCARD_SECONDS):
                        while await _receive(reader, limit, step_frames) is not None:
                            pass

    await p2p.add_binary_stream_handler(name, handle_stream)
    if direct is not None:
        direct.add_handler(name, handle_stream)


class _Refused(Exception):
    pass


async def _receive(
    reader: asyncio.StreamReader, limit: StreamLimit, step_frames: bool = False
) -> Request | None:
    """One framed message (None for the end-of-stream marker), refused unread if over the limit and
    refused if its bytes are no request; a step frame as it came, when the stream takes them."""
    header = await reader.readexactly(1 + P2P.HEADER_LEN)
    marker, length = header[:1], int.from_bytes(header[1:], P2P.BYTEORDER)
    if length > limit.max_bytes:
        raise _Refused(f"message of {length:,} bytes exceeds this session's limit of {limit.max_bytes:,}")
    data = await reader.readexactly(length)
    if marker == P2P.ERROR_MARKER:
        return None  # hivemind's stub ends its request stream with an (empty) error message
    if marker == FRAME_MARKER and step_frames:
        return StepFrame.received(data)
    if marker != P2P.MESSAGE_MARKER:
        raise _Refused(f"invalid message marker {marker!r}")
    request = runtime_pb2.ExpertRequest()
    try:
        request.ParseFromString(data)
    except DecodeError:
        raise _Refused(f"a message of {length:,} bytes that is not a request") from None
    return request


async def _discard(reader: asyncio.StreamReader) -> None:
    """Read and drop the rest of the stream, a chunk at a time (memory stays constant)."""
    while await reader.read(1 << 16):
        pass
