"""Finding the swarm's disjoint chains: the servers from the DHT records the client reads, or from the
trusted scheduler's status when one is given, each pinged for its round trip.

The scheduler's status adds what the records do not say: which managed servers it is about to move
(their assigned span differs from the one they serve), which a chain meant to last the whole batch
leaves out. Its roster is still checked against the records (a server must be one the client can
route to, with the span the scheduler says): a scheduler is trusted only as far as it can be checked.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Iterable

import grpc

from llm_swarm.client.batch.chains import BatchChain, ChainServer, disjoint_chains
from llm_swarm.client.connection import SwarmConnection
from llm_swarm.swarm.dht_records import fetch_scheduler_async
from llm_swarm.swarm.scheduler_api import scheduler_pb2 as pb
from llm_swarm.swarm.scheduler_api import scheduler_pb2_grpc as pb_grpc
from llm_swarm.swarm.server_info import ServerInfo
from llm_swarm.swarm.wire import InfoRequest, encode

logger = logging.getLogger(__name__)


def chain_server(peer: str, info: ServerInfo, rtt: float, span: tuple[int, int] | None = None) -> ChainServer:
    start, end = span if span is not None else (info.start, info.end)
    return ChainServer(
        peer_id=peer,
        name=info.public_name,
        start=start,
        end=end,
        rtt=rtt,
        tau=info.tau,
        tau_prefill=info.tau_prefill,
        prefill_tokens=info.prefill_tokens,
        max_length=info.max_length,
        cache_token_bytes=info.cache_token_bytes,
        cache_bytes_left=info.cache_bytes_left,
    )


async def scheduler_spans(connection: SwarmConnection) -> dict[str, tuple[int, int]] | None:
    """peer -> the span the trusted scheduler lists it serving, for servers it does not plan to move
    (None: no scheduler key given, or no trusted scheduler answered)."""
    options = connection.options
    if options.scheduler_key is None:
        return None
    try:
        record = await asyncio.wait_for(
            fetch_scheduler_async(connection.dht, connection.prefix, options.scheduler_key),
            options.scheduler_timeout,
        )
        if record is None:
            logger.warning("no scheduler with the given key is announced: chains from the DHT records")
            return None
        metadata = options.swarm_secret.scheduler_metadata() if options.swarm_secret else None
        async with grpc.aio.insecure_channel(record.address) as channel:
            status = await pb_grpc.SchedulerStub(channel).GetStatus(
                pb.StatusRequest(), timeout=options.scheduler_timeout, metadata=metadata
            )
    except (TimeoutError, grpc.aio.AioRpcError) as error:
        logger.warning("the scheduler's status is unavailable (%s): chains from the DHT records", error)
        return None
    spans = staying_spans(status.servers)
    logger.info("the scheduler at %s lists %d server(s) staying where they are", record.address, len(spans))
    return spans


def staying_spans(servers: Iterable[pb.ServerStatus]) -> dict[str, tuple[int, int]]:
    """peer -> span of the servers a scheduler's status lists online with blocks, leaving out managed
    servers whose assigned span differs from the one they serve (they are about to move)."""
    spans = {}
    for server in servers:
        moving = server.managed and (server.assigned_start, server.assigned_end) != (server.start, server.end)
        if server.state == "online" and server.start >= 0 and not moving:
            spans[server.peer_id] = (server.start, server.end)
    return spans


async def round_trip(connection: SwarmConnection, peer: str) -> float:
    """The round trip to `peer` with its connection already open: routing's cached ping often timed
    the first contact (dialing the peer), several times a step's round trip on a busy machine."""
    first = await connection.probes.rtt(peer)
    if first == math.inf:
        return first
    request = encode(InfoRequest(swarm_proof=connection.swarm_proof(peer)))
    started = time.perf_counter()
    try:
        await connection.stub(peer).rpc_info(request, timeout=connection.options.ping_timeout)
    except Exception:  # it answered a moment ago: keep that
        return first
    return min(first, time.perf_counter() - started)


async def find_chains(connection: SwarmConnection) -> list[BatchChain]:
    """The disjoint chains the swarm offers now, fastest first (see `chains.disjoint_chains`)."""
    routable = connection.chains.routable_among(await connection.roster.servers(refresh=True))
    servers = {peer: info for peer, info in routable.items() if info.has_blocks and info.tau is not None}
    spans = await scheduler_spans(connection)
    if spans is not None:
        left_out = sorted(
            info.public_name or peer[-8:] for peer, info in servers.items() if peer not in spans
        )
        if left_out:
            logger.info("the scheduler does not list as staying (or the records disagree): %s", left_out)
        servers = {peer: info for peer, info in servers.items() if spans.get(peer) == (info.start, info.end)}
    peers = sorted(servers)
    rtts = await asyncio.gather(*(round_trip(connection, peer) for peer in peers))
    candidates = [
        chain_server(peer, servers[peer], rtt)
        for peer, rtt in zip(peers, rtts, strict=True)
        if rtt < math.inf
    ]
    return disjoint_chains(candidates, connection.num_blocks)
