"""Server B's side of a cache hand-off: a pushed attention cache, checked and written into a session.

A push is accepted only for a session its client opened to receive one (`Open.cache_token` and
`Open.cache_from`), only from the peer the client named, only with the client's token, only before the
session's first step, and only once at a time. Every chunk is checked before it is written: its place
(each block's positions in order without gaps, nothing past the pushed length or the session's
max_length), its shapes (the session's batch, KV heads and head size), a float dtype and finite
values. The stream is bounded in message size (`StreamLimit`), in idle time between messages and in
total time. Whatever fails, the session is left as it was opened (empty, no extra memory held), so
the client can replay into it; an accepted push leaves it at the pushed length, ready for the
client's next step.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections.abc import AsyncIterator, Callable

import torch
from hivemind.p2p import P2PContext
from hivemind.proto import runtime_pb2

from llm_swarm.server.bounded_stream import StreamLimit
from llm_swarm.server.session import FLOAT_DTYPES, Session
from llm_swarm.swarm.handoff_wire import CHUNK_BYTES, CacheAccepted, CacheChunk, PushCache
from llm_swarm.swarm.tensor_wire import all_finite
from llm_swarm.swarm.wire import Error, ErrorCode, ProtocolError, decode_tensors, encode, parse

logger = logging.getLogger(__name__)

PUSH_IDLE_TIMEOUT = 30.0  # seconds B waits for the next chunk before giving up on the sender
PUSH_TOTAL_TIMEOUT = 600.0  # seconds a whole push may take (a slow link), however busy the sender is
CHUNK_MESSAGE_LIMIT = CHUNK_BYTES + 64 * 1024  # a chunk's tensors plus their framing


class ChunkAck(CacheAccepted):
    """B -> A after each chunk: positions of the chunk's block held so far (A paces itself on these)."""

    type: str = "chunk_ack"


async def receive_cache(
    requests: AsyncIterator[runtime_pb2.ExpertRequest],
    context: P2PContext,
    limit: StreamLimit,
    find_session: Callable[[str], Session | None],
    idle_timeout: float = PUSH_IDLE_TIMEOUT,
) -> AsyncIterator[runtime_pb2.ExpertResponse]:
    """The push stream's handler: `PushCache`, then `CacheChunk`s, each acknowledged; `CacheAccepted`
    at the end, or one `Error` (and the session stays empty). `idle_timeout`: the longest wait for the
    sender's next message (the server's session idle timeout, at most PUSH_IDLE_TIMEOUT)."""
    idle_timeout = min(idle_timeout, PUSH_IDLE_TIMEOUT)
    session: Session | None = None
    try:
        first = await asyncio.wait_for(anext(requests), idle_timeout)
        header = parse(first.metadata, PushCache)
        session = _claim(find_session(header.session_id), header, str(context.remote_id))
        # a chunk holds at least one position: with a very wide cache that alone may pass CHUNK_BYTES
        cache = session.cache
        one_position = cache.position_bytes * 4 // cache.keys[0].element_size()  # as float32 on the wire
        limit.max_bytes = max(CHUNK_MESSAGE_LIMIT, one_position + 64 * 1024)
        started, deadline = time.monotonic(), time.monotonic() + PUSH_TOTAL_TIMEOUT
        writer = _CacheWriter(session, header.length)
        while not writer.done:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ProtocolError(ErrorCode.BAD_REQUEST, f"push not done within {PUSH_TOTAL_TIMEOUT:.0f} s")
            request = await asyncio.wait_for(anext(requests), min(idle_timeout, left))
            chunk = parse(request.metadata, CacheChunk)
            held = writer.write(chunk, decode_tensors(request))
            yield encode(ChunkAck(length=held), request=False)
        session.cache.length = header.length
        session.receiving = False
        session.cache_token = None  # one push per session: the token is spent
        logger.info(
            "session %s: received a cache of %d positions x %d blocks from %s in %.0f ms",
            session.session_id[:8],
            header.length,
            session.cache.num_blocks,
            str(context.remote_id)[-8:],
            (time.monotonic() - started) * 1e3,
        )
        yield encode(CacheAccepted(length=header.length), request=False)
    except (ProtocolError, TimeoutError, StopAsyncIteration) as error:
        _release(session)
        code = error.code if isinstance(error, ProtocolError) else ErrorCode.BAD_REQUEST
        text = str(error) if isinstance(error, ProtocolError) else "the push ended or stalled before its end"
        logger.warning("cache push from %s refused: %s", str(context.remote_id)[-8:], text)
        yield encode(Error(code=code, message=text), request=False)
    except BaseException:
        _release(session)
        raise


def _claim(session: Session | None, header: PushCache, sender: str) -> Session:
    """The session this push may fill, now marked as receiving; refuses anything else in one line."""
    refused = None
    if session is None or session.cache_token is None:
        refused = "no session here expects a cache under that id"
    elif not hmac.compare_digest(session.cache_token, header.token):
        refused = "the token does not match the one the session's client gave"
    elif sender != session.cache_from:
        refused = "this peer is not the one the session's client named as the sender"
    elif session.receiving or session.cache.length or session.last_position >= 0:
        refused = "the session is already receiving a cache or has begun"
    elif header.length > session.max_length:
        refused = f"{header.length} positions exceed the session's max_length {session.max_length}"
    if refused is not None:
        raise ProtocolError(ErrorCode.BAD_REQUEST, refused)
    session.receiving = True
    return session


def _release(session: Session | None) -> None:
    """A failed push: the session is as it was opened (empty), ready for the client's replay."""
    if session is not None and session.receiving:
        session.receiving = False
        if session.cache is not None:
            session.cache.length = 0


class _CacheWriter:
    """Writes checked chunks into the session's cache: each block's positions in order, no gaps."""

    def __init__(self, session: Session, length: int):
        self.session, self.length = session, length
        cache = session.cache
        self.shapes = cache.position_shapes  # (batch, heads, width) of keys and of values
        # where each block's positions start: a sliding-window block keeps only the last ones
        self.held = [cache.oldest_kept(block, length) for block in range(cache.num_blocks)]
        self.left = cache.num_blocks  # blocks not yet at the pushed length

    @property
    def done(self) -> bool:
        return self.left == 0

    def write(self, chunk: CacheChunk, tensors: list[torch.Tensor]) -> int:
        if chunk.block >= len(self.held) or chunk.position != self.held[chunk.block]:
            expected = "a block of the session" if chunk.block >= len(self.held) else self.held[chunk.block]
            raise ProtocolError(
                ErrorCode.BAD_REQUEST,
                f"block {chunk.block} at position {chunk.position}: expected {expected} "
                f"({len(self.held)} blocks, each in order)",
            )
        self.block, self.position = chunk.block, chunk.position
        if len(tensors) != 2:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"a chunk carries keys and values, got {len(tensors)}")
        keys, values = tensors
        for tensor, (batch, heads, width) in zip(tensors, self.shapes, strict=True):
            fits = tensor.ndim == 4 and (tensor.shape[0], tensor.shape[1], tensor.shape[3]) == (
                batch,
                heads,
                width,
            )
            if tensor.dtype not in FLOAT_DTYPES or not fits or tensor.shape[2] < 1:
                raise ProtocolError(
                    ErrorCode.BAD_REQUEST,
                    f"a chunk holds float [{batch}, {heads}, n, {width}] keys and values, got {tensor.dtype} "
                    f"{tuple(tensor.shape)}",
                )
        count = keys.shape[2]
        if values.shape[2] != count or self.position + count > self.length:
            raise ProtocolError(
                ErrorCode.BAD_REQUEST,
                f"chunk of {count} positions at {self.position} passes the pushed length {self.length}",
            )
        if not (all_finite(keys) and all_finite(values)):
            raise ProtocolError(ErrorCode.BAD_REQUEST, "a chunk holds NaN or infinite values")
        cache = self.session.cache
        if cache is None:
            raise ProtocolError(ErrorCode.NOT_SERVING, "the session was closed while its cache arrived")
        end = self.position + count
        cache.write(self.block, self.position, keys, values)
        self.held[self.block] = end
        if end == self.length:
            self.left -= 1
        return end
