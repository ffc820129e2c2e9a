"""The server's RPCs over hivemind P2P: inference sessions (bidirectional stream), forward, info.

Transport and validation live here; the arithmetic is the span's. Every request is validated
before it touches the model, every error is answered with a message naming what was wrong, and a
session's cache reservation is released on every way out of its stream (end, error, disconnect,
idle timeout, shutdown), so one client can never take memory or the server down with it.

Besides sessions, `BlockServicer` holds, in this order in the class: the validation every RPC
shares (the swarm's proof, per-peer shares, blocks, sizes and adapters a request names, the largest
message a session may send); the unary RPCs besides `info` (reports of wrong outputs, training's
forward and backward of whole sequences, nothing kept between calls); and its part in cache
hand-offs, pushing a session's cache when its client asks and receiving one on the push stream
(protocol: swarm/handoff_wire.py and docs/architecture.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import AsyncIterator  # noqa: UP035  (hivemind detects streaming RPCs by typing's alias)

import torch
from hivemind.p2p import P2P, P2PContext
from hivemind.proto import runtime_pb2
from hivemind.utils.serializer import MSGPackSerializer

from llm_swarm.server.bounded_stream import StreamLimit, add_bounded_stream_handler
from llm_swarm.server.cache_progress import CacheProgress
from llm_swarm.server.cache_receiver import receive_cache
from llm_swarm.server.cache_sender import REPLY_TIMEOUT, PushResult, push_cache
from llm_swarm.server.decode_load import DecodeLoad
from llm_swarm.server.emulated_delay import emulated_seconds_per_block
from llm_swarm.server.engine import BatchingEngine
from llm_swarm.server.following_push import FollowingPush
from llm_swarm.server.link_probes import PROBE_HANDLE, receive_probe
from llm_swarm.server.memory import CacheBudget, NoCacheRoom
from llm_swarm.server.metrics import ServerMetrics
from llm_swarm.server.replay import MAX_TOKENS_PER_POSITION, parse_replay
from llm_swarm.server.session import Session, check_hypo_ids, check_step_inputs
from llm_swarm.server.session_inputs import SessionIdle, SessionInputs, SessionLifetimeOver
from llm_swarm.server.session_lengths import SessionLengths
from llm_swarm.server.step_pusher import PushTarget, StepPusher
from llm_swarm.server.step_receiver import receive_steps
from llm_swarm.server.training import parse_sequence_call, run_backward, run_forward
from llm_swarm.swarm.block_rpc import BlockRpc
from llm_swarm.swarm.chain_wire import ChainLink, PushedStep, step_digest
from llm_swarm.swarm.closed_swarm import SwarmSecret
from llm_swarm.swarm.direct_listener import DirectListener
from llm_swarm.swarm.handoff_wire import HandedOff, HandOff
from llm_swarm.swarm.models.adapters import adapter_rows
from llm_swarm.swarm.models.span import TransformerSpan
from llm_swarm.swarm.step_frame import StepFrame, decode_frame, encode_frame, framable
from llm_swarm.swarm.stream_opener import StreamOpener
from llm_swarm.swarm.wire import (
    PEER_LIMIT_PREFIX,
    Ack,
    Backward,
    Computed,
    Error,
    ErrorCode,
    Forward,
    InfoRequest,
    Open,
    Opened,
    ProtocolError,
    Replay,
    Replayed,
    Report,
    Step,
    StepDone,
    decode_metadata,
    decode_tensors,
    encode,
    parse,
)

logger = logging.getLogger(__name__)

REPORT_WINDOW = 10.0  # seconds: one peer's reports of wrong outputs count at most once per window
MAX_REPORTERS = 10_000
MAX_LINKS = 16  # measured links a server announces (the record's bound)
PUSH_HANDLE = "push_cache"  # not rpc_*: hivemind would register it as a plain protobuf handler
STEP_PUSH_HANDLE = "push_steps"  # chain sessions: a predecessor's pushed steps (server/step_receiver.py)


@dataclass(frozen=True)
class PeerLimits:
    """What one client peer may hold at once, so no single peer can take the whole server."""

    max_sessions: int = 64
    max_cache_fraction: float = 0.5  # of the session cache (the budget less the blocks)
    max_session_lifetime: float = 24 * 3600.0  # seconds, however active the session is


class BlockServicer(BlockRpc):
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
        direct: DirectListener | None = None,
        streams: StreamOpener | None = None,
        bulk_streams: StreamOpener | None = None,
    ):
        self.span, self.budget = span, budget
        self.direct = direct  # serves the stream handlers over direct TLS streams too, when set
        self.streams = streams  # opens our pushes to other servers (libp2p only when None)
        self.bulk_streams = bulk_streams  # opens our cache hand-offs (libp2p only when None)
        self.max_length, self.max_batch_size = max_length, max_batch_size
        self.session_idle_timeout = session_idle_timeout
        # emulation: seconds added per block per step (docs/reference.md section 8). By default the
        # delay holds the compute thread (an accelerator busy with one step at a time; a batched
        # decode pays it once).
        # With `compute_delay_overlap` each step waits out its own delay off the compute thread, so
        # concurrent sessions' delays overlap: an accelerator whose step time does not depend on how
        # many sessions it serves, which is Sun et al.'s cost model and the simulator's.
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
        inputs: SessionInputs | None = None
        try:
            first = await self._next_request(requests)
            if first is None:
                return
            try:
                if isinstance(first, StepFrame):
                    raise ProtocolError(ErrorCode.BAD_REQUEST, "expected an open message, got a step frame")
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
            inputs = SessionInputs(requests, session.inbox, lambda: bool(session.push_from))
            while True:
                # a session receiving a cache takes no pushed steps meanwhile; one whose prompt's cache
                # follows to a decode server takes its prompt from a push as from its client
                item = await inputs.next(self.session_idle_timeout, ends_at, pushes=not session.receiving)
                if item is None:
                    return  # the client closed its side: the session is over
                source, request = item
                if source == "push":
                    reply = await self._pushed_step(session, *request)
                    if reply is not None:
                        yield reply
                        if following is not None:  # the pushed step was the one the hand-off follows
                            yield await self._end_follow(session, following, True)
                            following = None
                    continue
                self.metrics.received.inc(_message_bytes(request))
                kind = "step" if isinstance(request, StepFrame) else _message_type(request)
                if kind == "chain_link":
                    refusal = self._link(session, request)
                    if refusal is not None:
                        yield refusal
                    continue
                if following is not None:  # a push follows this session's prompt: its step must come now
                    stepped = kind not in ("hand_off", "replay")
                    if stepped:
                        reply = await self._step(session, request)
                        if reply is not None:
                            yield reply
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
                    reply = await self._step(session, request)
                    if reply is not None:  # None: a copy of a step that already ran from a push
                        yield reply
                    continue
                response, replayed = await self._replay(session, request)
                yield response
                if not replayed:
                    return  # a failed replay leaves a useless cache: the session ends, its memory is freed
        except SessionLifetimeOver:
            logger.info("session %s reached the lifetime limit: closed", session.session_id[:8])
            with contextlib.suppress(Exception):
                yield self._error(
                    ErrorCode.SESSION_EXPIRED,
                    f"session lifetime of {self.limits.max_session_lifetime:.0f} s is over: open a new one",
                )
        except SessionIdle:
            logger.info(
                "session %s idle for %.0f s: closed",
                session.session_id if session else "?",
                self.session_idle_timeout,
            )
            with contextlib.suppress(Exception):
                yield self._error(ErrorCode.SESSION_EXPIRED, "session idle for too long")
        finally:
            if inputs is not None:
                inputs.close()
            if following is not None:
                self._drop_follow(session, following)
            if session is not None:
                self._close(session)

    async def _next_request(self, requests: AsyncIterator[runtime_pb2.ExpertRequest]):
        """The stream's first request (its `Open`), None if the client ended at once."""
        try:
            request = await asyncio.wait_for(anext(requests), timeout=self.session_idle_timeout)
        except StopAsyncIteration:
            return None
        except TimeoutError:
            raise SessionIdle() from None
        self.metrics.received.inc(_message_bytes(request))
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
        needed = self.span.session_cache_bytes(
            message.batch_size, message.max_length, message.start, message.end
        )
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
        if session.pusher is not None:
            session.pusher.close()
            session.pusher = None
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

    async def _step(
        self, session: Session, request: runtime_pb2.ExpertRequest | StepFrame
    ) -> runtime_pb2.ExpertResponse | StepFrame | None:
        """The client's step, answered (a frame answers a frame); None for its copy of a step that
        already ran from a push (answered then)."""
        framed = isinstance(request, StepFrame)
        try:
            _check_size(_message_bytes(request), self._session_message_limit(session), "message")
            if framed:
                # a client that sends frames reads them: its session's answers to pushes go as frames too
                session.step_frames = True
                message, tensors = decode_frame(request, Step)
            else:
                message, tensors = parse(request.metadata, Step), None
            if session.receiving:
                # "wait": a push the client gave up on is still being undone here
                raise ProtocolError(
                    ErrorCode.NO_CACHE_ROOM, "the session is receiving its cache: wait for it"
                )
            if session.answered.get(message.step_id):
                self.metrics.chained_steps.labels(how="copy_dropped").inc()
                return None
            replay = session.replayed_output(message.step_id, message.position)
            if replay is not None:
                done = StepDone(step_id=message.step_id, position=message.position)
                return self._reply(done, [replay], framed)
            if tensors is None:
                tensors = decode_tensors(request)
            hidden, padding_mask, prompts = check_step_inputs(
                session, self.span.hidden_size, message.position, tensors, message.prompts
            )
            hypo_ids = check_hypo_ids(session, message.hypo_ids)
            output = await self._run_step(session, message.position, hidden, padding_mask, prompts, hypo_ids)
            if message.last_only:
                output = output[:, -1:]
            self._push_on(
                session,
                message.step_id,
                # a last-only step (a failover's catch-up) pushes the one step it ends with
                message.position + hidden.shape[1] - output.shape[1],
                message.hypo_ids,
                output,
                padding_mask,
                message.push_hops,
            )
            session.record(message.step_id, message.position, output)
            done = StepDone(step_id=message.step_id, position=message.position, leaving=not self.accepting)
            return self._reply(done, [output], framed)
        except ProtocolError as error:
            return self._error(error.code, str(error))
        except Exception as error:  # a bug or a device fault: this session fails, the server serves on
            logger.exception("session %s: step failed", session.session_id[:8])
            return self._error(
                ErrorCode.INTERNAL, f"step failed on the server: {type(error).__name__}: {error}"
            )

    async def _run_step(
        self,
        session: Session,
        position: int,
        hidden: torch.Tensor,
        padding_mask: torch.Tensor | None,
        prompts: torch.Tensor | None,
        hypo_ids: torch.Tensor | None,
    ) -> torch.Tensor:
        """A checked step on the session's cache, timed (the metrics and the decode load)."""
        if hypo_ids is not None:
            session.cache.reorder(hypo_ids)
        kind = "decode" if hidden.shape[1] == 1 else "prefill"
        decoding = 0  # sessions decoding here now, this one included (`server.decode_load`)
        if kind == "decode":
            decoding = self.decode_load.decoding(session.session_id, time.monotonic())
        started = time.perf_counter()
        output = await self._compute(session, hidden, position, padding_mask, prompts)
        elapsed = time.perf_counter() - started
        self.metrics.step_seconds[kind].observe(elapsed)
        if decoding:
            self.decode_load.observe(decoding, elapsed)
        return output

    # --- chain sessions: steps pushed server to server (swarm/chain_wire.py) ----------------------
    def _link(
        self, session: Session, request: runtime_pb2.ExpertRequest
    ) -> runtime_pb2.ExpertResponse | None:
        """The client's `ChainLink`: who may push steps here, and where this session pushes its
        outputs. No reply unless it is invalid."""
        try:
            link = parse(request.metadata, ChainLink)
            if bool(link.accept_token) != bool(link.accept_from):
                raise ProtocolError(ErrorCode.BAD_REQUEST, "accept_token and accept_from come together")
            if len({bool(link.next_peer), bool(link.next_session), bool(link.next_token)}) != 1:
                raise ProtocolError(
                    ErrorCode.BAD_REQUEST, "next_peer, next_session and next_token come together"
                )
        except ProtocolError as error:
            return self._error(error.code, str(error))
        session.push_token, session.push_from = link.accept_token, link.accept_from
        session.linked.set()
        target = (
            PushTarget(link.next_peer, link.next_session, link.next_token, link.next_frames)
            if link.next_peer
            else None
        )
        if session.pusher is not None and session.pusher.target != target:
            session.pusher.close()
            session.pusher = None
        if target is not None and session.pusher is None and self.streams is not None:
            handle = self._get_handle_name(self._namespace, STEP_PUSH_HANDLE)
            session.pusher = StepPusher(self.streams, handle, target, session.session_id[:8])
        return None

    def _push_on(
        self,
        session: Session,
        step_id: str,
        position: int,
        hypo_ids: list[int] | None,
        output: torch.Tensor,
        padding_mask: torch.Tensor | None,
        push_hops: int,
    ) -> None:
        """The step's output to the session's successor, when the step asks for it (never waits)."""
        if push_hops <= 0 or session.pusher is None:
            return
        step = PushedStep(
            step_id=step_id,
            position=position,
            hypo_ids=hypo_ids,
            masked=padding_mask is not None,
            push_hops=push_hops - 1,
        )
        session.pusher.push(step, [output] if padding_mask is None else [output, padding_mask])

    async def _pushed_step(
        self, session: Session, step: PushedStep, tensors: list[torch.Tensor]
    ) -> runtime_pb2.ExpertResponse | None:
        """A step the predecessor pushed, run unless the client's copy ran first, and answered to the
        client at once (with the digest of its input); a push that does not fit the session now is
        dropped (the client's copy still comes)."""
        if step.step_id in session.answered or session.receiving or session.cache is None:
            return None
        try:
            hidden, padding_mask, _ = check_step_inputs(
                session, self.span.hidden_size, step.position, tensors
            )
            hypo_ids = check_hypo_ids(session, step.hypo_ids)
            output = await self._run_step(session, step.position, hidden, padding_mask, None, hypo_ids)
        except ProtocolError as error:
            logger.info("session %s: pushed step %s not run: %s", session.session_id[:8], step.step_id, error)
            return None
        except Exception:  # a bug or a device fault: the client's copy is run (or fails) as any step
            logger.exception("session %s: pushed step failed", session.session_id[:8])
            return None
        self.metrics.chained_steps.labels(how="pushed").inc()
        self._push_on(
            session, step.step_id, step.position, step.hypo_ids, output, padding_mask, step.push_hops
        )
        session.record(step.step_id, step.position, output, pushed=True)
        digest = step_digest(hidden, padding_mask, step.hypo_ids)
        done = StepDone(
            step_id=step.step_id,
            position=step.position,
            leaving=not self.accepting,
            pushed=True,
            input_digest=digest,
        )
        return self._reply(done, [output], session.step_frames)

    async def _replay(self, session: Session, request: runtime_pb2.ExpertRequest):
        """Run a `Replay`'s steps in order (a failover's exact catch-up in one round trip); returns the
        reply and whether it succeeded."""
        try:
            _check_size(request.ByteSize(), self._replay_limit(session), "replay")
            message = parse(request.metadata, Replay)
            steps = parse_replay(message, decode_tensors(request), session, self.span.hidden_size)
            started, outputs = time.perf_counter(), []
            for step in steps:  # one by one through the engine: other sessions' steps interleave
                if step.hypo_ids is not None:
                    session.cache.reorder(step.hypo_ids)
                outputs.append(await self._compute(session, step.hidden, step.position, step.padding_mask))
            session.last_active = time.monotonic()
            tokens = sum(step.hidden.shape[1] for step in steps)
            self.metrics.step_seconds["replay"].observe(time.perf_counter() - started)
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

    def _session_message_limit(self, session: Session) -> int:
        """The largest legitimate step of `session`."""
        return self._message_limit(session.batch_size, session.max_length)

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

    def _reply(
        self, message, tensors: list[torch.Tensor], framed: bool = False
    ) -> runtime_pb2.ExpertResponse | StepFrame:
        """`message` as a protobuf response; as a step frame with `framed` where it has one."""
        if framed and framable(message, tensors):
            frame = encode_frame(message, tensors)
            self.metrics.sent.inc(frame.nbytes)
            return frame
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
                p2p,
                self._get_handle_name(namespace, "rpc_inference"),
                self._inference,
                direct=self.direct,
                step_frames=True,
            ),
            self.add_handoff_handler(p2p, namespace),
        )

    async def remove_p2p_handlers(self, p2p, *, namespace=None) -> None:
        if self.direct is not None:
            for name in self._stream_handles(namespace):
                self.direct.remove_handler(name)
        await asyncio.gather(
            super().remove_p2p_handlers(p2p, namespace=namespace), self.remove_handoff_handler(p2p, namespace)
        )

    def shutdown(self) -> None:
        self.accepting = False
        self.executor.shutdown(wait=False, cancel_futures=True)
        if self.engine is not None:
            self.engine.shutdown()
            logger.info("batching engine: %s", self.engine.stats.summary())

    def _message_limit(self, batch_size: int, tokens: int) -> int:
        """The largest legitimate step: float32 hidden states and a padding mask for every position."""
        return batch_size * tokens * (self.span.hidden_size * 4 + 8) + 64 * 1024

    def _check_proof(self, proof: str, context: P2PContext) -> None:
        """In a closed swarm, the caller must prove it holds the swarm secret (bound to both peer ids)."""
        if self.swarm_secret is None:
            return
        if not self.swarm_secret.check_session_proof(proof, str(context.remote_id), self.local_peer_id):
            raise ProtocolError(
                ErrorCode.UNAUTHORIZED,
                "this server belongs to a closed swarm: the request does not prove the swarm secret",
            )

    def _check_peer_share(self, peer: str, needed: int) -> None:
        """One peer may hold at most `max_sessions` sessions and `max_cache_fraction` of the cache."""
        held = [session for session in self.sessions.values() if session.peer == peer]
        if len(held) >= self.limits.max_sessions:
            raise NoCacheRoom(
                f"{PEER_LIMIT_PREFIX}: it already holds {len(held)} sessions, the per-peer limit"
            )
        share = int(self.budget.total_bytes * self.limits.max_cache_fraction)
        reserved = sum(session.reserved_bytes for session in held)
        if reserved + needed > share:
            raise NoCacheRoom(
                f"{PEER_LIMIT_PREFIX}: {reserved:,} bytes held + {needed:,} needed exceed the "
                f"per-peer share of {share:,} bytes"
            )

    def _check_blocks(self, start: int, end: int) -> None:
        if not self.span.start <= start < end <= self.span.end:
            raise ProtocolError(
                ErrorCode.NOT_SERVING,
                f"blocks {start}:{end} are not inside this server's span {self.span.start}:{self.span.end}",
            )

    def _check_adapter(self, name: str) -> str | None:
        """The adapter a request names ("": none), if this server holds it."""
        if not name:
            return None
        held = self.span.adapters.names if self.span.adapters is not None else ()
        if name not in held:
            raise ProtocolError(
                ErrorCode.NOT_SERVING,
                f"this server has no adapter {name!r} (it has: {', '.join(held) or 'none'})",
            )
        return name

    def _check_sizes(self, batch_size: int, length: int) -> None:
        if batch_size > self.max_batch_size:
            raise ProtocolError(
                ErrorCode.BAD_REQUEST, f"batch size {batch_size} exceeds the limit {self.max_batch_size}"
            )
        if length > self.max_length:
            raise ProtocolError(
                ErrorCode.BAD_REQUEST, f"max_length {length} exceeds the server's limit {self.max_length}"
            )

    # --- reports of wrong outputs ---------------------------------------------------------------
    async def rpc_report(
        self, request: runtime_pb2.ExpertRequest, context: P2PContext
    ) -> runtime_pb2.ExpertResponse:
        """A client says this server's output was wrong (outvoted by replicas, or malformed): counted
        and logged for the operator, nothing more (any client may send it; one per peer per window)."""
        try:
            report = parse(request.metadata, Report)
            self._check_proof(report.swarm_proof, context)
            self._check_blocks(report.start, report.end)
        except ProtocolError as error:
            return self._error(error.code, str(error))
        peer, now = str(context.remote_id), time.monotonic()
        if now - self._reported_at.get(peer, -REPORT_WINDOW) >= REPORT_WINDOW:
            if len(self._reported_at) >= MAX_REPORTERS:  # forget the old windows, never grow unbounded
                self._reported_at = {p: t for p, t in self._reported_at.items() if now - t < REPORT_WINDOW}
            self._reported_at[peer] = now
            self.metrics.wrong_output_reports.labels(reason=report.reason).inc()
            detail = (
                f"{report.relative_difference:.3g} relative difference from two agreeing replicas"
                if report.reason == "outvoted"
                else "NaN, infinity or a wrong shape"
            )
            logger.warning(
                "client %s reports this server's output for blocks %d:%d as wrong (%s): check the device, "
                "dtype and quantization",
                peer[-8:],
                report.start,
                report.end,
                detail,
            )
        return self._reply(Ack(), [])

    # --- training: forward and backward of whole sequences, nothing kept -----------------------------
    async def rpc_forward(
        self, request: runtime_pb2.ExpertRequest, context: P2PContext
    ) -> runtime_pb2.ExpertResponse:
        """Run blocks [start, end) on whole sequences (no cache): inference without a session, and the
        forward pass of training."""
        return await self._sequence_call(request, context, backward=False)

    async def rpc_backward(
        self, request: runtime_pb2.ExpertRequest, context: P2PContext
    ) -> runtime_pb2.ExpertResponse:
        """Gradients of blocks [start, end) with respect to their inputs (and deep prompts), the
        forward recomputed: nothing of a client's is kept between calls."""
        return await self._sequence_call(request, context, backward=True)

    async def _sequence_call(
        self, request: runtime_pb2.ExpertRequest, context: P2PContext, backward: bool
    ) -> runtime_pb2.ExpertResponse:
        kind = "backward" if backward else "forward"
        owner = f"{kind}:{id(request)}"
        self.metrics.received.inc(request.ByteSize())
        try:
            if not self.accepting:
                raise ProtocolError(ErrorCode.NOT_SERVING, "this server is shutting down")
            size, limit = request.ByteSize(), 3 * self._message_limit(self.max_batch_size, self.max_length)
            if size > limit:
                raise ProtocolError(
                    ErrorCode.BAD_REQUEST, f"message of {size:,} bytes exceeds the limit of {limit:,}"
                )
            message = parse(request.metadata, Backward if backward else Forward)
            self._check_proof(message.swarm_proof, context)
            self._check_blocks(message.start, message.end)
            adapter = self._check_adapter(message.adapter)
            call = parse_sequence_call(
                decode_tensors(request),
                message.start,
                message.end,
                backward=backward,
                with_prompts=message.prompts,
                hidden_size=self.span.hidden_size,
                max_batch_size=self.max_batch_size,
                max_length=self.max_length,
            )
            # activations: one block's at a time without autograd, every block's for a backward
            blocks = call.end - call.start if backward else 1
            needed = self.span.training_bytes(call.batch_size, call.num_tokens, blocks)
            self._check_peer_share(str(context.remote_id), needed)
            self.budget.reserve(owner, needed)
            started = time.perf_counter()
            compute = partial(run_backward if backward else run_forward, self.span, call, adapter)
            outputs = await asyncio.get_running_loop().run_in_executor(self.executor, compute)
            self.metrics.step_seconds[kind].observe(time.perf_counter() - started)
            return self._reply(Computed(), outputs if backward else [outputs])
        except ProtocolError as error:
            return self._error(error.code, str(error))
        except NoCacheRoom as error:
            return self._error(ErrorCode.NO_CACHE_ROOM, str(error))
        except Exception as error:
            logger.exception("%s failed", kind)
            return self._error(
                ErrorCode.INTERNAL, f"{kind} failed on the server: {type(error).__name__}: {error}"
            )
        finally:
            self.budget.release(owner)

    _p2p: P2P | None = None
    _namespace: str | None = None
    link_rates: OrderedDict[str, float]  # receiving peer -> bytes/s of our last push there (announced)

    def _push_handle(self, namespace: str | None) -> str:
        return self._get_handle_name(namespace, PUSH_HANDLE)

    async def add_handoff_handler(self, p2p: P2P, namespace: str | None) -> None:
        self._p2p, self._namespace = p2p, namespace
        if self.streams is None or self.bulk_streams is None:
            libp2p_only = StreamOpener(p2p, None, lambda _peer: None)
            self.streams = self.streams or libp2p_only
            self.bulk_streams = self.bulk_streams or libp2p_only
        self.link_rates = OrderedDict()

        def find_session(session_id: str) -> Session | None:
            return self.sessions.get(session_id)

        async def handler(requests, context, limit):
            async for response in receive_cache(
                requests, context, limit, find_session, self.session_idle_timeout
            ):
                yield response

        await add_bounded_stream_handler(p2p, self._push_handle(namespace), handler, direct=self.direct)

        async def step_handler(requests, context, limit):
            async for response in receive_steps(
                requests,
                context,
                limit,
                find_session,
                self.span.hidden_size,
                self._session_message_limit,
                self.session_idle_timeout,
            ):
                yield response

        await add_bounded_stream_handler(
            p2p,
            self._get_handle_name(namespace, STEP_PUSH_HANDLE),
            step_handler,
            direct=self.direct,
            step_frames=True,
        )
        probing = asyncio.Lock()  # one probe at a time: others are refused, never queued

        async def probe_handler(requests, context, limit):
            async for response in receive_probe(requests, context, limit, probing):
                yield response

        await add_bounded_stream_handler(p2p, self.probe_handle(namespace), probe_handler, direct=self.direct)

    def _stream_handles(self, namespace: str | None) -> tuple[str, ...]:
        """The names of the handlers served on the bounded transport (and direct streams)."""
        return (
            self._get_handle_name(namespace, "rpc_inference"),
            self._push_handle(namespace),
            self._get_handle_name(namespace, STEP_PUSH_HANDLE),
            self.probe_handle(namespace),
        )

    async def remove_handoff_handler(self, p2p: P2P, namespace: str | None) -> None:
        await p2p.remove_binary_stream_handler(self._push_handle(namespace))
        await p2p.remove_binary_stream_handler(self._get_handle_name(namespace, STEP_PUSH_HANDLE))
        await p2p.remove_binary_stream_handler(self.probe_handle(namespace))

    def probe_handle(self, namespace: str | None) -> str:
        return self._get_handle_name(namespace, PROBE_HANDLE)

    def record_link_rate(self, peer: str, rate: float) -> None:
        """Our measured rate to `peer` (a hand-off or a probe), announced in `ServerInfo.links`."""
        self.link_rates[peer] = rate
        self.link_rates.move_to_end(peer)
        while len(self.link_rates) > MAX_LINKS:
            self.link_rates.popitem(last=False)

    @staticmethod
    def check_cache_source(message: Open) -> tuple[str | None, str | None]:
        """A session opened to receive a cache names both the secret and the sender."""
        if bool(message.cache_token) != bool(message.cache_from):
            raise ProtocolError(
                ErrorCode.BAD_REQUEST, "a session that receives a cache needs both cache_token and cache_from"
            )
        return message.cache_token or None, message.cache_from or None

    async def _hand_off(self, session: Session, request: runtime_pb2.ExpertRequest):
        """The session's client asks us to push its cache to another server (see cache_sender)."""
        try:
            order = parse(request.metadata, HandOff)
            if order.follow:
                raise ProtocolError(ErrorCode.BAD_REQUEST, "a following hand-off must precede a step")
            if self._p2p is None:
                raise ProtocolError(ErrorCode.INTERNAL, "this server cannot reach other servers yet")
        except ProtocolError as error:
            logger.info("session %s: hand-off not done: %s", session.session_id[:8], error)
            return self._error(error.code, str(error))
        push = push_cache(self.bulk_streams, self._push_handle(self._namespace), session, order)
        return await self._pushed(session, order, push)

    def _begin_follow(self, session: Session, request: runtime_pb2.ExpertRequest) -> FollowingPush | None:
        """A `HandOff` with `follow`: its push starts now and sends each part of the cache the next
        step computes (`server.cache_progress`); None for one without `follow` (`_hand_off`'s).
        Its answer, whatever happens, comes after the step's, so the client reads both in order: one
        this server will not follow is answered with its refusal then (ProtocolError if the message
        is not a hand-off at all)."""
        order = parse(request.metadata, HandOff)
        if not order.follow:
            return None
        refusal = None
        if self._p2p is None:
            refusal = ProtocolError(ErrorCode.INTERNAL, "this server cannot reach other servers yet")
        elif session.receiving or session.progress is not None:
            refusal = ProtocolError(
                ErrorCode.BAD_REQUEST, "the session is receiving or pushing a cache already"
            )
        elif not session.cache.length < order.length <= session.max_length:
            refusal = ProtocolError(
                ErrorCode.BAD_REQUEST,
                f"a following hand-off pushes positions the next step computes: {order.length} is not in "
                f"({session.cache.length}, {session.max_length}]",
            )
        if refusal is not None:
            return FollowingPush(order, None, refusal)
        progress = session.progress = CacheProgress(asyncio.get_running_loop())
        progress.advance(session.cache.length)
        push = push_cache(self.bulk_streams, self._push_handle(self._namespace), session, order, progress)
        return FollowingPush(order, asyncio.create_task(push))

    async def _end_follow(self, session: Session, following: FollowingPush, stepped: bool):
        """The reply to a following hand-off once its step ran (`stepped`; else the client sent
        something else, and it is cancelled): `HandedOff` once B holds the cache, else an error."""
        order, task = following.order, following.task
        if task is None:
            error = following.refusal or ProtocolError(ErrorCode.INTERNAL, "no push")
            logger.info("session %s: hand-off not done: %s", session.session_id[:8], error)
            return self._error(error.code, str(error))
        cache = session.cache
        if not stepped or cache is None or cache.length < order.length:
            self._drop_follow(session, following)
            text = "the step after it did not compute" if stepped else "no step came after it to compute"
            error = ProtocolError(
                ErrorCode.BAD_REQUEST, f"hand-off cancelled: {text} its {order.length} positions"
            )
            logger.info("session %s: %s", session.session_id[:8], error)
            return self._error(error.code, str(error))
        progress, session.progress = session.progress, None
        if progress is not None:
            progress.advance(cache.length)  # a retried step is answered from memory: nothing was reported
        return await self._pushed(session, order, asyncio.wait_for(task, REPLY_TIMEOUT + order.max_seconds))

    def _drop_follow(self, session: Session | None, following: FollowingPush) -> None:
        """A push following the session's prompt stops at once (the session ended, or its step did not
        compute the positions); its stream to B closes, and B keeps nothing."""
        progress = session.progress if session is not None else None
        if progress is not None:
            progress.abandon()  # a flag as well: Python 3.11's `wait_for` may swallow the cancellation
            session.progress = None
        if following.task is not None:
            following.task.cancel()
            # nothing is left to report: collect its outcome so that none is logged as unretrieved
            following.task.add_done_callback(lambda done: done.cancelled() or done.exception())

    async def _pushed(self, session: Session, order: HandOff, push: Awaitable[PushResult]):
        """`push` awaited, its outcome logged and answered to the client."""
        try:
            result = await push
        except ProtocolError as error:
            logger.info("session %s: hand-off not done: %s", session.session_id[:8], error)
            return self._error(error.code, str(error))
        except Exception as error:  # B unreachable, the stream broke: the client replays instead
            logger.info(
                "session %s: hand-off failed: %s", session.session_id[:8], error or type(error).__name__
            )
            return self._error(ErrorCode.NOT_SERVING, f"hand-off failed: {type(error).__name__}: {error}")
        logger.info(
            "session %s: handed %d positions to %s%s: %d bytes in %.0f ms (%.1f MB/s, %s)",
            session.session_id[:8],
            order.length,
            order.target_peer[-8:],
            " while computing them" if order.follow else "",
            result.bytes,
            result.seconds * 1e3,
            result.bytes / max(result.seconds, 1e-9) / 1e6,
            result.path,
        )
        self.metrics.handoffs.inc()
        self.record_link_rate(order.target_peer, result.bytes / max(result.seconds, 1e-6))
        reply = HandedOff(
            handoff_id=order.handoff_id, length=order.length, bytes=result.bytes, seconds=result.seconds
        )
        return self._reply(reply, [])


def _message_bytes(request: runtime_pb2.ExpertRequest | StepFrame) -> int:
    return request.nbytes if isinstance(request, StepFrame) else request.ByteSize()


def _check_size(size: int, limit: int, what: str) -> None:
    if size > limit:
        raise ProtocolError(
            ErrorCode.BAD_REQUEST, f"{what} of {size:,} bytes exceeds this session's limit of {limit:,}"
        )


def _message_type(request: runtime_pb2.ExpertRequest) -> object:
    """The `type` of a request's metadata, or None when it has none (the step parser then says why)."""
    try:
        return decode_metadata(request.metadata).get("type")
    except ProtocolError:
        return None
