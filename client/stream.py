"""One server's part of an inference session: a bidirectional stream and the inputs sent on it."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from dataclasses import dataclass, field, replace

import torch
from hivemind.p2p import P2P

from llm_swarm.client.connection import SwarmConnection
from llm_swarm.client.push_copies import PushCopies
from llm_swarm.swarm.block_rpc import BlockRpc
from llm_swarm.swarm.chain_wire import ChainLink, answers_another_step, step_digest
from llm_swarm.swarm.cost import REWIND_RESERVE
from llm_swarm.swarm.framing import receive_reply, send_message
from llm_swarm.swarm.handoff_wire import HandedOff, HandOff
from llm_swarm.swarm.route_request import RouteHop, SessionShape
from llm_swarm.swarm.step_frame import StepFrame, decode_frame, encode_frame, framable, pushed_answer_id
from llm_swarm.swarm.tensor_wire import all_finite
from llm_swarm.swarm.wire import (
    Error,
    ErrorCode,
    Open,
    Opened,
    RemoteError,
    Replay,
    Replayed,
    Step,
    StepDone,
    decode_tensors,
    encode,
    parse,
)

LAST_WORDS_TIMEOUT = 1.0  # seconds to read a closed stream's last reply (its reason) after a failed send

# errors that another server would answer the same way: our request is wrong, or not allowed here
FATAL_CODES = (ErrorCode.BAD_REQUEST, ErrorCode.UNAUTHORIZED)


class PushMismatch(Exception):
    """A server ran a step from its predecessor's push, and that input is not what the client got
    from the predecessor: one of the two servers is wrong. The client runs the step again from its
    own copy, and this link pushes no more."""

    def __init__(self, peer: str):
        super().__init__(f"{peer[-8:]} ran a pushed input that differs from the client's copy")
        self.peer = peer


class StreamFailure(Exception):
    """The connection to a server broke, timed out or carried garbage. `wrong_output`: the server
    answered, but with something no honest server sends (NaN, a wrong shape): its fault for sure."""

    def __init__(
        self, peer: str, cause: object, wrong_output: bool = False, blocks: tuple[int, int] | None = None
    ):
        super().__init__(f"{peer[-8:]}: {cause or type(cause).__name__}")
        self.peer, self.wrong_output, self.blocks = peer, wrong_output, blocks


@dataclass(frozen=True)
class StepInput:
    """One step as a server receives it. The client keeps the ones it sent each server (the
    client-side cache) and replays them, reorderings included, to rebuild a server's cache elsewhere."""

    hidden: torch.Tensor  # [batch, new tokens, hidden]
    position: int  # absolute position of the first new token
    padding_mask: torch.Tensor | None = None  # [batch, position + new], only once padding appears
    hypo_ids: tuple[int, ...] | None = None  # beam search: sequence i first continues hypo_ids[i]
    # deep prompt tuning: a prompt per block `[blocks, batch or 1, prefix, hidden]` for absolute blocks
    # from `prompts_start`; each server gets its blocks' slice while the step reaches below `prefix`
    prompts: torch.Tensor | None = None
    prompts_start: int = 0

    def prompts_for(self, start: int, end: int) -> torch.Tensor | None:
        """The prompts of absolute blocks `[start, end)` if this step needs them, else None."""
        if self.prompts is None or self.position >= self.prompts.shape[2]:
            return None
        return self.prompts[start - self.prompts_start : end - self.prompts_start]

    @property
    def end(self) -> int:
        return self.position + self.hidden.shape[1]


@dataclass
class ServerStream:
    """One server's part of a session: an open bidirectional stream and what we sent it."""

    hop: RouteHop
    session_id: str
    shape: SessionShape
    history: list[StepInput] = field(default_factory=list)  # the client-side cache of this server's inputs
    healthy: bool = False  # opened, and no step has failed since
    leaving: bool = False  # the server said it is leaving (draining, moving): move the session off it
    cache_token: str | None = None  # opened to receive a hand-off: the secret its pusher must show
    stay_until: float = 0.0  # monotonic time before which a move off this leaving server is not retried
    length: int = 0  # positions of the server's cache that hold accepted work (rewinds shorten it)
    steps_sent: int = 0  # numbers step ids: a step after a rewind may repeat an earlier position
    # chain sessions (swarm.chain_wire): the secret a predecessor's pushes into this session carry,
    # and the wiring last told to the server (whom it accepts pushes from, where it pushes)
    push_token: str = field(default_factory=lambda: secrets.token_hex(16))
    linked: ChainLink | None = None
    pushed_answers: int = 0  # steps the server ran from its predecessor's push and answered unasked
    push_copies: PushCopies = field(default_factory=PushCopies)  # when our copies of pushed steps go
    step_frames: bool = False  # steps go as frames (swarm.step_frame): the server announces them
    # the stream through our p2p daemon, read and written directly (not hivemind's stream iterator,
    # which after the server's side closes waits for our request stream to end and so never returns)
    _writer: asyncio.StreamWriter | None = None
    _replies: asyncio.Queue | None = None  # what the server sent, read as it arrives (then _CLOSED)
    _reading: asyncio.Task | None = None
    _opened_by: float | None = None  # opened `answered_later`: when its `Opened` is due, until read

    async def open(
        self, connection: SwarmConnection, cache_from: str | None = None, answered_later: bool = False
    ) -> str | None:
        """Open the session on the server; with `cache_from` (a peer id), opened to receive its cache
        from that server: returns the secret a hand-off must carry (None otherwise).
        `answered_later`: return once `Open` is sent; the server's `Opened` (or its refusal) is read
        before the next reply, so the next message (a replacement's catch-up) travels with `Open`
        and the two cost one round trip."""
        timeout = connection.options.request_timeout
        cache_token = secrets.token_hex(16) if cache_from is not None else None
        name = BlockRpc._get_handle_name(connection.prefix, "rpc_inference")
        try:
            reader, self._writer = await connection.streams.open(self.hop.peer_id, name, timeout)
        except Exception as error:
            raise StreamFailure(self.hop.peer_id, error) from error
        self._replies = asyncio.Queue()
        self._reading = asyncio.ensure_future(_read_replies(reader, self._replies))
        info = connection.roster.known.get(self.hop.peer_id)
        self.step_frames = connection.options.step_frames and info is not None and info.step_frames
        open_message = Open(
            session_id=self.session_id,
            max_length=self.shape.max_length,
            batch_size=self.shape.batch_size,
            start=self.hop.start,
            end=self.hop.end,
            swarm_proof=connection.swarm_proof(self.hop.peer_id),
            adapter=connection.options.active_adapter or "",
            cache_token=cache_token or "",
            cache_from=cache_from or "",
        )
        await self._send(encode(open_message), timeout)
        self.healthy = True
        if answered_later:
            self._opened_by = asyncio.get_running_loop().time() + timeout
        else:
            await self._receive(timeout, Opened)
        return cache_token

    async def hand_off(
        self, target: ServerStream, token: str, max_seconds: float, timeout: float
    ) -> HandedOff:
        """Ask this server to push the accepted part of its cache to `target` (opened with this
        server as `cache_from` and `token`); once done, `target` continues the session with this
        stream's history (what a later failover of `target` replays)."""
        order = self._hand_off_order(target, token, max_seconds, self.length, follow=False)
        await self._send(encode(order), timeout)
        return await self.handed_off(order, target, timeout)

    async def follow(
        self, target: ServerStream, token: str, max_seconds: float, length: int, timeout: float
    ) -> HandOff:
        """Ask this server to push to `target` the cache of positions `[0, length)` as the next step
        computes them (`HandOff.follow`); send that step next, then await `handed_off`."""
        order = self._hand_off_order(target, token, max_seconds, length, follow=True)
        await self._send(encode(order), timeout)
        return order

    async def handed_off(self, order: HandOff, target: ServerStream, timeout: float) -> HandedOff:
        """The server's answer to `order` (after the step's, for a following one)."""
        reply = await self._receive(timeout + order.max_seconds, HandedOff)
        if (
            reply.handoff_id != order.handoff_id
            or reply.length != order.length
            or order.length != self.length
        ):
            raise StreamFailure(self.hop.peer_id, f"the server answered hand-off {reply.handoff_id}")
        target.history, target.length = list(self.history), self.length
        return reply

    def _hand_off_order(
        self, target: ServerStream, token: str, max_seconds: float, length: int, follow: bool
    ) -> HandOff:
        self.steps_sent += 1
        return HandOff(
            handoff_id=f"handoff#{self.steps_sent}",
            target_peer=target.hop.peer_id,
            target_session=target.session_id,
            token=token,
            length=length,
            max_seconds=max_seconds,
            follow=follow,
        )

    async def _send(self, request, timeout: float) -> None:
        if self._writer is None:
            raise StreamFailure(self.hop.peer_id, "the stream is closed")
        try:
            await send_message(request, self._writer, timeout)
        except Exception as error:  # the daemon's socket is gone, or the server stopped reading
            self.healthy = False
            said = await self._last_words()
            raise (said or StreamFailure(self.hop.peer_id, error)) from error

    async def _last_words(self) -> RemoteError | None:
        """The error a server sent before closing the stream (e.g. "session expired"), if any."""
        try:
            reply = await asyncio.wait_for(self._replies.get(), LAST_WORDS_TIMEOUT)
            message = parse(reply[0].metadata, Error)
        except Exception:
            return None
        return RemoteError(message.code, message.message, self.hop.peer_id)

    def chain_link(
        self, predecessor: ServerStream | None, successor: ServerStream | None
    ) -> ChainLink | None:
        """What tells the server whom it accepts pushed steps from and where it pushes its outputs
        (chain sessions); None when the server already holds it."""
        link = ChainLink(
            accept_token=self.push_token if predecessor is not None else "",
            accept_from=predecessor.hop.peer_id if predecessor is not None else "",
            next_peer=successor.hop.peer_id if successor is not None else "",
            next_session=successor.session_id if successor is not None else "",
            next_token=successor.push_token if successor is not None else "",
            # a server that takes no frames itself predates the field
            next_frames=self.step_frames and successor is not None and successor.step_frames,
        )
        return None if link == (self.linked or ChainLink()) else link  # never linked: the empty link

    async def link(self, link: ChainLink, timeout: float) -> None:
        """Send `link` (from `chain_link`); no reply comes."""
        await self._send(encode(link), timeout)
        self.linked = link

    async def step(
        self,
        step: StepInput,
        timeout: float,
        last_only: bool = False,
        step_id: str | None = None,
        push_hops: int = 0,
        copy_after: float | None = None,
    ) -> torch.Tensor:
        """Run `step` on the server; its output (only the last position's with `last_only`).
        `step_id` and `push_hops`: a chain step's id, the same on every server of the chain, and how
        many hops on the server pushes its output (chain sessions). `copy_after`: the step's input
        comes pushed by the predecessor; send the client's copy only if no answer came within this
        many seconds (None: send it at once)."""
        hidden, position = step.hidden, step.position
        tensors = [hidden] if step.padding_mask is None else [hidden, step.padding_mask]
        # unique on the stream: the server answers a repeated id from its last result (a retry), and
        # after a rewind the same position and length may legitimately come again with other tokens
        self.steps_sent += 1
        step_id = step_id or f"{position}+{hidden.shape[1]}#{self.steps_sent}"
        hypo_ids = list(step.hypo_ids) if step.hypo_ids is not None else None
        prompts = step.prompts_for(self.hop.start, self.hop.end)
        if prompts is not None:
            tensors.append(prompts)
        message = Step(
            step_id=step_id,
            position=position,
            hypo_ids=hypo_ids,
            prompts=prompts is not None,
            last_only=last_only,
            push_hops=push_hops,
        )
        answered = None
        if copy_after is not None:
            # the server's answer to a push within `copy_after` seconds, else none: send the copy
            answered = await self._receive(copy_after, StepDone, True, step_id, quiet_timeout=True)
        if answered is None:
            framed = self.step_frames and framable(message, tensors)
            await self._send(encode_frame(message, tensors) if framed else encode(message, tensors), timeout)
        reply, outputs = answered or await self._receive(
            timeout, StepDone, with_tensors=True, step_id=step_id
        )
        self._check_answer(
            output_problem(reply.step_id, step_id, outputs, hidden[:, -1:] if last_only else hidden)
        )
        if reply.pushed:
            if reply.input_digest != step_digest(hidden, step.padding_mask, step.hypo_ids):
                raise PushMismatch(self.hop.peer_id)
            self.pushed_answers += 1
        self.leaving = reply.leaving
        self.history.append(step)
        self.length = step.end
        return outputs[0]

    async def replay(
        self, group: list[StepInput], payload: tuple[list[torch.Tensor], bool, bool], timeout: float
    ) -> list[torch.Tensor]:
        """Recorded steps in one `Replay` message; `payload` is `client.replay.replay_tensors(group)`.
        Returns each step's output."""
        tensors, masked, reordered = payload
        self.steps_sent += 1
        replay_id = f"replay#{self.steps_sent}"
        message = Replay(replay_id=replay_id, masked=masked, reordered=reordered)
        await self._send(encode(message, tensors), timeout)
        reply, outputs = await self._receive(timeout, Replayed, with_tensors=True)
        problem = output_problem(reply.replay_id, replay_id, outputs, tensors[1])
        if problem is None and reply.steps != len(group):
            problem = f"{reply.steps} steps replayed of {len(group)}"
        self._check_answer(problem)
        self.history.extend(group)
        self.length = group[-1].end
        return list(outputs[0].split([sent.hidden.shape[1] for sent in group], dim=1))

    def _check_answer(self, problem: str | None) -> None:
        """A wrong answer is this server's fault: blamed here, never the next server it would reach."""
        if problem is not None:
            self.healthy = False
            raise StreamFailure(
                self.hop.peer_id,
                f"the server answered {problem}",
                wrong_output=True,
                blocks=(self.hop.start, self.hop.end),
            )

    @property
    def replies_waiting(self) -> int:
        """Replies received and not read yet (a server's unasked answers among them)."""
        return self._replies.qsize() if self._replies is not None else 0

    @property
    def position(self) -> int:
        """Positions of the server's cache that hold accepted work: where its next step may start at
        the latest (a step may also start earlier, overwriting)."""
        return self.length

    def rewind(self, position: int) -> None:
        """The session continues from `position`: what the server computed at `>= position` is
        rejected. The server learns it from the next step's position (nothing is sent now); the
        history forgets the steps that start at `>= position`, and keeps a step that straddles it
        whole, so a replay recomputes exactly the cache the server had, positions `< position` included.
        A step that straddles it by more than a sliding-window block's ring lets a step rewind
        (`REWIND_RESERVE`) is cut at `position` instead: replayed whole, it would leave a ring
        without the keys the next step needs.
        """
        if position < 0:
            raise ValueError(f"cannot rewind to a negative position ({position})")
        self.history = [_cut(sent, position) for sent in self.history if sent.position < position]
        self.length = min(self.length, position)  # a replica that lags behind keeps its own length

    async def _receive(
        self,
        timeout: float,
        expected: type,
        with_tensors: bool = False,
        step_id: str | None = None,
        quiet_timeout: bool = False,
    ):
        """The server's next reply, as `expected`. A step's answer that the server sent on its own
        (it ran the step from a push) and that is not the answer to `step_id` is dropped: it belongs
        to a chain step the client abandoned (run again after a failure or a mismatch). With
        `quiet_timeout`, None when nothing came within `timeout` (the stream stays healthy)."""
        if self._replies is None:
            raise StreamFailure(self.hop.peer_id, "the stream is closed")
        if self._opened_by is not None:  # the server's answer to `Open` comes first
            opened_by, self._opened_by = self._opened_by, None
            await self._receive(max(opened_by - asyncio.get_running_loop().time(), timeout), Opened)
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            try:
                if self._replies.empty():  # `asyncio.timeout` bounds the wait without a task of its own
                    async with asyncio.timeout_at(deadline):
                        reply = await self._replies.get()
                else:
                    reply = self._replies.get_nowait()
            except TimeoutError as error:
                if quiet_timeout:
                    return None
                self.healthy = False
                raise StreamFailure(self.hop.peer_id, error) from error
            if not _stale(reply, step_id):
                break
        if not isinstance(reply, tuple):  # the stream ended (or broke) before a reply came
            self.healthy = False
            self._replies.put_nowait(reply)  # still over for whoever reads next
            cause = "the server closed the session" if reply is _CLOSED else reply
            raise StreamFailure(self.hop.peer_id, cause)
        return self._parse_reply(reply, expected, with_tensors)

    def _parse_reply(self, reply, expected: type, with_tensors: bool):
        response, failure = reply
        if failure is not None:  # the p2p layer's own error: the server's handler broke off
            self.healthy = False
            raise StreamFailure(self.hop.peer_id, f"the server's handler failed: {failure.message}")
        if isinstance(response, StepFrame):
            message, tensors = decode_frame(response, expected)
            return (message, tensors) if with_tensors else message
        message = parse(response.metadata, expected, Error)
        if isinstance(message, Error):
            self.healthy = False
            raise RemoteError(message.code, message.message, self.hop.peer_id)
        return (message, decode_tensors(response)) if with_tensors else message

    def close(self) -> None:
        """End our request stream (the server then frees the session) and let go of the stream."""
        self.healthy = False
        writer, self._writer = self._writer, None
        if self._reading is not None:
            self._reading.cancel()
        if writer is not None:
            _end_requests(writer)
            writer.close()

    async def close_and_wait(self, timeout: float) -> None:
        """Close, then wait (at most `timeout`) until the server ends its side: by then it has freed
        the session's cache, so a scheduler told right after can safely admit the next session."""
        writer, reading = self._writer, self._reading
        self.healthy = False
        self._writer = None
        if writer is None:
            return
        try:
            _end_requests(writer)
            if writer.can_write_eof():
                # a server whose handler already ended reads what still comes until our side ends:
                # end it now, or that server keeps the stream (and this wait) open for seconds
                writer.write_eof()
            await asyncio.wait_for(asyncio.shield(reading), timeout)
        except Exception:  # a server that is gone or slow to answer has nothing more to tell us
            pass
        finally:
            reading.cancel()
            writer.close()


_CLOSED = object()  # what `_read_replies` queues when the server ends its side


def _stale(reply, step_id: str | None) -> bool:
    """`reply` (as `_read_replies` queues it) is a server's unasked answer to a step other than
    `step_id` (see `ServerStream._receive`)."""
    if not isinstance(reply, tuple) or reply[1] is not None:
        return False
    if isinstance(reply[0], StepFrame):
        return pushed_answer_id(reply[0]) not in (None, step_id)
    return answers_another_step(reply[0], step_id)


async def _read_replies(reader: asyncio.StreamReader, replies: asyncio.Queue) -> None:
    """Queue every reply of the stream as `(response, p2p error)`, then `_CLOSED` (or what broke it)."""
    try:
        while True:
            replies.put_nowait(await receive_reply(reader))
    except asyncio.IncompleteReadError:
        replies.put_nowait(_CLOSED)
    except asyncio.CancelledError:
        raise
    except Exception as error:  # a reset daemon socket, a malformed frame
        replies.put_nowait(error)


def _end_requests(writer: asyncio.StreamWriter) -> None:
    """Write the protocol's end-of-stream marker (what hivemind sends after a stream's last request)."""
    if not writer.is_closing():
        with contextlib.suppress(Exception):
            writer.write(P2P.ERROR_MARKER + len(b"").to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER))


def catch_up_input(history: list[StepInput], position: int) -> StepInput | None:
    """One step that brings a cache holding positions `[0, position)` of this history up to the
    history's end (None: nothing is missing). Each recorded step counts up to where the next one
    starts: a later step that began inside it (after a rewind) overwrote the rest."""
    parts = []
    for index, sent in enumerate(history):
        valid_end = history[index + 1].position if index + 1 < len(history) else sent.end
        first = max(sent.position, position)
        if first < valid_end:
            parts.append(sent.hidden[:, first - sent.position : valid_end - sent.position])
    if not parts:
        return None
    return StepInput(torch.cat(parts, dim=1), position, history[-1].padding_mask)


def output_problem(
    step_id: str, expected_id: str, outputs: list[torch.Tensor], sent: torch.Tensor
) -> str | None:
    """What is wrong with a server's answer to a step (None: nothing we can see without a replica)."""
    if step_id != expected_id:
        return f"step {step_id!r} to step {expected_id!r}"
    if len(outputs) != 1:
        return f"{len(outputs)} tensors instead of 1"
    output = outputs[0]
    if output.shape != sent.shape or output.dtype != sent.dtype:
        return f"a {output.dtype} tensor of shape {tuple(output.shape)} to a {sent.dtype} {tuple(sent.shape)}"
    if not all_finite(output):
        return "hidden states with NaN or infinity"
    return None


def _cut(step: StepInput, position: int) -> StepInput:
    """`step`, or its part before `position` where it reaches more than `REWIND_RESERVE` past it."""
    if step.end - position <= REWIND_RESERVE:
        return step
    mask = step.padding_mask[:, :position] if step.padding_mask is not None else None
    return replace(step, hidden=step.hidden[:, : position - step.position], padding_mask=mask)
