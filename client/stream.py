"""One server's part of an inference session: a bidirectional stream and the inputs sent on it."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import torch

from client.connection import SwarmConnection
from swarm.route_request import RouteHop, SessionShape
from swarm.wire import (
    Error,
    ErrorCode,
    Open,
    Opened,
    RemoteError,
    Replay,
    Replayed,
    Step,
    StepDone,
    decode_metadata,
    decode_tensors,
    encode,
    parse,
)

# errors that another server would answer the same way: our request is wrong, or not allowed here
FATAL_CODES = (ErrorCode.BAD_REQUEST, ErrorCode.UNAUTHORIZED)


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
    length: int = 0  # positions of the server's cache that hold accepted work (rewinds shorten it)
    steps_sent: int = 0  # numbers step ids: a step after a rewind may repeat an earlier position
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
            swarm_proof=connection.swarm_proof(self.hop.peer_id),
        )
        queue.put_nowait(encode(open_message))
        try:
            self._responses = await asyncio.wait_for(
                connection.stub(self.hop.peer_id).rpc_inference(requests()),
                connection.options.request_timeout,
            )
        except Exception as error:
            raise StreamFailure(self.hop.peer_id, error) from error
        await self._receive(connection.options.request_timeout, Opened)
        self.healthy = True

    async def step(self, step: StepInput, timeout: float) -> torch.Tensor:
        hidden, position = step.hidden, step.position
        tensors = [hidden] if step.padding_mask is None else [hidden, step.padding_mask]
        # unique on the stream: the server answers a repeated id from its last result (a retry), and
        # after a rewind the same position and length may legitimately come again with other tokens
        self.steps_sent += 1
        step_id = f"{position}+{hidden.shape[1]}#{self.steps_sent}"
        if self._queue is None:
            raise StreamFailure(self.hop.peer_id, "the stream is closed")
        hypo_ids = list(step.hypo_ids) if step.hypo_ids is not None else None
        prompts = step.prompts_for(self.hop.start, self.hop.end)
        if prompts is not None:
            tensors.append(prompts)
        message = Step(step_id=step_id, position=position, hypo_ids=hypo_ids, prompts=prompts is not None)
        self._queue.put_nowait(encode(message, tensors))
        reply, outputs = await self._receive(timeout, StepDone, with_tensors=True)
        problem = output_problem(reply.step_id, step_id, outputs, hidden)
        if problem is not None:  # this server's fault: blamed here, never the next server it would reach
            self.healthy = False
            raise StreamFailure(
                self.hop.peer_id,
                f"the server answered {problem}",
                wrong_output=True,
                blocks=(self.hop.start, self.hop.end),
            )
        self.history.append(step)
        self.length = step.end
        return outputs[0]

    async def replay(
        self, group: list[StepInput], payload: tuple[list[torch.Tensor], bool, bool], timeout: float
    ) -> list[torch.Tensor]:
        """Recorded steps in one `Replay` message; `payload` is `client.replay.replay_tensors(group)`.
        Returns each step's output."""
        if self._queue is None:
            raise StreamFailure(self.hop.peer_id, "the stream is closed")
        tensors, masked, reordered = payload
        self.steps_sent += 1
        replay_id = f"replay#{self.steps_sent}"
        message = Replay(replay_id=replay_id, masked=masked, reordered=reordered)
        self._queue.put_nowait(encode(message, tensors))
        reply, outputs = await self._receive(timeout, Replayed, with_tensors=True)
        problem = output_problem(reply.replay_id, replay_id, outputs, tensors[1])
        if problem is None and reply.steps != len(group):
            problem = f"{reply.steps} steps replayed of {len(group)}"
        if problem is not None:
            self.healthy = False
            raise StreamFailure(
                self.hop.peer_id,
                f"the server answered {problem}",
                wrong_output=True,
                blocks=(self.hop.start, self.hop.end),
            )
        self.history.extend(group)
        self.length = group[-1].end
        return list(outputs[0].split([sent.hidden.shape[1] for sent in group], dim=1))

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
        """
        if position < 0:
            raise ValueError(f"cannot rewind to a negative position ({position})")
        self.history = [sent for sent in self.history if sent.position < position]
        self.length = min(self.length, position)  # a replica that lags behind keeps its own length

    async def _receive(self, timeout: float, expected: type, with_tensors: bool = False):
        try:
            response = await asyncio.wait_for(anext(self._responses), timeout=timeout)
        except StopAsyncIteration:
            self.healthy = False
            raise StreamFailure(self.hop.peer_id, "the server closed the session") from None
        except Exception as error:  # timeouts, resets, a daemon gone: whatever the transport raises
            self.healthy = False
            raise StreamFailure(self.hop.peer_id, error) from error
        kind = decode_metadata(response.metadata).get("type")
        message = parse(response.metadata, Error if kind == "error" else expected)
        if isinstance(message, Error):
            self.healthy = False
            raise RemoteError(message.code, message.message, self.hop.peer_id)
        return (message, decode_tensors(response)) if with_tensors else message

    def close(self) -> None:
        self.healthy = False
        if self._queue is not None:
            self._queue.put_nowait(None)  # ends our request stream: the server frees the session
            self._queue = None

    async def close_and_wait(self, timeout: float) -> None:
        """Close, then wait (at most `timeout`) until the server ends its side: by then it has freed
        the session's cache, so a scheduler told right after can safely admit the next session."""
        responses = self._responses if self._queue is not None else None
        self.close()
        if responses is None:
            return
        try:
            await asyncio.wait_for(_drain(responses), timeout)
        except Exception:  # a server that is gone or slow to answer has nothing more to tell us
            pass


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


async def _drain(responses) -> None:
    async for _ in responses:
        pass


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
    if not bool(torch.isfinite(output).all()):
        return "hidden states with NaN or infinity"
    return None
