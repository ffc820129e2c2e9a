"""The server's RPCs over hivemind P2P: inference sessions (bidirectional stream), forward, info.

Transport and validation live here; the arithmetic is the span's. Every request is validated
before it touches the model, every error is answered with a message naming what was wrong, and a
session's cache reservation is released on every way out of its stream (end, error, disconnect,
idle timeout, shutdown), so one client can never take memory or the server down with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import AsyncIterator  # noqa: UP035  (hivemind detects streaming RPCs by typing's alias)

import torch
from hivemind.p2p import P2PContext
from hivemind.proto import runtime_pb2
from hivemind.utils.serializer import MSGPackSerializer

from server.bounded_stream import StreamLimit, add_bounded_stream_handler
from server.decode_load import DecodeLoad
from server.emulated_delay import emulated_seconds_per_block
from server.engine import BatchingEngine
from server.handoff_rpcs import HandOffRpcs
from server.memory import CacheBudget, NoCacheRoom
from server.metrics import ServerMetrics
from server.replay import MAX_TOKENS_PER_POSITION, parse_replay
from server.request_checks import RequestChecks
from server.session import Session, check_hypo_ids, check_step_inputs
from server.session_lengths import SessionLengths
from server.unary_rpcs import UnaryRpcs
from swarm.block_rpc import BlockRpc
from swarm.closed_swarm import SwarmSecret
from swarm.models.adapters import adapter_rows
from swarm.models.span import TransformerSpan
from swarm.wire import (
    Error,
    ErrorCode,
    InfoRequest,
    Open,
    Opened,
    ProtocolError,
    Replay,
    Replayed,
    Step,
    StepDone,
    decode_metadata,
    decode_tensors,
    encode,
    parse,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PeerLimits:
    """What one client peer may hold at once, so no single peer can take the whole server."""

    max_sessions: int = 64
    max_cache_fraction: float = 0.5  # of the session cache (the budget less the blocks)
    max_session_lifetime: float = 24 * 3600.0  # seconds, however active the session is


class BlockServicer(RequestChecks, UnaryRpcs, HandOffRpcs, BlockRpc):
    def __init__(
        self,
        span: TransformerSpan,
        budget: CacheBudget,
        *,
        max_length: int,
        max_batch_size: int = 64,
        session_idle_timeout: float = 300.0,
        compute_delay: float = 0.0,
        compute_delay_per_token: float = 0.0,
        compute_delay_overlap: bool = False,
        batch_wait_ms: float = 2.0,
        prefill_chunk: int = 0,
        get_info: Callable[[], dict],
        on_sessions_changed: Callable[[], None] = lambda: None,
        metrics: ServerMetrics | None = None,
        limits: PeerLimits | None = None,
        swarm_secret: SwarmSecret | None = None,
        local_peer_id: str = "",
    ):
        self.span, self.budget = span, budget
        self.max_length, self.max_batch_size = max_length, max_batch_size
        self.session_idle_timeout = session_idle_timeout
        # emulation: seconds added per block per step (docs/reference.md section 8). By default the
        # delay holds the compute thread (an accelerator busy with one step at a time; a batched
        # decode pays it once).
        # With `compute_delay_overlap` each step waits out its own delay off the compute thread, so
        # concurrent sessions' delays overlap: an accelerator whose step time does not depend on how
        # many sessions it serves, which is paper 000's cost model and the simulator's.
        self.compute_delay = compute_delay
        self.compute_delay_per_token = compute_delay_per_token
        self.overlap_delay = compute_delay if compute_delay_overlap else 0.0
        thread_delay = 0.0 if compute_delay_overlap else compute_delay
        self.get_info, self.on_sessions_changed = get_info, on_sessions_changed
        # a fresh servicer per span (moves), one metrics object per server: counters survive moves
        self.metrics = metrics if metrics is not None else ServerMetrics()
        self.sessions: dict[str, Session] = {}
        self.accepting = True
        self.limits = limits or PeerLimits()
        self.swarm_secret, self.local_peer_id = swarm_secret, local_peer_id
        self._reported_at: dict[str, float] = {}  # peer -> when its last counted report came
        # one compute thread: steps of different sessions run one at a time, like one accelerator;
        # with batching on (batch_wait_ms > 0) the engine's thread runs concurrent sessions' decode
        # steps as one batched forward (server/engine.py), otherwise each step runs alone, as before
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="compute")
        self.lengths = SessionLengths()  # learned answer lengths: the engine's decode work ahead
        self.decode_load = DecodeLoad()  # how steps slow down per decoding session (announced)
        self.engine = (
            BatchingEngine(
                batch_wait=batch_wait_ms / 1e3,
                compute_delay=thread_delay,
                compute_delay_per_token=compute_delay_per_token,
                prefill_chunk=prefill_chunk,
                max_batch_rows=max(max_batch_size, 64),
                on_decode_batch=self.metrics.decode_batch.observe,
            )
            if batch_wait_ms > 0
            else None
        )

    # --- info -----------------------------------------------------------------------------------
    async def rpc_info(
        self, request: runtime_pb2.ExpertRequest, context: P2PContext
    ) -> runtime_pb2.ExpertResponse:
        if self.swarm_secret is not None:
            try:
                self._check_proof(parse(request.metadata, InfoRequest).swarm_proof, context)
            except ProtocolError as error:
                return self._error(error.code, str(error))
        return runtime_pb2.ExpertResponse(metadata=MSGPackSerializer.dumps(self.get_info()))

    # --- inference sessions ---------------------------------------------------------------------
    async def rpc_inference(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        # served by `add_p2p_handlers` through the bounded transport; this is hivemind's entry point
        async for response in self._inference(requests, context, StreamLimit()):
            yield response

    async def _inference(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext, limit: StreamLimit
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        peer = str(context.remote_id)
        session: Session | None = None
        following = None  # a push that follows the next step (`HandOff.follow`), until that step ran
        try:
            first = await self._next_request(requests)
            if first is None:
                return
            try:
                message = parse(first.metadata, Open)
                self._check_proof(message.swarm_proof, context)
                session = self._open(message, peer)
            except ProtocolError as error:
                yield self._error(error.code, str(error))
                return
            except NoCacheRoom as error:
                yield self._error(ErrorCode.NO_CACHE_ROOM, str(error))
                return
            limit.max_bytes = self._replay_limit(session)  # the largest message: a replay
            yield self._reply(
                Opened(
                    session_id=session.session_id,
                    start=session.start,
                    end=session.end,
                    reserved_bytes=session.reserved_bytes,
                ),
                [],
            )
            ends_at = time.monotonic() + self.limits.max_session_lifetime
            while True:
                request = await self._next_request(requests, ends_at)
                if request is None:
                    return  # the client closed its side: the session is over
                kind = _message_type(request)
                if following is not None:  # a push follows this session's prompt: its step must come now
                    stepped = kind not in ("hand_off", "replay")
                    if stepped:
                        yield await self._step(session, request)
                    yield await self._end_follow(session, following, stepped)
                    following = None
                    if stepped:
                        continue
                if kind == "hand_off":
                    try:
                        following = self._begin_follow(session, request)
                    except ProtocolError as error:
                        yield self._error(error.code, str(error))
                        continue
                    if following is None:
                        yield await self._hand_off(session, request)
                    continue
                if kind != "replay":
                    yield await self._step(session, request)
                    continue
                response, replayed = await self._replay(session, request)
                yield response
                if not replayed:
                    return  # a failed replay leaves a useless cache: the session ends, its memory is freed
        except _LifetimeOver:
            logger.info("session %s reached the lifetime limit: closed", session.session_id[:8])
            with contextlib.suppress(Exception):
                yield self._error(
                    ErrorCode.SESSION_EXPIRED,
                    f"session lifetime of {self.limits.max_session_lifetime:.0f} s is over: open a new one",
                )
        except TimeoutError:
            logger.info(
                "session %s idle for %.0f s: closed",
                session.session_id if session else "?",
                self.session_idle_timeout,
            )
            with contextlib.suppress(Exception):
                yield self._error(ErrorCode.SESSION_EXPIRED, "session idle for too long")
        finally:
            if following is not None:
                self._drop_follow(session, following)
            if session is not None:
                self._close(session)

    async def _next_request(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], ends_at: float = float("inf")
    ):
        left = ends_at - time.monotonic()
        try:
            request = await asyncio.wait_for(anext(requests), timeout=min(self.session_idle_timeout, left))
        except StopAsyncIteration:
            return None
        except TimeoutError:
            if left <= self.session_idle_timeout:
                raise _LifetimeOver() from None
            raise
        self.metrics.received.inc(request.ByteSize())
        return request

    def _open(self, message: Open, peer: str) -> Session:
        if not self.accepting:
            raise ProtocolError(
                ErrorCode.NOT_SERVING, "this server is shutting down and accepts no new sessions"
            )
        self._check_blocks(message.start, message.end)
        self._check_sizes(message.batch_size, message.max_length)
        adapter = self._check_adapter(message.adapter)
        cache_token, cache_from = self.check_cache_source(message)
        if message.session_id in self.sessions:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"session id {message.session_id} is already in use")
        needed = self.span.cache_bytes(message.max_length, message.batch_size) * (message.end - message.start)
        self._check_peer_share(peer, needed)
        self.budget.reserve(message.session_id, needed)  # raises NoCacheRoom before allocating anything
        try:
            cache = self.span.new_cache(message.batch_size, message.max_length, message.start, message.end)
        except BaseException:
            self.budget.release(message.session_id)
            raise
        session = Session(
            message.session_id,
            peer,
            message.start,
            message.end,
            message.batch_size,
            message.max_length,
            cache,
            needed,
            adapter,
            cache_token=cache_token,
            cache_from=cache_from,
        )
        self.sessions[session.session_id] = session
        self.metrics.sessions_opened.inc()
        self.metrics.sessions.set(len(self.sessions))
        logger.info(
            "session %s opened by %s: blocks %d:%d, batch %d, max_length %d, %d cache bytes%s",
            session.session_id[:8],
            peer[-8:],
            session.start,
            session.end,
            session.batch_size,
            session.max_length,
            needed,
            f", adapter {adapter}" if adapter else "",
        )
        self.on_sessions_changed()
        return session

    def _close(self, session: Session) -> None:
        self.sessions.pop(session.session_id, None)
        self.decode_load.forget(session.session_id)
        self.metrics.sessions.set(len(self.sessions))
        self.budget.release(session.session_id)
        if session.cache is not None:
            self.lengths.ended(session)
            self.span.forget_cache(session.cache)
            if self.engine is not None:
                self.engine.forget(session.cache)
        session.cache = None  # drop the tensors now, not when the stream object is collected
        logger.info("session %s closed, %d cache bytes free", session.session_id[:8], self.budget.bytes_left)
        self.on_sessions_changed()

    async def _step(self, session: Session, request: runtime_pb2.ExpertRequest) -> runtime_pb2.ExpertResponse:
        try:
            size, limit = request.ByteSize(), self._message_limit(session.batch_size, session.max_length)
            if size > limit:
                raise ProtocolError(
                    ErrorCode.BAD_REQUEST,
                    f"message of {size:,} bytes exceeds this session's limit of {limit:,}",
                )
            message = parse(request.metadata, Step)
            if session.receiving:
                # "wait": a push the client gave up on is still being undone here
                raise ProtocolError(
                    ErrorCode.NO_CACHE_ROOM, "the session is receiving its cache: wait for it"
                )
            replay = session.replayed_output(message.step_id, message.position)
            if replay is not None:
                return self._reply(StepDone(step_id=message.step_id, position=message.position), [replay])
            hidden, padding_mask, prompts = check_step_inputs(
                session, self.span.hidden_size, message.position, decode_tensors(request), message.prompts
            )
            hypo_ids = check_hypo_ids(session, message.hypo_ids)
            if hypo_ids is not None:
                session.cache.reorder(hypo_ids)
            kind = "decode" if hidden.shape[1] == 1 else "prefill"
            decoding = 0  # sessions decoding here now, this one included (`server.decode_load`)
            if kind == "decode":
                decoding = self.decode_load.decoding(session.session_id, time.monotonic())
            started = time.perf_counter()
            output = await self._compute(session, hidden, message.position, padding_mask, prompts)
            if message.last_only:
                output = output[:, -1:]
            elapsed = time.perf_counter() - started
            self.metrics.steps.labels(kind=kind).observe(elapsed)
            if decoding:
                self.decode_load.observe(decoding, elapsed)
            session.record(message.step_id, message.position, output)
            done = StepDone(step_id=message.step_id, position=message.position, leaving=not self.accepting)
            return self._reply(done, [output])
        except ProtocolError as error:
            return self._error(error.code, str(error))
        except Exception as error:  # a bug or a device fault: this session fails, the server serves on
            logger.exception("session %s: step failed", session.session_id[:8])
            return self._error(
                ErrorCode.INTERNAL, f"step failed on the server: {type(error).__name__}: {error}"
            )

    async def _replay(self, session: Session, request: runtime_pb2.ExpertRequest):
        """Run a `Replay`'s steps in order (a failover's exact catch-up in one round trip); returns the
        reply and whether it succeeded."""
        try:
            size, limit = request.ByteSize(), self._replay_limit(session)
            if size > limit:
                raise ProtocolError(
                    ErrorCode.BAD_REQUEST,
                    f"replay of {size:,} bytes exceeds this session's limit of {limit:,}",
                )
            message = parse(request.metadata, Replay)
            steps = parse_replay(message, decode_tensors(request), session, self.span.hidden_size)
            started, outputs = time.perf_counter(), []
            for step in steps:  # one by one through the engine: other sessions' steps interleave
                if step.hypo_ids is not None:
                    session.cache.reorder(step.hypo_ids)
                outputs.append(await self._compute(session, step.hidden, step.position, step.padding_mask))
            session.last_active = time.monotonic()
            tokens = sum(step.hidden.shape[1] for step in steps)
            self.metrics.steps.labels(kind="replay").observe(time.perf_counter() - started)
            logger.info(
                "session %s: replayed %d steps (%d tokens) in %.0f ms",
                session.session_id[:8],
                len(steps),
                tokens,
                (time.perf_counter() - started) * 1e3,
            )
            reply = Replayed(replay_id=message.replay_id, steps=len(steps))
            return self._reply(reply, [torch.cat(outputs, dim=1)]), True
        except ProtocolError as error:
            return self._error(error.code, str(error)), False
        except Exception as error:  # a bug or a device fault: this session fails, the server serves on
            logger.exception("session %s: replay failed", session.session_id[:8])
            return self._error(
                ErrorCode.INTERNAL, f"replay failed on the server: {type(error).__name__}: {error}"
            ), False

    def _replay_limit(self, session: Session) -> int:
        """The largest legitimate replay: twice the session's positions of float32 hidden states,
        with their masks and layout."""
        tokens = MAX_TOKENS_PER_POSITION * session.max_length
        return self._message_limit(session.batch_size, tokens) + tokens * 40

    async def _compute(
        self,
        session: Session,
        hidden: torch.Tensor,
        position: int,
        padding_mask: torch.Tensor | None,
        prompts: torch.Tensor | None = None,
    ) -> torch.Tensor:
        self.lengths.saw_step(session, position, hidden.shape[1])
        if self.engine is not None and prompts is None:  # prompted steps (a prefix's prefill) run alone
            ahead = self.lengths.ahead(session, position) if hidden.shape[1] == 1 else None
            progress = session.progress.advance if session.progress is not None else None
            output = await self.engine.run(
                self.span,
                session.cache,
                hidden,
                position,
                padding_mask,
                session.adapter,
                ahead=ahead,
                progress=progress,
            )
        else:
            thread_delay = self.compute_delay - self.overlap_delay

            def run() -> torch.Tensor:
                with adapter_rows(self.span, [session.adapter] * hidden.shape[0]):
                    output = self.span(hidden, session.cache, position, padding_mask, prompts)
                tokens = hidden.shape[0] * hidden.shape[1]
                delay = emulated_seconds_per_block(thread_delay, self.compute_delay_per_token, tokens)
                if delay:
                    time.sleep(delay * session.cache.num_blocks)
                return output.to(hidden.device, hidden.dtype)  # back to the wire's CPU tensors

            output = await asyncio.get_running_loop().run_in_executor(self.executor, run)
            if session.progress is not None:
                session.progress.advance(position + hidden.shape[1])
        if self.overlap_delay:
            await asyncio.sleep(self.overlap_delay * session.cache.num_blocks)
        return output

    def _reply(self, message, tensors: list[torch.Tensor]) -> runtime_pb2.ExpertResponse:
        response = encode(message, tensors, request=False)
        self.metrics.sent.inc(response.ByteSize())
        return response

    def _error(self, code: ErrorCode, text: str) -> runtime_pb2.ExpertResponse:
        self.metrics.errors.labels(code=str(code)).inc()
        response = encode(Error(code=code, message=text), request=False)
        self.metrics.sent.inc(response.ByteSize())
        return response

    async def add_p2p_handlers(self, p2p, wrapper=None, *, namespace=None, balanced=False) -> None:
        """hivemind's handlers for the unary RPCs (the p2p daemon bounds their size), and the
        inference stream on the bounded transport under the name hivemind's stubs call."""
        self._collect_rpc_handlers()
        unary = [handler for handler in self._rpc_handlers if handler.method_name != "rpc_inference"]
        await asyncio.gather(
            *(
                p2p.add_protobuf_handler(
                    self._get_handle_name(namespace, handler.method_name),
                    getattr(self, handler.method_name),
                    handler.request_type,
                    stream_input=handler.stream_input,
                    stream_output=handler.stream_output,
                    balanced=balanced,
                )
                for handler in unary
            ),
            add_bounded_stream_handler(
                p2p, self._get_handle_name(namespace, "rpc_inference"), self._inference
            ),
            self.add_handoff_handler(p2p, namespace),
        )

    async def remove_p2p_handlers(self, p2p, *, namespace=None) -> None:
        await asyncio.gather(
            super().remove_p2p_handlers(p2p, namespace=namespace), self.remove_handoff_handler(p2p, namespace)
        )

    def shutdown(self) -> None:
        self.accepting = False
        self.executor.shutdown(wait=False, cancel_futures=True)
        if self.engine is not None:
            self.engine.shutdown()
            logger.info("batching engine: %s", self.engine.stats.summary())


def _message_type(request: runtime_pb2.ExpertRequest) -> object:
    """The `type` of a request's metadata, or None when it has none (the step parser then says why)."""
    try:
        return decode_metadata(request.metadata).get("type")
    except ProtocolError:
        return None


class _LifetimeOver(Exception):
    """The session reached `PeerLimits.max_session_lifetime`."""
