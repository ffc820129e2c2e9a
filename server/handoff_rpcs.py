"""The server's part in cache hand-offs: pushing a session's cache when its client asks (A), and the
stream that receives one (B). Protocol: swarm/handoff_wire.py and docs/architecture.md.

`HandOffRpcs` is a part of `BlockServicer` (server/handler.py): it uses the servicer's sessions,
metrics and the p2p daemon its handlers were added to.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Awaitable
from dataclasses import dataclass

from hivemind.p2p import P2P
from hivemind.proto import runtime_pb2

from server.bounded_stream import add_bounded_stream_handler
from server.cache_progress import CacheProgress
from server.cache_receiver import receive_cache
from server.cache_sender import REPLY_TIMEOUT, PushResult, push_cache
from server.link_probes import PROBE_HANDLE, receive_probe
from server.session import Session
from swarm.handoff_wire import HandedOff, HandOff
from swarm.wire import ErrorCode, Open, ProtocolError, parse

logger = logging.getLogger(__name__)

MAX_LINKS = 16  # measured links a server announces (the record's bound)
PUSH_HANDLE = "push_cache"  # not rpc_*: hivemind would register it as a plain protobuf handler


class HandOffRpcs:
    """See the module docstring."""

    _p2p: P2P | None = None
    _namespace: str | None = None
    link_rates: OrderedDict[str, float]  # receiving peer -> bytes/s of our last push there (announced)

    def _push_handle(self, namespace: str | None) -> str:
        return self._get_handle_name(namespace, PUSH_HANDLE)

    async def add_handoff_handler(self, p2p: P2P, namespace: str | None) -> None:
        self._p2p, self._namespace = p2p, namespace
        self.link_rates = OrderedDict()

        def find_session(session_id: str) -> Session | None:
            return self.sessions.get(session_id)

        async def handler(requests, context, limit):
            async for response in receive_cache(
                requests, context, limit, find_session, self.session_idle_timeout
            ):
                yield response

        await add_bounded_stream_handler(p2p, self._push_handle(namespace), handler)
        probing = asyncio.Lock()  # one probe at a time: others are refused, never queued

        async def probe_handler(requests, context, limit):
            async for response in receive_probe(requests, context, limit, probing):
                yield response

        await add_bounded_stream_handler(p2p, self.probe_handle(namespace), probe_handler)

    async def remove_handoff_handler(self, p2p: P2P, namespace: str | None) -> None:
        await p2p.remove_binary_stream_handler(self._push_handle(namespace))
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
        push = push_cache(self._p2p, self._push_handle(self._namespace), session, order)
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
        push = push_cache(self._p2p, self._push_handle(self._namespace), session, order, progress)
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
            "session %s: handed %d positions to %s%s: %d bytes in %.0f ms (%.1f MB/s)",
            session.session_id[:8],
            order.length,
            order.target_peer[-8:],
            " while computing them" if order.follow else "",
            result.bytes,
            result.seconds * 1e3,
            result.bytes / max(result.seconds, 1e-9) / 1e6,
        )
        self.metrics.handoffs.inc()
        self.record_link_rate(order.target_peer, result.bytes / max(result.seconds, 1e-6))
        reply = HandedOff(
            handoff_id=order.handoff_id, length=order.length, bytes=result.bytes, seconds=result.seconds
        )
        return self._reply(reply, [])


@dataclass(frozen=True)
class FollowingPush:
    """A push started by a following hand-off, waiting for the step that computes its positions."""

    order: HandOff
    task: asyncio.Task | None  # None: refused (`refusal`), answered after the step
    refusal: ProtocolError | None = None
