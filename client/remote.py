"""Hub-spoke inference sessions through a chain of swarm servers, with failover by replay.

The client sends hidden states to the first server, takes its output to the second, and so on,
keeping for every server the inputs it sent (the client-side cache). When a server fails, it is
banned for a while, a replacement chain is found for exactly the blocks it processed (possibly
several servers), the cached inputs are replayed to rebuild their attention caches, and the step
continues: the other servers of the chain never notice, and the output is what it would have been.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
import uuid

import torch

from client.backend import BlockBackend, BlockSession, SessionStep
from client.connection import SwarmConnection, SwarmUnavailable, run_sync
from client.prefill_roles import DisaggregatedPrefill
from client.replay import can_prefill, replay_groups, replay_tensors
from client.replica_checks import ReplicaChecks
from client.scheduled_chains import Admission, ScheduledChains, failed_peer
from client.sequence_rpc import SequenceFunction
from client.session_moves import SessionMoves
from client.stream import FATAL_CODES, ServerStream, StepInput, catch_up_input
from client.verification import VerifyPlan
from swarm.route_request import RouteHop, SessionShape
from swarm.wire import ErrorCode, RemoteError

logger = logging.getLogger(__name__)


def session_shape(
    batch_size: int,
    max_length: int,
    prompt_tokens: int | None,
    default_prompt_tokens: int,
    expected_new_tokens: int | None = None,
) -> SessionShape:
    """What routing is told about a session: its real prompt length when the caller knows it (else
    `default_prompt_tokens`), and as the tokens it will generate `expected_new_tokens` if given,
    else the rest of `max_length`. `generate()` sizes its own sessions as prompt + `max_new_tokens`,
    so there `l_out` is `max_new_tokens`."""
    l_in = min(max(prompt_tokens if prompt_tokens is not None else default_prompt_tokens, 1), max_length)
    l_out = max_length - l_in if expected_new_tokens is None else expected_new_tokens
    return SessionShape(batch_size, max_length, l_in=l_in, l_out=min(max(l_out, 1), max_length))


class RemoteBlockSession(ReplicaChecks, SessionMoves, ScheduledChains, DisaggregatedPrefill, BlockSession):
    """A session over a chain of servers covering every block.

    With a scheduler, the chain is the scheduler's WS-RR route, opened once the scheduler admits
    the session (it waits there, not by retrying servers), kept alive with a lease and ended at
    close. Without one (or when it fails), the client routes locally. Failover is always local.
    """

    def __init__(
        self,
        connection: SwarmConnection,
        batch_size: int,
        max_length: int,
        start: int = 0,
        end: int | None = None,
        prompt_tokens: int | None = None,
        expected_new_tokens: int | None = None,
    ):
        self.connection = connection
        self.start, self.end = start, connection.num_blocks if end is None else end  # the blocks it runs
        default_prompt = connection.options.expected_l_in
        self.shape = session_shape(batch_size, max_length, prompt_tokens, default_prompt, expected_new_tokens)
        self.session_id = uuid.uuid4().hex
        self.created_at = time.monotonic()
        self.first_step_done_at: float | None = None
        self.later_step_seconds: list[float] = []  # for TPOT, reported to the scheduler at the end
        self.admission: Admission | None = None
        self._keep_alive: asyncio.Future | None = None
        self.verify_plan = VerifyPlan(connection.options.verify_fraction)
        self.verifiers: dict[tuple[int, int], ServerStream] = {}  # a replica per hop's blocks, once needed
        self.steps_done = 0
        self.caught_at_step: int | None = None  # the first step at which a replica outvoted a server
        self._prefill = {}  # set by the first `_open_chain` where prefill servers take the prompt
        self.streams: list[ServerStream] = run_sync(self._open_chain(self.start, self.end, plan_prefill=True))

    async def _open_chain(
        self,
        start: int,
        end: int,
        cache_from: str | None = None,
        plan_prefill: bool = False,
        patient: bool = True,
    ) -> list[ServerStream]:
        """Route blocks `[start, end)` and open a stream on every server of the chain (`cache_from`:
        sessions that may receive their cache from that server, see `SessionMoves`; `plan_prefill`:
        open prefill servers for the prompt where that pays, see `DisaggregatedPrefill`; not `patient`:
        fail at once rather than wait for servers or room)."""
        # the scheduler routes by load, not by adapters: a session with an adapter routes itself
        scheduled = self.connection.scheduler is not None and self.connection.options.active_adapter is None
        if (start, end) == (0, self.connection.num_blocks) and scheduled:
            streams = await self._open_scheduled_chain(first=plan_prefill)
            if streams is not None:
                return streams
        # refusals are bounded like waiting for room: servers that keep saying no end the attempt
        deadline = time.monotonic() + (self.connection.options.wait_for_room if patient else 0.0)
        while True:
            chain = await self.connection.route(start, end, self.shape, patient=patient)
            # a fresh id per stream: a replacement may land on a server already in this chain
            streams = [ServerStream(hop, uuid.uuid4().hex, self.shape) for hop in chain]
            chosen = self._choose_prefill(chain) if plan_prefill else {}
            try:
                plan = await self._open_with_prefill(chain, streams, chosen, cache_from)
                logger.info(
                    "session %s blocks %d:%d routed through %s",
                    self.session_id[:8],
                    start,
                    end,
                    " -> ".join(f"{s.hop.peer_id[-6:]}[{s.hop.start}:{s.hop.end}]" for s in streams),
                )
                if plan_prefill:
                    self._adopt_prefill(plan, "client's rule")
                return streams
            except RemoteError as error:
                for stream in streams:
                    stream.close()
                if error.code in FATAL_CODES:
                    raise  # our own request is wrong (or not allowed): another server would refuse it too
                if error.code == ErrorCode.NO_CACHE_ROOM:
                    self.connection.refused(error.peer, error.message)
                    if time.monotonic() > deadline:
                        raise SwarmUnavailable(
                            f"servers of blocks {start}:{end} kept refusing sessions for "
                            f"{self.connection.options.wait_for_room:.0f} s; last: {error}"
                        ) from error
                    logger.info("%s; re-routing", error)  # the announced free memory was stale
                    await self.connection.servers(refresh=True)
                    await asyncio.sleep(0.2)
                else:
                    self.connection.blame(error.peer, error)
            except Exception as error:  # transport failures: blame the server and route around it
                for stream in streams:
                    stream.close()
                self.connection.blame(getattr(error, "peer", "") or failed_peer(streams), error)

    async def _open_with_prefill(
        self,
        chain: list[RouteHop],
        streams: list[ServerStream],
        chosen: dict[int, str],
        cache_from: str | None = None,
    ) -> dict[int, ServerStream]:
        """Open every stream of the chain and the sessions on the prefill servers `chosen` for some of
        its hops, all at once: one round trip for the whole chain instead of one per hop. Returns the
        prefill streams that opened (`DisaggregatedPrefill._open_prefill`). A failed hop raises its
        error (the first in chain order) once every open has answered, the prefill streams closed;
        the caller closes `streams`. `cache_from`: see `_open_chain`."""
        results = await asyncio.gather(
            self._open_prefill(chain, chosen),
            *(
                stream.open(self.connection, chosen.get(index, cache_from))
                for index, stream in enumerate(streams)
            ),
            return_exceptions=True,
        )
        plan, opened = results[0], results[1:]
        failure = next((result for result in opened if isinstance(result, BaseException)), None)
        if isinstance(plan, BaseException):
            failure = failure or plan
            plan = {}
        if failure is not None:
            for stream in plan.values():
                stream.close()
            raise failure
        for stream, token in zip(streams, opened, strict=True):
            stream.cache_token = token
        return plan

    def run_step(self, step: SessionStep) -> torch.Tensor:
        """`step.prompts`: deep prompts for this session's blocks (`[blocks, batch or 1, prefix, hidden]`)."""
        started = time.monotonic()
        device = step.hidden.device  # the client's modules may sit on a GPU; the wire and history are CPU
        sent = StepInput(
            step.hidden.cpu(),
            step.position,
            step.padding_mask.cpu() if step.padding_mask is not None else None,
            tuple(int(i) for i in step.hypo_ids) if step.hypo_ids is not None else None,
            step.prompts.detach().cpu() if step.prompts is not None else None,
            self.start,
        )
        output = run_sync(self._step(sent)).to(device)
        self.steps_done += 1
        if self.first_step_done_at is None:
            self.first_step_done_at = time.monotonic()
        else:
            self.later_step_seconds.append(time.monotonic() - started)
        return output

    async def _step(self, step: StepInput) -> torch.Tensor:
        await self._handed_off()  # the prompt's hand-offs, if any, are done before the next step
        if self._prefill:  # the prompt goes to prefill servers first (client/prefill_roles.py)
            return await self._prefill_step(step)
        return await self._chain_step(step)

    async def _chain_step(self, step: StepInput) -> torch.Tensor:
        """Through every hop in turn: each server's output is the next one's input."""
        timeout = self.connection.options.request_timeout
        failures = 0
        index = 0
        while index < len(self.streams):
            stream = self.streams[index]
            try:
                if self.verify_plan.verify_now():
                    output = await self._verified_step(index, step, timeout)
                else:
                    output = await stream.step(step, timeout)
            except RemoteError as error:
                if error.code in FATAL_CODES:
                    raise  # replaying it elsewhere would fail the same way
                failures = self._count_failure(failures, stream, error)
                self.streams[index : index + 1] = await self._replace(stream)
                continue
            except SwarmUnavailable:
                raise  # e.g. two replicas disagree and none can decide: failing over would hide it
            except Exception as error:  # the connection broke or timed out
                failures = self._count_failure(failures, stream, error)
                self.streams[index : index + 1] = await self._replace(stream)
                continue
            step = dataclasses.replace(step, hidden=output)
            index += 1
        if any(stream.leaving for stream in self.streams):
            await self._move_leavers()  # this step's output is safe; the next one goes to the new server
        return step.hidden

    def rewind(self, position: int) -> None:
        """Continue from `position`: every server of the chain (and every replica) will overwrite
        positions `>= position` with the next step, and the kept histories forget the rejected steps,
        so a failover replay rebuilds exactly the accepted cache."""
        if self._handing is not None:  # the chain is the decode servers once the hand-offs are done
            run_sync(self._handed_off())
        for stream in [*self.streams, *self.verifiers.values()]:
            stream.rewind(position)

    def _count_failure(self, failures: int, stream: ServerStream, error: BaseException) -> int:
        failures += 1
        if isinstance(error, RemoteError) and error.code == ErrorCode.SESSION_EXPIRED:
            # the server's idle or lifetime limit: no fault of its own; open a new session and replay
            logger.info(
                "session %s on %s expired (%s): replaying", self.session_id[:8], error.peer[-8:], error
            )
        else:
            self.connection.blame(stream.hop.peer_id, error)
        if failures > self.connection.options.max_failovers:
            raise SwarmUnavailable(
                f"blocks {stream.hop.start}:{stream.hop.end} failed {failures} times in one step; "
                f"last error: {error}"
            ) from error
        return failures

    async def _replace(self, failed: ServerStream) -> list[ServerStream]:
        """New servers for exactly the failed server's blocks, caches rebuilt from its inputs: one
        round trip per replacement server (`ClientOptions.replay_mode`, client/replay.py)."""
        failed.close()
        started = asyncio.get_running_loop().time()
        while True:
            replacement = await self._open_chain(failed.hop.start, failed.hop.end)
            try:
                hop_inputs = failed.history
                for index, stream in enumerate(replacement):  # each server's outputs: the next one's inputs
                    hop_inputs = await self._catch_up(stream, hop_inputs, last=index == len(replacement) - 1)
                for stream in replacement:  # a step kept whole across a rewind replays past it
                    stream.rewind(failed.position)
            except Exception as error:
                for stream in replacement:
                    stream.close()
                if isinstance(error, RemoteError) and error.code in FATAL_CODES:
                    raise
                self.connection.blame(getattr(error, "peer", "") or failed_peer(replacement), error)
                continue
            elapsed = asyncio.get_running_loop().time() - started
            logger.info(
                "session %s: replaced %s for blocks %d:%d with %d server(s), %s-replayed %d steps in %.0f ms",
                self.session_id[:8],
                failed.hop.peer_id[-8:],
                failed.hop.start,
                failed.hop.end,
                len(replacement),
                self.connection.options.replay_mode,
                len(failed.history),
                elapsed * 1e3,
            )
            return replacement

    async def _catch_up(self, stream: ServerStream, history: list[StepInput], last: bool) -> list[StepInput]:
        """Rebuild `stream`'s cache from `history` (its hop's inputs); returns what the stream
        computed, as the inputs of the next hop (none after the `last` server of a replacement)."""
        timeout = self.connection.options.request_timeout
        if not history:
            return []
        if self.connection.options.replay_mode == "prefill" and can_prefill(history):
            catch_up = catch_up_input(history, 0)
            output = await stream.step(catch_up, timeout, last_only=last)
            return [] if last else [dataclasses.replace(catch_up, hidden=output)]
        mode = self.connection.options.replay_mode
        groups = replay_groups(history, self.shape.max_length) if mode != "steps" else None
        if groups is None:  # asked for, or deep prompts or unusual masks: step by step, as before
            outputs = [dataclasses.replace(sent, hidden=await stream.step(sent, timeout)) for sent in history]
            return outputs
        outputs = []
        for group in groups:  # one message unless rewinds made the history longer than the session
            hidden = await stream.replay(group, replay_tensors(group), timeout)
            outputs += [dataclasses.replace(sent, hidden=h) for sent, h in zip(group, hidden, strict=True)]
        return outputs

    def close(self) -> None:
        if self._handing is not None:  # a session that ends at its first token: its hand-offs first
            with contextlib.suppress(Exception):
                run_sync(self._handed_off())
        streams, self.streams = (
            self.streams + list(self.verifiers.values()) + list(self._prefill.values()),
            [],
        )
        self._prefill = {}
        self.verifiers = {}
        if streams or self._keep_alive is not None:
            run_sync(self._close(streams))

    async def _close(self, streams: list[ServerStream]) -> None:
        """Close every stream and wait (briefly) until the servers freed the caches, then tell the
        scheduler: it may admit the next session onto this memory at once."""
        await asyncio.gather(*(stream.close_and_wait(timeout=2.0) for stream in streams))
        if self._keep_alive is not None:
            self._keep_alive.cancel()
            self._keep_alive = None
            ttft = self.first_step_done_at - self.created_at if self.first_step_done_at else 0.0
            steps = self.later_step_seconds
            tpot = sum(steps) / len(steps) if steps else 0.0
            with contextlib.suppress(Exception):
                await self.connection.scheduler.end_session(
                    self.admission.scheduler_session, ttft=ttft, tpot=tpot, tokens=len(steps)
                )


class RemoteBlocks(BlockBackend):
    """The swarm as a `BlockBackend`."""

    def __init__(self, connection: SwarmConnection):
        self.connection = connection

    def open_session(
        self,
        batch_size: int,
        max_length: int,
        prompt_tokens: int | None = None,
        expected_new_tokens: int | None = None,
    ) -> RemoteBlockSession:
        return RemoteBlockSession(
            self.connection,
            batch_size,
            max_length,
            prompt_tokens=prompt_tokens,
            expected_new_tokens=expected_new_tokens,
        )

    def run_sequence(
        self, hidden: torch.Tensor, padding_mask: torch.Tensor | None, prompts: torch.Tensor | None
    ) -> torch.Tensor:
        """Every block on whole sequences, differentiable (training through the swarm)."""
        return SequenceFunction.apply(
            hidden, prompts, padding_mask, self.connection, 0, self.connection.num_blocks
        )
