"""Server A's side of a cache hand-off: push a session's cache to server B (over a direct stream where B
announces one, else over libp2p: `swarm.stream_opener`).

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

from hivemind.p2p import P2P
from hivemind.proto import runtime_pb2

from llm_swarm.server.cache_progress import CacheProgress
from llm_swarm.server.cache_receiver import ChunkAck
from llm_swarm.server.session import Session
from llm_swarm.swarm.handoff_wire import CHUNK_BYTES, CacheAccepted, CacheChunk, HandOff, PushCache
from llm_swarm.swarm.stream_opener import StreamOpener, stream_path
from llm_swarm.swarm.wire import Error, ErrorCode, ProtocolError, decode_metadata, encode, parse

WINDOW = 2  # chunks in flight: keeps the link busy while acknowledgements measure it
REPLY_TIMEOUT = 30.0  # seconds to wait for any one answer of B
PROBE_SECONDS = 0.2  # judge the link only after this long (and one acknowledgement)
FOLLOW_TIMEOUT = 120.0  # seconds a push following a prompt waits for its next chunk to be computed


@dataclass(frozen=True)
class PushResult:
    bytes: int
    seconds: float
    path: str  # "direct" or "libp2p" (`swarm.stream_opener.stream_path`)


class HandOffTooSlow(ProtocolError):
    def __init__(self, projected: float, rate: float, allowed: float):
        super().__init__(
            ErrorCode.NO_CACHE_ROOM,  # not the client's fault, nor ours: the link; the client replays
            f"hand-off too slow: {projected:.1f} s projected at {rate / 1e6:.1f} MB/s, "
            f"more than the {allowed:.1f} s a replay is expected to take",
        )


async def push_cache(
    streams: StreamOpener,
    handle_name: str,
    session: Session,
    order: HandOff,
    progress: CacheProgress | None = None,
) -> PushResult:
    """Push positions `[0, order.length)` of `session`'s cache to `order.target_session` on
    `order.target_peer`; raises ProtocolError (B refused, or too slow) or a transport error.

    Without `progress` the positions are computed: they go block by block. With it (`HandOff.follow`)
    they are being computed by the session's prompt: each range goes, every block of it, once the
    prompt's chunk that computes it is done; the pace is judged only from the prompt's end (before,
    the push waits for compute, not for the link)."""
    cache = session.cache
    if progress is None and order.length > cache.length:
        raise ProtocolError(
            ErrorCode.BAD_REQUEST, f"cannot hand off {order.length} positions: the cache holds {cache.length}"
        )
    # a sliding-window block sends only the positions it keeps at that length (its ring), which is
    # what the receiving session's block keeps too
    firsts = [cache.oldest_kept(block, order.length) for block in range(cache.num_blocks)]
    if progress is None and any(first < cache.oldest_kept(block) for block, first in enumerate(firsts)):
        raise ProtocolError(
            ErrorCode.BAD_REQUEST,
            f"cannot hand off {order.length} positions: the cache's sliding-window blocks moved past them",
        )
    per_position = cache.position_bytes
    positions = max(1, CHUNK_BYTES // per_position)
    total = per_position * sum(order.length - first for first in firsts)
    if progress is not None:
        # B waits at most its idle timeout between messages: a prompt queued behind others here must
        # not use that up before its first chunk exists, so the stream opens once one does
        await progress.wait_beyond(0, FOLLOW_TIMEOUT)
    reader, writer = await streams.open(order.target_peer, handle_name, REPLY_TIMEOUT)
    started = time.monotonic()
    pace = _Pace(total, order.max_seconds)
    in_flight: deque[int] = deque()  # bytes of each chunk sent and not yet acknowledged

    async def send(block: int, position: int, end: int) -> None:
        keys, values = cache.read(block, position, end)
        chunk = CacheChunk(block=block, position=position)
        await P2P.send_protobuf(encode(chunk, [keys, values]), writer)
        in_flight.append(per_position * (end - position))
        while len(in_flight) >= WINDOW:
            await receive_reply(reader, ChunkAck)
            pace.acked += in_flight.popleft()
            pace.check()

    try:
        header = PushCache(session_id=order.target_session, token=order.token, length=order.length)
        await P2P.send_protobuf(encode(header), writer)
        if progress is None:
            pace.start()
            for block in range(cache.num_blocks):
                for position in range(firsts[block], order.length, positions):
                    await send(block, position, min(position + positions, order.length))
        else:
            sent = 0
            while sent < order.length:
                ready = min(await progress.wait_beyond(sent, FOLLOW_TIMEOUT), order.length)
                if ready == order.length:
                    pace.start()  # the prompt is done: from here the link alone sets the pace
                for position in range(sent, ready, positions):
                    end = min(position + positions, ready)
                    for block in range(cache.num_blocks):
                        if max(position, firsts[block]) < end:
                            await send(block, max(position, firsts[block]), end)
                sent = ready
        for _ in range(len(in_flight)):
            await receive_reply(reader, ChunkAck)
        await receive_reply(reader, CacheAccepted)
        return PushResult(total, time.monotonic() - started, stream_path(writer))
    finally:
        with contextlib.suppress(Exception):
            writer.write(P2P.ERROR_MARKER + len(b"").to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER))
        writer.close()


class _Pace:
    """Bytes B acknowledged since the pace started, and whether the rest would fit in `allowed` s."""

    def __init__(self, total: int, allowed: float):
        self.total, self.allowed = total, allowed
        self.acked = 0
        self.started: float | None = None
        self.base = 0  # bytes acknowledged when it started

    def start(self) -> None:
        if self.started is None:
            self.started, self.base = time.monotonic(), self.acked

    def check(self) -> None:
        if self.started is None:
            return
        elapsed, acked = time.monotonic() - self.started, self.acked - self.base
        if elapsed < PROBE_SECONDS or acked <= 0:
            return
        rate = acked / elapsed
        projected = (self.total - self.base) / rate
        if projected > self.allowed:
            raise HandOffTooSlow(projected, rate, self.allowed)


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
