"""Hub-spoke inference sessions through a chain of swarm servers, with failover by replay.

The client sends hidden states to the first server, takes its output to the second, and so on,
keeping for every server the inputs it sent (the client-side cache). When a server fails, it is
banned for a while, a replacement chain is found for exactly the blocks it processed (possibly
several servers), the cached inputs are replayed to rebuild their attention caches, and the step
continues: the other servers of the chain never notice, and the output is what it would have been.
"""

from __future__ import annotations

import asyncio
import logging
import uuid

import torch

from client.connection import SwarmConnection, SwarmUnavailable, run_sync
from client.routing import SessionShape
from client.stream import ServerStream
from swarm.wire import ErrorCode, RemoteError

logger = logging.getLogger(__name__)


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
        """Route blocks `[start, end)` and open a stream on every server of the chain."""
        while True:
            chain = await self.connection.route(start, end, self.shape)
            # a fresh id per stream: a replacement may land on a server already in this chain
            streams = [ServerStream(hop, uuid.uuid4().hex, self.shape) for hop in chain]
            try:
                for stream in streams:
                    await stream.open(self.connection)
                logger.info(
                    "session %s blocks %d:%d routed through %s",
                    self.session_id[:8],
                    start,
                    end,
                    " -> ".join(f"{s.hop.peer_id[-6:]}[{s.hop.start}:{s.hop.end}]" for s in streams),
                )
                return streams
            except RemoteError as error:
                for stream in streams:
                    stream.close()
                if error.code == ErrorCode.BAD_REQUEST:
                    raise  # our own request is wrong: another server would refuse it too
                if error.code == ErrorCode.NO_CACHE_ROOM:
                    logger.info("%s; re-routing", error)  # the announced free memory was stale
                    await self.connection.servers(refresh=True)
                    await asyncio.sleep(0.2)
                else:
                    self._blame(error.peer, error)
            except Exception as error:  # transport failures: blame the server and route around it
                for stream in streams:
                    stream.close()
                self._blame(getattr(error, "peer", "") or _failed_peer(streams), error)

    def step(self, hidden: torch.Tensor, position: int, padding_mask: torch.Tensor | None) -> torch.Tensor:
        return run_sync(self._step(hidden, position, padding_mask))

    async def _step(
        self, hidden: torch.Tensor, position: int, padding_mask: torch.Tensor | None
    ) -> torch.Tensor:
        timeout = self.connection.options.request_timeout
        failures = 0
        index = 0
        while index < len(self.streams):
            stream = self.streams[index]
            try:
                output = await stream.step(hidden, position, padding_mask, timeout)
            except RemoteError as error:
                if error.code == ErrorCode.BAD_REQUEST:
                    raise  # replaying it elsewhere would fail the same way
                failures = self._count_failure(failures, stream, error)
                self.streams[index : index + 1] = await self._replace(stream)
                continue
            except Exception as error:  # the connection broke or timed out
                failures = self._count_failure(failures, stream, error)
                self.streams[index : index + 1] = await self._replace(stream)
                continue
            hidden = output
            index += 1
        return hidden

    def _count_failure(self, failures: int, stream: ServerStream, error: BaseException) -> int:
        failures += 1
        self._blame(stream.hop.peer_id, error)
        if failures > self.connection.options.max_failovers:
            raise SwarmUnavailable(
                f"blocks {stream.hop.start}:{stream.hop.end} failed {failures} times in one step; "
                f"last error: {error}"
            ) from error
        return failures

    def _blame(self, peer_id: str, error: BaseException) -> None:
        if peer_id:
            duration = self.connection.ban(peer_id)
            logger.warning(
                "server %s failed (%s); avoiding it for %.0f s",
                peer_id[-8:],
                str(error) or type(error).__name__,
                duration,
            )

    async def _replace(self, failed: ServerStream) -> list[ServerStream]:
        """New servers for exactly the failed server's blocks, caches rebuilt by replaying its inputs."""
        failed.close()
        started = asyncio.get_running_loop().time()
        while True:
            replacement = await self._open_chain(failed.hop.start, failed.hop.end)
            try:
                timeout = self.connection.options.request_timeout
                for sent in failed.history:  # same steps, same shapes: the rebuilt caches are bit-identical
                    hidden = sent.hidden
                    for stream in replacement:
                        hidden = await stream.step(hidden, sent.position, sent.padding_mask, timeout)
            except Exception as error:
                for stream in replacement:
                    stream.close()
                if isinstance(error, RemoteError) and error.code == ErrorCode.BAD_REQUEST:
                    raise
                self._blame(getattr(error, "peer", "") or _failed_peer(replacement), error)
                continue
            elapsed = asyncio.get_running_loop().time() - started
            logger.info(
                "session %s: replaced %s for blocks %d:%d with %d server(s), replayed %d steps in %.0f ms",
                self.session_id[:8],
                failed.hop.peer_id[-8:],
                failed.hop.start,
                failed.hop.end,
                len(replacement),
                len(failed.history),
                elapsed * 1e3,
            )
            return replacement

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


def _failed_peer(streams: list[ServerStream]) -> str:
    """The first stream that did not finish opening or replaying is the one to blame."""
    for stream in streams:
        if not stream.healthy:
            return stream.hop.peer_id
    return streams[-1].hop.peer_id if streams else ""
