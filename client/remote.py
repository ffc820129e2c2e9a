"""Hub-spoke inference sessions through a chain of swarm servers.

`SwarmConnection` is the client's view of the swarm: a client-mode DHT peer, the server records
it reads, RTT probes and temporary bans. `RemoteBlockSession` drives one session: the client sends
hidden states to the first server, takes its output to the second, and so on, keeping for every
server the inputs it sent (the client-side cache) so that a replacement can rebuild its attention
cache by replay.

All network work runs as coroutines on hivemind's background event loop (`RemoteExpertWorker`);
the public methods are synchronous so that `transformers`' `generate()` can call them.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from dataclasses import dataclass, field

import torch
from hivemind.dht import DHT
from hivemind.moe.client.remote_expert_worker import RemoteExpertWorker
from hivemind.p2p import PeerID
from hivemind.proto import runtime_pb2

from client.routing import Candidate, RouteHop, SessionShape, choose_chain, uncovered_blocks
from server.handler import BlockServicer
from swarm.dht_records import fetch_servers_async
from swarm.errors import SwarmUserError
from swarm.server_info import ServerInfo
from swarm.wire import (
    Error,
    ErrorCode,
    Open,
    Opened,
    RemoteError,
    Step,
    StepDone,
    decode_metadata,
    decode_tensors,
    encode,
    parse,
)

logger = logging.getLogger(__name__)


class SwarmUnavailable(SwarmUserError):
    """The swarm cannot serve the request (blocks not served, or no room for too long)."""


@dataclass
class ClientOptions:
    refresh_period: float = 1.0  # seconds a fetched list of servers stays fresh
    rtt_ttl: float = 60.0  # seconds a measured RTT stays valid
    request_timeout: float = 30.0  # seconds to wait for any one reply
    wait_for_room: float = 60.0  # seconds to wait for cache room before giving up
    expected_l_in: int = 20
    expected_l_out: int = 128


def run_sync(coroutine):
    """Run a coroutine on hivemind's background loop and wait for its result."""
    return RemoteExpertWorker.run_coroutine(coroutine)


class SwarmConnection:
    def __init__(
        self, initial_peers: list[str], prefix: str, num_blocks: int, options: ClientOptions | None = None
    ):
        if not initial_peers:
            raise SwarmUserError("initial_peers is empty: give the multiaddr of at least one DHT peer")
        self.prefix, self.num_blocks = prefix, num_blocks
        self.options = options or ClientOptions()
        self.dht = DHT(initial_peers=initial_peers, client_mode=True, start=True)
        self.p2p = run_sync(self.dht.replicate_p2p())
        self._servers: dict[str, ServerInfo] = {}
        self._fetched_at = -math.inf
        self._rtts: dict[str, tuple[float, float]] = {}  # peer -> (rtt seconds, measured at)

    # --- what the swarm looks like ----------------------------------------------------------------
    async def servers(self, refresh: bool = False) -> dict[str, ServerInfo]:
        if refresh or time.monotonic() - self._fetched_at > self.options.refresh_period:
            self._servers = await fetch_servers_async(self.dht, self.prefix, self.num_blocks)
            self._fetched_at = time.monotonic()
        return self._servers

    def stub(self, peer_id: str):
        return BlockServicer.get_stub(self.p2p, PeerID.from_base58(peer_id), namespace=self.prefix)

    async def rtt(self, peer_id: str) -> float:
        """Round trip of an info call (includes serialization), cached; inf if the peer does not answer."""
        cached = self._rtts.get(peer_id)
        if cached is not None and time.monotonic() - cached[1] < self.options.rtt_ttl:
            return cached[0]
        started = time.perf_counter()
        try:
            await self.stub(peer_id).rpc_info(
                runtime_pb2.ExpertRequest(), timeout=self.options.request_timeout
            )
            rtt = time.perf_counter() - started
        except Exception as error:
            logger.info("server %s does not answer: %s", peer_id[-8:], error)
            rtt = math.inf
        self._rtts[peer_id] = (rtt, time.monotonic())
        return rtt

    async def candidates(self, refresh: bool = False) -> list[Candidate]:
        servers = await self.servers(refresh)
        rtts = await asyncio.gather(*(self.rtt(peer) for peer in servers))
        return [
            Candidate(peer, info, rtt)
            for (peer, info), rtt in zip(servers.items(), rtts, strict=True)
            if rtt < math.inf
        ]

    async def route(self, start: int, end: int, shape: SessionShape) -> list[RouteHop]:
        """The fastest chain over `[start, end)` with cache room; waits with backoff while none has room."""
        deadline = time.monotonic() + self.options.wait_for_room
        delay = 0.1
        refresh = False
        while True:
            candidates = await self.candidates(refresh)
            chain = choose_chain(candidates, start, end, shape)
            if chain is not None:
                return chain
            missing = uncovered_blocks(candidates, start, end)
            if missing:
                if time.monotonic() > deadline:
                    raise SwarmUnavailable(
                        f"no online server holds blocks {_ranges(missing)} of {self.prefix}"
                    )
            elif time.monotonic() > deadline:
                raise SwarmUnavailable(
                    f"no chain over blocks {start}:{end} had cache room for a session of "
                    f"{shape.max_length} tokens "
                    f"x {shape.batch_size} within {self.options.wait_for_room:.0f} s"
                )
            await asyncio.sleep(delay)
            delay = min(delay * 2, 2.0)
            refresh = True

    def shutdown(self) -> None:
        try:
            run_sync(self.p2p.shutdown())
        finally:
            self.dht.shutdown()


def _ranges(blocks: list[int]) -> str:
    runs, first = [], blocks[0]
    for previous, block in zip(blocks, blocks[1:] + [None], strict=True):
        if block != previous + 1:
            runs.append(f"{first}:{previous + 1}")
            first = block
    return ", ".join(runs)


@dataclass
class _SentStep:
    position: int
    hidden: torch.Tensor
    padding_mask: torch.Tensor | None


@dataclass
class ServerStream:
    """One server's part of a session: an open bidirectional stream and what we sent it."""

    hop: RouteHop
    session_id: str
    shape: SessionShape
    history: list[_SentStep] = field(default_factory=list)  # the client-side cache of this server's inputs
    _queue: asyncio.Queue | None = None
    _responses: object = None

    async def open(self, connection: SwarmConnection) -> None:
        self._queue = asyncio.Queue()
        queue = self._queue

        async def requests():
            while (item := await queue.get()) is not None:
                yield item

        open_message = Open(
            session_id=self.session_id,
            max_length=self.shape.max_length,
            batch_size=self.shape.batch_size,
            start=self.hop.start,
            end=self.hop.end,
        )
        queue.put_nowait(encode(open_message))
        self._responses = await connection.stub(self.hop.peer_id).rpc_inference(requests())
        await self._receive(connection.options.request_timeout, Opened)

    async def step(
        self, hidden: torch.Tensor, position: int, padding_mask: torch.Tensor | None, timeout: float
    ) -> torch.Tensor:
        tensors = [hidden] if padding_mask is None else [hidden, padding_mask]
        step_id = f"{position}+{hidden.shape[1]}"
        self._queue.put_nowait(encode(Step(step_id=step_id, position=position), tensors))
        reply, outputs = await self._receive(timeout, StepDone, with_tensors=True)
        if reply.step_id != step_id or len(outputs) != 1 or outputs[0].shape != hidden.shape:
            raise RemoteError(
                ErrorCode.INTERNAL, "server answered with the wrong step or shape", self.hop.peer_id
            )
        self.history.append(_SentStep(position, hidden, padding_mask))
        return outputs[0]

    async def _receive(self, timeout: float, expected: type, with_tensors: bool = False):
        try:
            response = await asyncio.wait_for(anext(self._responses), timeout=timeout)
        except StopAsyncIteration:
            raise RemoteError(ErrorCode.INTERNAL, "server closed the session", self.hop.peer_id) from None
        kind = decode_metadata(response.metadata).get("type")
        message = parse(response.metadata, Error if kind == "error" else expected)
        if isinstance(message, Error):
            raise RemoteError(message.code, message.message, self.hop.peer_id)
        return (message, decode_tensors(response)) if with_tensors else message

    def close(self) -> None:
        if self._queue is not None:
            self._queue.put_nowait(None)  # ends our request stream: the server frees the session
            self._queue = None


class RemoteBlockSession:
    """A session over a chain of servers covering every block (the `BlockSession` protocol)."""

    def __init__(self, connection: SwarmConnection, batch_size: int, max_length: int):
        self.connection = connection
        self.shape = SessionShape(
            batch_size=batch_size,
            max_length=max_length,
            l_in=min(connection.options.expected_l_in, max_length),
            l_out=max(1, min(connection.options.expected_l_out, max_length)),
        )
        self.session_id = uuid.uuid4().hex
        self.streams: list[ServerStream] = run_sync(self._open_chain(0, connection.num_blocks))

    async def _open_chain(self, start: int, end: int) -> list[ServerStream]:
        while True:
            chain = await self.connection.route(start, end, self.shape)
            streams = [ServerStream(hop, self.session_id, self.shape) for hop in chain]
            try:
                for stream in streams:
                    await stream.open(self.connection)
                logger.info(
                    "session %s routed through %s",
                    self.session_id[:8],
                    " -> ".join(f"{s.hop.peer_id[-6:]}[{s.hop.start}:{s.hop.end}]" for s in streams),
                )
                return streams
            except RemoteError as error:
                for stream in streams:
                    stream.close()
                if error.code != ErrorCode.NO_CACHE_ROOM:
                    raise
                logger.info("%s; re-routing", error)  # the announced free memory was stale
                await self.connection.servers(refresh=True)
                await asyncio.sleep(0.2)

    def step(self, hidden: torch.Tensor, position: int, padding_mask: torch.Tensor | None) -> torch.Tensor:
        return run_sync(self._step(hidden, position, padding_mask))

    async def _step(
        self, hidden: torch.Tensor, position: int, padding_mask: torch.Tensor | None
    ) -> torch.Tensor:
        timeout = self.connection.options.request_timeout
        for stream in self.streams:
            hidden = await stream.step(hidden, position, padding_mask, timeout)
        return hidden

    def close(self) -> None:
        streams, self.streams = self.streams, []
        if streams:
            run_sync(self._close(streams))

    @staticmethod
    async def _close(streams: list[ServerStream]) -> None:
        for stream in streams:
            stream.close()


class RemoteBlocks:
    """The swarm as a `BlockBackend`."""

    def __init__(self, connection: SwarmConnection):
        self.connection = connection

    def open_session(self, batch_size: int, max_length: int) -> RemoteBlockSession:
        return RemoteBlockSession(self.connection, batch_size, max_length)
