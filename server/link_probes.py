"""Server-to-server link rates, measured before a hand-off needs them (docs/architecture.md, "Link probes").

A cache hand-off pays only over a fast link between two servers, and the client decides whether to ask
for one from the rate the sender announces (`ServerInfo.links`). A server learned that rate only from a
hand-off it had already done; now it also probes: every `link_probe_period` seconds it pushes a few
chunks of filler bytes to up to `PROBES_PER_ROUND` servers that hold some of its blocks (those it could
hand a session to), least recently measured first, and records bytes over time of B's acknowledgements.

The receiving side is bounded like a cache push: a header naming at most `PROBE_MAX_CHUNKS` chunks,
chunks of at most `CHUNK_BYTES`, each acknowledged; an idle limit between messages and a total limit;
one probe at a time per server (others are refused at once, so probes cannot pile up); nothing kept.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from functools import partial

import torch
from hivemind.p2p import P2P, P2PContext
from hivemind.proto import runtime_pb2

from llm_swarm.server.bounded_stream import StreamLimit
from llm_swarm.server.cache_sender import receive_reply
from llm_swarm.server.roster_rounds import roster_rounds
from llm_swarm.swarm.dht_records import fetch_servers_async
from llm_swarm.swarm.handoff_wire import CHUNK_BYTES, ProbeAck, ProbeChunk, ProbeLink
from llm_swarm.swarm.server_info import ServerInfo
from llm_swarm.swarm.stream_opener import StreamOpener
from llm_swarm.swarm.wire import Error, ErrorCode, ProtocolError, decode_tensors, encode, parse

logger = logging.getLogger(__name__)

PROBE_HANDLE = "probe_link"
PROBE_CHUNKS = 4  # 4 MB per probe: long enough to measure a link, short next to a hand-off
PROBE_IDLE_TIMEOUT = 10.0  # seconds B waits for A's next message
PROBE_TOTAL_TIMEOUT = 60.0  # seconds a whole probe may take on either side
PROBES_PER_ROUND = 2
CHUNK_MESSAGE_LIMIT = CHUNK_BYTES + 64 * 1024


async def receive_probe(
    requests: AsyncIterator[runtime_pb2.ExpertRequest],
    context: P2PContext,
    limit: StreamLimit,
    busy: asyncio.Lock,
) -> AsyncIterator[runtime_pb2.ExpertResponse]:
    """B's handler: `ProbeLink`, then its chunks, each answered `ProbeAck`; or one `Error`."""
    if busy.locked():
        yield encode(
            Error(code=ErrorCode.NO_CACHE_ROOM, message="another link probe is running"), request=False
        )
        return
    async with busy:
        try:
            deadline = time.monotonic() + PROBE_TOTAL_TIMEOUT
            first = await asyncio.wait_for(anext(requests), PROBE_IDLE_TIMEOUT)
            header = parse(first.metadata, ProbeLink)
            limit.max_bytes = CHUNK_MESSAGE_LIMIT
            received = 0
            for _ in range(header.chunks):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ProtocolError(
                        ErrorCode.BAD_REQUEST, f"probe not done within {PROBE_TOTAL_TIMEOUT:.0f} s"
                    )
                request = await asyncio.wait_for(anext(requests), min(PROBE_IDLE_TIMEOUT, left))
                parse(request.metadata, ProbeChunk)
                tensors = decode_tensors(request)
                if len(tensors) != 1 or tensors[0].dtype != torch.uint8 or tensors[0].numel() > CHUNK_BYTES:
                    raise ProtocolError(
                        ErrorCode.BAD_REQUEST,
                        f"a probe chunk is one uint8 tensor of at most {CHUNK_BYTES} bytes",
                    )
                received += tensors[0].numel()
                yield encode(ProbeAck(bytes=received), request=False)
        except ProtocolError as error:
            yield encode(Error(code=error.code, message=str(error)), request=False)
        except (TimeoutError, StopAsyncIteration):
            logger.info("link probe from %s abandoned by the sender", str(context.remote_id)[-8:])


async def probe_link(
    streams: StreamOpener, handle_name: str, peer_id: str, chunks: int = PROBE_CHUNKS
) -> float:
    """Bytes per second from us to `peer_id`, measured on its acknowledgements of `chunks` chunks,
    over the path a cache hand-off there takes."""
    filler = torch.zeros(CHUNK_BYTES, dtype=torch.uint8)
    reader, writer = await streams.open(peer_id, handle_name, PROBE_IDLE_TIMEOUT)
    try:
        await P2P.send_protobuf(encode(ProbeLink(chunks=chunks)), writer)
        started = time.monotonic()
        in_flight = 0
        for _ in range(chunks):
            await P2P.send_protobuf(encode(ProbeChunk(), [filler]), writer)
            in_flight += 1
            if in_flight >= 2:  # two in flight keep the link busy while acknowledgements come back
                await _acknowledged(reader)
                in_flight -= 1
        for _ in range(in_flight):
            acked = await _acknowledged(reader)
        return acked / max(time.monotonic() - started, 1e-6)
    finally:
        with contextlib.suppress(Exception):
            writer.close()


async def _acknowledged(reader: asyncio.StreamReader) -> int:
    reply = await receive_reply(
        reader, ProbeAck, PROBE_IDLE_TIMEOUT, "the probed server", "the probed server refused"
    )
    return reply.bytes


def probe_targets(
    servers: dict[str, ServerInfo], me: str, start: int, end: int, last_probed: dict[str, float]
) -> list[str]:
    """Servers holding some of our blocks `[start, end)` (where we could hand a session), least
    recently probed first, at most PROBES_PER_ROUND."""
    overlapping = [
        peer for peer, info in servers.items() if peer != me and info.start < end and start < info.end
    ]
    overlapping.sort(key=lambda peer: last_probed.get(peer, float("-inf")))
    return overlapping[:PROBES_PER_ROUND]


async def probe_links_forever(
    streams: StreamOpener,
    handle_name: str,
    period: float,
    fetch: Callable[[], Awaitable[dict[str, ServerInfo]]],
    me: str,
    span: Callable[[], tuple[int, int] | None],
    record: Callable[[str, float], None],
) -> None:
    """Every `period` seconds, probe the links to a few servers holding our blocks; `record(peer, rate)`."""
    last_probed: dict[str, float] = {}
    async for blocks, servers in roster_rounds(period, fetch, span, "link probes"):
        for peer in probe_targets(servers, me, *blocks, last_probed):
            last_probed[peer] = time.monotonic()
            try:
                rate = await asyncio.wait_for(probe_link(streams, handle_name, peer), PROBE_TOTAL_TIMEOUT)
            except Exception as error:
                logger.info("link probe to %s failed: %s", peer[-8:], error or type(error).__name__)
                continue
            logger.info("link to %s: %.1f MB/s (probe of %d MB)", peer[-8:], rate / 1e6, PROBE_CHUNKS)
            record(peer, rate)
        if len(last_probed) > 4 * len(servers) + 16:  # servers that left: forget them
            for peer in [peer for peer in last_probed if peer not in servers]:
                del last_probed[peer]


def start_link_probes(server, streams: StreamOpener) -> asyncio.Task | None:
    """The probing task of a serving `server.server.Server` (None when `--link-probe-period 0`); it
    always probes for the span served now, which a move may change."""
    config = server.config
    if config.link_probe_period <= 0:
        return None

    def span() -> tuple[int, int] | None:
        served = server.served
        return (served.start, served.end) if served is not None and served.servicer is not None else None

    def record(peer: str, rate: float) -> None:
        if server.served is not None and server.served.servicer is not None:
            server.served.servicer.record_link_rate(peer, rate)

    handle = server.served.servicer.probe_handle(config.dht_prefix)
    fetch = partial(fetch_servers_async, server.dht, config.dht_prefix, server.limits)
    return asyncio.create_task(
        probe_links_forever(streams, handle, config.link_probe_period, fetch, server.peer_id, span, record)
    )
