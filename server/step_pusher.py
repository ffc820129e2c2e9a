"""Server A's side of a chain session: its outputs pushed to the next server of the client's chain.

One pusher per session that has a successor (`ChainLink.next_*`). Pushes go out in step order over
one stream to the successor's `push_steps` handler, opened at the first push and kept for the
session; the session's handler only hands a step over and never waits for it (the client's own copy
reaches the successor anyway). A push that cannot go (the successor unreachable, refusing, or slower
than the steps come) is dropped, and the stream is opened again at most once per `RETRY_SECONDS`.

While the stream is open and idle, a push is written as it is handed over, before the handler answers
its client: the successor's step is on the token's path, the client's answer from a middle server is
not, and on a busy host the process an answer wakes may take the core before a queued push goes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass

import torch
from hivemind.p2p import P2P
from hivemind.proto import runtime_pb2

from llm_swarm.swarm.chain_wire import PushedStep, PushSteps
from llm_swarm.swarm.framing import send_message, write_message
from llm_swarm.swarm.step_frame import encode_frame, framable
from llm_swarm.swarm.stream_opener import StreamOpener
from llm_swarm.swarm.wire import decode_metadata, encode

logger = logging.getLogger(__name__)

OPEN_TIMEOUT = 5.0  # seconds to open the stream to the successor
SEND_TIMEOUT = 10.0  # seconds one push may take to hand to the transport
RETRY_SECONDS = 1.0  # after a failure, pushes are dropped this long before the stream is tried again
QUEUED_PUSHES = 4  # pushes waiting to go; more are dropped (the successor is slower than the steps)


@dataclass(frozen=True)
class PushTarget:
    """The successor's session, as the client named it."""

    peer: str
    session_id: str
    token: str
    frames: bool = False  # it takes pushed steps as step frames (swarm.step_frame)


class StepPusher:
    def __init__(self, streams: StreamOpener, handle_name: str, target: PushTarget, session_label: str):
        self.streams, self.handle_name, self.target = streams, handle_name, target
        self.session_label = session_label  # for the log
        self.pushed = self.dropped = 0
        self._queue: asyncio.Queue = asyncio.Queue(QUEUED_PUSHES)
        self._writer: asyncio.StreamWriter | None = None
        self._watching: asyncio.Task | None = None  # reads the successor's side: any reply is a refusal
        self._failed_at = -RETRY_SECONDS
        self._sending = False  # the pushing task is sending (or opening the stream)
        self._task = asyncio.ensure_future(self._run())

    def push(self, step: PushedStep, tensors: list[torch.Tensor]) -> None:
        """Write `step` to the successor now if the stream is open and idle, else queue it; never waits."""
        writer = self._writer
        if (
            writer is not None
            and not writer.is_closing()
            and not self._sending
            and self._queue.empty()
            and not writer.transport.get_write_buffer_size()
        ):
            try:
                write_message(self._message(step, tensors), writer)
            except Exception as error:  # the transport broke: as a failed send
                self._failed(error)
            else:
                self.pushed += 1
            return
        try:
            self._queue.put_nowait((step, tensors))
        except asyncio.QueueFull:
            self.dropped += 1

    def close(self) -> None:
        self._task.cancel()
        self._close_stream()
        if self.pushed or self.dropped:
            logger.info(
                "session %s: pushed %d steps to %s, dropped %d",
                self.session_label,
                self.pushed,
                self.target.peer[-8:],
                self.dropped,
            )

    async def _run(self) -> None:
        while True:
            step, tensors = await self._queue.get()
            if time.monotonic() - self._failed_at < RETRY_SECONDS:
                self.dropped += 1
                continue
            self._sending = True
            try:
                await self._send(step, tensors)
                self.pushed += 1
            except asyncio.CancelledError:
                raise
            except Exception as error:  # unreachable, refused, reset: the client's copy goes on
                self._failed(error)
            finally:
                self._sending = False

    def _failed(self, error: Exception) -> None:
        self.dropped += 1
        self._failed_at = time.monotonic()
        self._close_stream()
        logger.info(
            "session %s: push to %s failed (%s: %s); the client's copy goes on",
            self.session_label,
            self.target.peer[-8:],
            type(error).__name__,
            error,
        )

    def _message(self, step: PushedStep, tensors: list[torch.Tensor]):
        framed = self.target.frames and framable(step, tensors)
        return encode_frame(step, tensors) if framed else encode(step, tensors)

    async def _send(self, step: PushedStep, tensors: list[torch.Tensor]) -> None:
        if self._writer is None or self._writer.is_closing():
            self._close_stream()
            reader, self._writer = await self.streams.open(self.target.peer, self.handle_name, OPEN_TIMEOUT)
            self._watching = asyncio.ensure_future(self._watch(reader))
            header = PushSteps(session_id=self.target.session_id, token=self.target.token)
            await send_message(encode(header), self._writer, SEND_TIMEOUT)
        await send_message(self._message(step, tensors), self._writer, SEND_TIMEOUT)

    async def _watch(self, reader: asyncio.StreamReader) -> None:
        """The successor answers a push stream only to refuse it, then ends it: either way the
        stream is over, and pushes wait `RETRY_SECONDS` before it is opened again."""
        with contextlib.suppress(Exception):
            response, _ = await P2P.receive_protobuf(runtime_pb2.ExpertResponse, reader)
            reason = decode_metadata(response.metadata).get("message", "no reason given")
            logger.info(
                "session %s: %s refuses pushes: %s", self.session_label, self.target.peer[-8:], reason
            )
        self._failed_at = time.monotonic()
        self._close_stream(watching=False)

    def _close_stream(self, watching: bool = True) -> None:
        writer, self._writer = self._writer, None
        if watching and self._watching is not None:
            self._watching.cancel()
        if writer is not None:
            with contextlib.suppress(Exception):
                writer.write(P2P.ERROR_MARKER + len(b"").to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER))
            writer.close()
