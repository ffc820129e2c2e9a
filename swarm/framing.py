"""One message of hivemind's stream framing (a marker byte, an 8-byte length, the protobuf) written in
one piece.

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

JOIN_LIMIT = 1 << 20  # messages up to this size are joined into one write


async def send_message(
    message: runtime_pb2.ExpertRequest | runtime_pb2.ExpertResponse,
    writer: asyncio.StreamWriter,
    timeout: float | None = None,
) -> None:
    """`message` in hivemind's framing; waits (at most `timeout` seconds, None: no limit) only while
    the socket has not taken all of it."""
    data = message.SerializeToString()
    if len(data) > JOIN_LIMIT:  # the message serialized once: hivemind's chunked writes of its bytes
        writer.write(P2P.MESSAGE_MARKER)
        sending = P2P.send_raw_data(data, writer)
        await (asyncio.wait_for(sending, timeout) if timeout is not None else sending)
        return
    writer.write(P2P.MESSAGE_MARKER + len(data).to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER) + data)
    if writer.transport.get_write_buffer_size():
        draining = writer.drain()
        await (asyncio.wait_for(draining, timeout) if timeout is not None else draining)
