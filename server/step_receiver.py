"""Server B's side of a chain session: steps pushed by its predecessor, checked and queued for the
session's handler, which runs each one unless the client's copy of it ran first.

A push stream is accepted only for a session that exists here and whose client named, on the
session's own stream (`ChainLink`), both the pushing peer and the token it carries; the token is
compared in constant time. Every message is bounded in size before it is read (the session's largest
step, `StreamLimit`), and its hidden states must be finite floats of the model's width and the
session's batch. The stream waits at most the session idle timeout between messages and ends with
the session. Nothing is reserved for a push: it runs on the session's own cache, in the session's own
order, and at most `INBOX_STEPS` wait there (more are dropped: the client's copies still come).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
from collections.abc import AsyncIterator, Callable

from hivemind.p2p import P2PContext
from hivemind.proto import runtime_pb2

from llm_swarm.server.bounded_stream import StreamLimit
from llm_swarm.server.session import Session, check_hidden, check_padding_mask
from llm_swarm.swarm.chain_wire import PushedStep, PushSteps
from llm_swarm.swarm.step_frame import StepFrame, decode_frame
from llm_swarm.swarm.wire import Error, ErrorCode, ProtocolError, decode_tensors, encode, parse

logger = logging.getLogger(__name__)

# how long a push stream waits for the client's `ChainLink` to the session it names: the client links
# every server as it sends the first step, and the first push may come before the link does
LINK_WAIT = 5.0


async def receive_steps(
    requests: AsyncIterator[runtime_pb2.ExpertRequest | StepFrame],
    context: P2PContext,
    limit: StreamLimit,
    find_session: Callable[[str], Session | None],
    hidden_size: int,
    message_limit: Callable[[Session], int],
    idle_timeout: float,
) -> AsyncIterator[runtime_pb2.ExpertResponse]:
    """The push stream's handler: `PushSteps`, then `PushedStep`s into the session's inbox; a refusal
    is one `Error`, and the stream ends. `message_limit(session)`: the session's largest step."""
    sender = str(context.remote_id)
    try:
        first = await asyncio.wait_for(anext(requests), idle_timeout)
        if isinstance(first, StepFrame):
            raise ProtocolError(ErrorCode.BAD_REQUEST, "expected a push_steps message, got a step frame")
        header = parse(first.metadata, PushSteps)
        session = find_session(header.session_id)
        if session is not None and not session.linked.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(session.linked.wait(), LINK_WAIT)
        session = _claim(session, header, sender)
        limit.max_bytes = message_limit(session)
        while True:
            try:
                async with asyncio.timeout(idle_timeout):  # no task per pushed step, as wait_for makes
                    request = await anext(requests)
            except StopAsyncIteration:
                return  # the pusher is done (its session ended)
            if session.cache is None or find_session(session.session_id) is not session:
                raise ProtocolError(ErrorCode.NOT_SERVING, "the session ended")
            if isinstance(request, StepFrame):
                step, tensors = decode_frame(request, PushedStep)
            else:
                step, tensors = parse(request.metadata, PushedStep), decode_tensors(request)
            tensors = _check_tensors(session, step, tensors, hidden_size)
            if sender != session.push_from:  # the client named another predecessor since
                raise ProtocolError(ErrorCode.UNAUTHORIZED, "this peer no longer pushes to the session")
            try:
                session.inbox.put_nowait((step, tensors))
            except asyncio.QueueFull:
                logger.info(
                    "session %s: pushed step %s dropped, inbox full", session.session_id[:8], step.step_id
                )
    except (ProtocolError, TimeoutError, StopAsyncIteration) as error:
        code = error.code if isinstance(error, ProtocolError) else ErrorCode.BAD_REQUEST
        text = str(error) if isinstance(error, ProtocolError) else "the push stream stalled or ended at once"
        logger.warning("step pushes from %s refused: %s", sender[-8:], text)
        yield encode(Error(code=code, message=text), request=False)


def _claim(session: Session | None, header: PushSteps, sender: str) -> Session:
    """The session these pushes are for; refuses anything else in one line."""
    refused = None
    if session is None or session.cache is None or not session.push_token:
        refused = "no session here accepts pushed steps under that id"
    elif not hmac.compare_digest(session.push_token, header.token):
        refused = "the token does not match the one the session's client gave"
    elif sender != session.push_from:
        refused = "this peer is not the one the session's client named as its predecessor"
    if refused is not None:
        raise ProtocolError(ErrorCode.UNAUTHORIZED, refused)
    return session


def _check_tensors(session: Session, step: PushedStep, tensors: list, hidden_size: int) -> list:
    """Hidden states (and a padding mask if `masked`) of the session's batch: what every step needs,
    whatever its position; the position is checked when the step runs, against the cache then."""
    if len(tensors) != (2 if step.masked else 1):
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"a pushed step carries {1 + step.masked} tensors")
    hidden = check_hidden(tensors[0], hidden_size, "pushed hidden states")
    batch, tokens, _ = hidden.shape
    if batch != session.batch_size or tokens < 1 or step.position + tokens > session.max_length:
        raise ProtocolError(
            ErrorCode.BAD_REQUEST,
            f"a pushed step of shape {tuple(hidden.shape)} at {step.position} does not fit the session "
            f"(batch {session.batch_size}, max_length {session.max_length})",
        )
    if step.masked:
        check_padding_mask(tensors[1], batch, step.position + tokens)
    return tensors
