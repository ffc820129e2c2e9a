"""Server A's side of a cache hand-off: push a session's cache to server B over the P2P transport.

Chunks go block by block, at most `CHUNK_BYTES` each, with at most `WINDOW` unacknowledged: B's
acknowledgements measure the link while the push runs (bytes B holds, not bytes our daemon buffered),
and once that measure says the whole push would take longer than the client allowed (`max_seconds`, its
estimate of replaying instead), A stops and says so: the client then replays, having lost about one
probe's time. Every wait for B is bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from dataclasses import dataclass

from hivemind.p2p import P2P, PeerID
from hivemind.proto import runtime_pb2

from server.cache_receiver import ChunkAck
from server.session import Session
from swarm.handoff_wire import CHUNK_BYTES, CacheAccepted, CacheChunk, HandOff, PushCache
from swarm.wire import Error, ErrorCode, ProtocolError, decode_metadata, encode, parse

WINDOW = 2  # chunks in flight: keeps the link busy while acknowledgements measure it
REPLY_TIMEOUT = 30.0  # seconds to wait for any one answer of B
PROBE_SECONDS = 0.2  # judge the link only after this long (and one acknowledgement)


@dataclass(frozen=True)
class PushResult:
    bytes: int
    seconds: float


class HandOffTooSlow(ProtocolError):
    def __init__(self, projected: float, rate: float, allowed: float):
        super().__init__(
            ErrorCode.NO_CACHE_ROOM,  # not the client's fault, nor ours: the link; the client replays
            f"hand-off too slow: {projected:.1f} s projected at {rate / 1e6:.1f} MB/s, "
            f"more than the {allowed:.1f} s a replay is expected to take",
        )


async def push_cache(p2p: P2P, handle_name: str, session: Session, order: HandOff) -> PushResult:
    """Push positions `[0, order.length)` of `session`'s cache to `order.target_session` on
    `order.target_peer`; raises ProtocolError (B refused, or too slow) or a transport error."""
    cache = session.cache
    if order.length > cache.length:
        raise ProtocolError(
            ErrorCode.BAD_REQUEST, f"cannot hand off {order.length} positions: the cache holds {cache.length}"
        )
    per_position = 2 * cache.batch_size * cache.keys[0].shape[1] * cache.keys[0].shape[3]
    per_position *= cache.keys[0].element_size()
    positions = max(1, CHUNK_BYTES // per_position)
    total = per_position * order.length * cache.num_blocks
    peer = PeerID.from_base58(order.target_peer)
    _, reader, writer = await asyncio.wait_for(
        p2p.call_binary_stream_handler(peer, handle_name), REPLY_TIMEOUT
    )
    started = time.monotonic()
    try:
        header = PushCache(session_id=order.target_session, token=order.token, length=order.length)
        await P2P.send_protobuf(encode(header), writer)
        acked, in_flight = 0, deque()  # bytes of each chunk sent and not yet acknowledged
        for block in range(cache.num_blocks):
            for position in range(0, order.length, positions):
                end = min(position + positions, order.length)
                keys = cache.keys[block][:, :, position:end].contiguous()
                values = cache.values[block][:, :, position:end].contiguous()
                chunk = CacheChunk(block=block, position=position)
                await P2P.send_protobuf(encode(chunk, [keys, values]), writer)
                in_flight.append(per_position * (end - position))
                while len(in_flight) >= WINDOW:
                    await receive_reply(reader, ChunkAck)
                    acked += in_flight.popleft()
                    _check_pace(started, acked, total, order.max_seconds)
        for _ in range(len(in_flight)):
            await receive_reply(reader, ChunkAck)
        await receive_reply(reader, CacheAccepted)
        return PushResult(total, time.monotonic() - started)
    finally:
        with contextlib.suppress(Exception):
            writer.write(P2P.ERROR_MARKER + len(b"").to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER))
        writer.close()


def _check_pace(started: float, acked: int, total: int, allowed: float) -> None:
    elapsed = time.monotonic() - started
    if elapsed < PROBE_SECONDS or acked <= 0:
        return
    rate = acked / elapsed
    projected = total / rate
    if projected > allowed:
        raise HandOffTooSlow(projected, rate, allowed)


async def receive_reply(
    reader: asyncio.StreamReader,
    expected: type,
    timeout: float = REPLY_TIMEOUT,
    peer: str = "the receiver",
    refusal: str = "the receiving server refused the cache",
):
    """The next reply of the server at the other end of a push or probe stream, as `expected`; its
    error (`refusal`) or its failed handler (`peer`'s) as ProtocolError; waits at most `timeout` s."""
    response, failure = await asyncio.wait_for(
        P2P.receive_protobuf(runtime_pb2.ExpertResponse, reader), timeout
    )
    if failure is not None:
        raise ProtocolError(ErrorCode.INTERNAL, f"{peer}'s handler failed: {failure.message}")
    if decode_metadata(response.metadata).get("type") == "error":
        error = parse(response.metadata, Error)
        raise ProtocolError(error.code, f"{refusal}: {error.message}")
    return parse(response.metadata, expected)
