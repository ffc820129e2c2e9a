"""One message of hivemind's stream framing (a marker byte, an 8-byte length, the message) written in
one piece, and read back with step frames (`swarm.step_frame`) told apart from protobuf messages.

hivemind's `P2P.send_protobuf` writes the three parts one after another; on an idle socket each
`write` is a system call of its own, and the p2p daemon forwards what it reads, so a small message
crossed the daemons as three frames. A step's message is a few kilobytes: here it is one write, and
the wait for the socket to drain is paid only when it did not take everything at once. Larger
messages (a prompt's hidden states, a cache chunk) keep hivemind's chunked writes: joining them
would copy megabytes to save two system calls. The bytes on the wire are the same either way.
"""

from __future__ import annotations

import asyncio

from hivemind.p2p import P2P
from hivemind.proto import runtime_pb2
from hivemind.proto.p2pd_pb2 import RPCError

from llm_swarm.swarm.step_frame import MARKER as FRAME_MARKER
from llm_swarm.swarm.step_frame import StepFrame

JOIN_LIMIT = 1 << 20  # messages up to this size are joined into one write
CHUNK = 1 << 16  # what larger messages are written in (hivemind's `send_raw_data` chunks)

Message = runtime_pb2.ExpertRequest | runtime_pb2.ExpertResponse | StepFrame
Reply = runtime_pb2.ExpertResponse | StepFrame


async def send_message(message: Message, writer: asyncio.StreamWriter, timeout: float | None = None) -> None:
    """`message` in hivemind's framing (a step frame under its own marker); waits (at most `timeout`
    seconds, None: no limit) only while the socket has not taken all of it."""
    if write_message(message, writer):
        draining = writer.drain()
        await (asyncio.wait_for(draining, timeout) if timeout is not None else draining)


def write_message(message: Message, writer: asyncio.StreamWriter) -> bool:
    """`message` handed to the transport at once, without waiting; whether the socket did not take
    all of it (the caller then drains before writing more)."""
    if isinstance(message, StepFrame):
        marker, parts, size = FRAME_MARKER, message.parts, message.nbytes
    else:
        data = message.SerializeToString()
        marker, parts, size = P2P.MESSAGE_MARKER, (data,), len(data)
    header = marker + size.to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER)
    if size > JOIN_LIMIT:  # in hivemind's chunks, not joined: megabytes are not copied twice
        writer.write(header)
        for part in parts:
            view = memoryview(part)
            for offset in range(0, len(view), CHUNK):
                chunk = view[offset : offset + CHUNK]
                # a transport may keep what it could not send yet: a tensor's own memory is copied
                writer.write(chunk if isinstance(part, bytes) else bytes(chunk))
        return True
    writer.write(b"".join((header, *parts)))
    return bool(writer.transport.get_write_buffer_size())


async def receive_reply(reader: asyncio.StreamReader) -> tuple[Reply | None, RPCError | None]:
    """The stream's next reply: `(response or step frame, None)`, or `(None, error)` for the p2p
    layer's own error; raises IncompleteReadError at the stream's end and ValueError for a marker
    that is neither."""
    header = await reader.readexactly(1 + P2P.HEADER_LEN)
    data = await reader.readexactly(int.from_bytes(header[1:], P2P.BYTEORDER))
    marker = header[:1]
    if marker == FRAME_MARKER:
        return StepFrame.received(data), None
    if marker == P2P.MESSAGE_MARKER:
        return runtime_pb2.ExpertResponse.FromString(data), None
    if marker == P2P.ERROR_MARKER:
        return None, RPCError.FromString(data)
    raise ValueError(f"invalid message marker {marker!r}")
