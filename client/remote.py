"""Hub-spoke inference sessions through a chain of swarm servers, with failover by replay.

The client sends hidden states to the first server, takes its output to the second, and so on,
keeping for every server the inputs it sent (the client-side cache). When a server fails, it is
banned for a while, a replacement chain is found for exactly the blocks it processed (possibly
several servers), the cached inputs are replayed to rebuild their attention caches, and the step
continues: the other servers of the chain never notice, and the output is what it would have been.

`RemoteBlockSession` also does, in this order in the class:

- replica verification: a fraction of each server's steps also runs on a replica holding the same
  blocks; a disagreement goes to a third server, and the outvoted one is banned;
- moves off a server that leaves (it drains on SIGTERM, or moves to another span): the cache is
  handed to a replacement server, or rebuilt there by replay, whichever is expected to be faster
  (client/handoff_cost.py); a failed hand-off falls back to a replay;
- sessions the scheduler routes: a WS-RR route, opened once admitted and checked against the
  server records, with the scheduler's lease kept alive; anything the client cannot trust or act on
  makes it route locally instead (docs/security.md, "A hostile scheduler");
- prefill and decode on different servers (HexGen-2, Splitwise, DistServe): per hop of the decode
  chain, a `--role prefill` server holding the hop's blocks takes the prompt where its prefill plus
  the cache's hand-off is expected to be shorter than the decode server's own prefill
  (`ClientOptions.disaggregate`); any failure falls back to the decode server computing the prompt.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence

import torch

from llm_swarm.client.admission import Admission
from llm_swarm.client.backend import BlockBackend, BlockSession, SessionStep
from llm_swarm.client.connection import SwarmConnection, SwarmUnavailable, run_sync
from llm_swarm.client.handoff_cost import MoveCosts, move_costs
from llm_swarm.client.replay import can_prefill, replay_groups, replay_tensors
from llm_swarm.client.routing import chain_problem
from llm_swarm.client.sequence_rpc import SequenceFunction
from llm_swarm.client.session_request import SessionRequest
from llm_swarm.client.stream import FATAL_CODES, PushMismatch, ServerStream, StepInput, catch_up_input
from llm_swarm.client.verification import VerifyPlan, agree, decide, relative_difference, tolerance
from llm_swarm.swarm.handoff_wire import HandOff
from llm_swarm.swarm.prefill_cost import (
    announced_rate,
    choose_prefill_server,
    hop_prefill_costs,
    prefill_seconds,
)
from llm_swarm.swarm.route_request import RouteHop, RouteRequest, SessionShape
from llm_swarm.swarm.server_info import ServerInfo
from llm_swarm.swarm.wire import ErrorCode, RemoteError

logger = logging.getLogger(__name__)

MOVE_RETRY = 5.0  # seconds a session stays on a leaving server after no replacement was found
ALWAYS_LIMIT = 600.0  # seconds a hand-off may take when the caller asked for one whatever it costs
MIN_PROMPT = 2  # a one-token prompt is a decode step: nothing to disaggregate


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


async def _replay_then_step(
    replica: ServerStream, history: list[StepInput], step: StepInput, timeout: float
) -> torch.Tensor:
    """Bring a replica's cache up to `position` with the inputs it has not seen (one prefill: close
    enough for verification's tolerance, and exact when it has seen every step; step by step when beam
    search reordered the sequences in between), then run the step."""
    missing = [sent for sent in history if sent.end > replica.position]
    if any(sent.hypo_ids is not None or sent.prompts is not None for sent in missing):
        for sent in missing:
            await replica.step(sent, timeout)
    elif (catch_up := catch_up_input(history, replica.position)) is not None:
        await replica.step(catch_up, timeout)
    return await replica.step(step, timeout)


def _seconds(value: float | None) -> str:
    return "unknown" if value is None else f"{value * 1e3:.0f} ms"


def failed_peer(streams: list[ServerStream]) -> str:
    """The first stream that did not finish opening or replaying is the one to blame."""
    for stream in streams:
        if not stream.healthy:
            return stream.hop.peer_id
    return streams[-1].hop.peer_id if streams else ""


def _plausible(reply) -> bool:
    """The numbers of a scheduler's route reply that the client acts on are usable."""
    return math.isfinite(reply.expected_wait) and reply.expected_wait >= 0 and 1.0 <= reply.lease <= 86400.0


async def _usable_reply(link, reply, refusal_note: str, session_id: str | None = None) -> bool:
    """Whether the client can act on the scheduler's route `reply` (None: no trusted scheduler
    answered). A refusal (`reply.error`) is logged as `refusal_note % error`; implausible numbers end
    the scheduler's session (`session_id`, by default the reply's own) and make `link` distrust it."""
    if reply is None or reply.error:
        if reply is not None:
            logger.info(refusal_note, reply.error)
        return False
    if not _plausible(reply):
        await link.end_session(reply.session_id if session_id is None else session_id)
        link.distrust(f"answered a wait of {reply.expected_wait} s and a lease of {reply.lease} s")
        return False
    return True


class RemoteBlockSession(BlockSession):
    """A session over a chain of servers covering every block.

    With a scheduler, the chain is the scheduler's WS-RR route, opened once the scheduler admits
    the session (it waits there, not by retrying servers), kept alive with a lease and ended at
    close. Without one (or when it fails), the client routes locally. Failover is always local.
    """

    _prefill: dict[int, ServerStream]  # decode chain index -> the prefill stream that takes its prompt
    # the prompt's hand-offs, still crossing after its output was returned (`_prefill_step`)
    _handing: asyncio.Future | None = None

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
        self.chain_steps = 0  # numbers chain steps: one id per step on every server of the chain
        # (predecessor, successor) peer pairs whose pushes disagreed with the client's copy: unlinked
        self.unpushed: set[tuple[str, str]] = set()
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
        answered_later: bool = False,
    ) -> list[ServerStream]:
        """Route blocks `[start, end)` and open a stream on every server of the chain (`cache_from`:
        sessions that may receive their cache from that server, see `SessionMoves`; `plan_prefill`:
        open prefill servers for the prompt where that pays, see `DisaggregatedPrefill`; not `patient`:
        fail at once rather than wait for servers or room; `answered_later`: on a chain the client
        routed itself, return once every `Open` is sent, see `ServerStream.open`)."""
        # the scheduler routes by load, not by adapters: a session with an adapter routes itself
        scheduled = self.connection.scheduler is not None and self.connection.options.active_adapter is None
        if (start, end) == (0, self.connection.num_blocks) and scheduled:
            streams = await self._open_scheduled_chain(first=plan_prefill)
            if streams is not None:
                return streams
        # refusals are bounded like waiting for room: servers that keep saying no end the attempt
        deadline = time.monotonic() + (self.connection.options.wait_for_room if patient else 0.0)
        while True:
            chain = await self.connection.chains.route(
                start, end, self.shape, patient=patient, pushed=self.connection.options.chain_push
            )
            # a fresh id per stream: a replacement may land on a server already in this chain
            streams = [ServerStream(hop, uuid.uuid4().hex, self.shape) for hop in chain]
            chosen = self._choose_prefill(chain) if plan_prefill else {}
            try:
                plan = await self._open_with_prefill(chain, streams, chosen, cache_from, answered_later)
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
                    await self.connection.roster.servers(refresh=True)
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
        answered_later: bool = False,
    ) -> dict[int, ServerStream]:
        """Open every stream of the chain and the sessions on the prefill servers `chosen` for some of
        its hops, all at once: one round trip for the whole chain instead of one per hop. Returns the
        prefill streams that opened (`DisaggregatedPrefill._open_prefill`). A failed hop raises its
        error (the first in chain order) once every open has answered, the prefill streams closed;
        the caller closes `streams`. `cache_from`, `answered_later`: see `_open_chain`."""
        results = await asyncio.gather(
            self._open_prefill(chain, chosen),
            *(
                stream.open(self.connection, chosen.get(index, cache_from), answered_later)
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
        if self._prefill:  # the prompt goes to prefill servers first (below)
            return await self._prefill_step(step)
        return await self._chain_step(step)

    async def _chain_step(self, step: StepInput) -> torch.Tensor:
        """Through every hop in turn: each server's output is the next one's input. In a chain
        session each server also pushes its output straight to the next one (swarm/chain_wire.py),
        which runs the step from whichever copy comes first and answers at once; the client sends
        its own copy all the same (at once, or once `ClientOptions.push_copy_after` passed without
        an answer), and reads the answers in order."""
        timeout = self.connection.options.request_timeout
        failures = 0
        index = 0
        step_id = await self._next_chain_step()
        first_pushed = 1  # hops from here on get this step id pushed (not where it restarted)
        while index < len(self.streams):
            stream = self.streams[index]
            # deep prompts are the client's per hop: a step that carries them is not pushed
            push_hops = len(self.streams) - 1 - index if step_id and step.prompts is None else 0
            before = self.streams[index - 1] if index > 0 else None
            pushed_here = (  # the predecessor pushes this step here: the client's copy may wait
                step_id is not None
                and index >= first_pushed
                and step.prompts is None
                and before is not None
                and stream.linked is not None
                and stream.linked.accept_from == before.hop.peer_id
            )
            copy_after = self._copy_after(stream) if pushed_here else None
            try:
                if self.verify_plan.verify_now():
                    output = await self._verified_step(index, step, timeout, step_id, push_hops)
                else:
                    pushed_before, asked_at = stream.pushed_answers, time.monotonic()
                    output = await stream.step(
                        step, timeout, step_id=step_id, push_hops=push_hops, copy_after=copy_after
                    )
                    if pushed_here:
                        pushed = stream.pushed_answers > pushed_before
                        stream.push_copies.answered(time.monotonic() - asked_at, pushed)
            except PushMismatch as mismatch:
                logger.warning(
                    "session %s: %s; its predecessor %s pushes to it no more",
                    self.session_id[:8],
                    mismatch,
                    self.streams[index - 1].hop.peer_id[-8:],
                )
                self.unpushed.add((self.streams[index - 1].hop.peer_id, stream.hop.peer_id))
                step_id = await self._next_chain_step()  # the step again, from this hop on
                first_pushed = index + 1
                continue
            except SwarmUnavailable:
                raise  # e.g. two replicas disagree and none can decide: failing over would hide it
            except Exception as error:  # a server's error, or the connection broke or timed out
                if isinstance(error, RemoteError) and error.code in FATAL_CODES:
                    raise  # replaying it elsewhere would fail the same way
                failures = self._count_failure(failures, stream, error)
                output, placed, relinked = await self._replace_in_chain(index, step)
                if output is None:
                    step_id = await self._next_chain_step()  # the new servers' chain, a fresh id
                    first_pushed = index + 1
                    continue
                # the step rode on the catch-up, which pushed it on to the next hop
                step_id = relinked
                index += placed - 1
                first_pushed = index + 1
            step = dataclasses.replace(step, hidden=output)
            index += 1
        if any(stream.leaving for stream in self.streams):
            await self._move_leavers()  # this step's output is safe; the next one goes to the new server
        return step.hidden

    def _copy_after(self, stream: ServerStream) -> float | None:
        """Seconds the client's copy of a step pushed to `stream`'s server waits for its answer."""
        option = self.connection.options.push_copy_after
        return stream.push_copies.copy_after() if option == "auto" else option

    async def _next_chain_step(self) -> str | None:
        """The next chain step's id, every server told whom it takes pushes from and where it pushes
        them (what changed since the last step); None in a hub-spoke session
        (`ClientOptions.chain_push` off, or a chain of one server)."""
        if not self.connection.options.chain_push or len(self.streams) < 2:
            return None
        timeout = self.connection.options.request_timeout
        known = self.connection.roster.known

        def linked(first: ServerStream, second: ServerStream) -> bool:
            """Whether `first` pushes to `second`: both take part, and no push between them lied."""
            both = all(getattr(known.get(s.hop.peer_id), "chain_push", False) for s in (first, second))
            return both and (first.hop.peer_id, second.hop.peer_id) not in self.unpushed

        changed = []
        for index, stream in enumerate(self.streams):
            before = self.streams[index - 1] if index > 0 else None
            after = self.streams[index + 1] if index + 1 < len(self.streams) else None
            link = stream.chain_link(
                before if before is not None and linked(before, stream) else None,
                after if after is not None and linked(stream, after) else None,
            )
            if link is not None:
                changed.append(stream.link(link, timeout))
        if changed:  # most steps change nothing: no task to make
            # a link that cannot be sent means a broken stream: the step finds it and fails over
            await asyncio.gather(*changed, return_exceptions=True)
        self.chain_steps += 1
        return f"chain#{self.chain_steps}"

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

    async def _replace_in_chain(
        self, index: int, step: StepInput
    ) -> tuple[torch.Tensor | None, int, str | None]:
        """`_replace` for the chain's hop `index`, which failed `step`: the replacement goes into the
        chain. Returns the step's output if it rode on the catch-up (else None), the servers now in
        the failed one's place, and the chain step id it was pushed on with."""
        placed = [self.streams[index]]
        step_ids: list[str | None] = [None]

        async def relink(replacement: list[ServerStream]) -> tuple[str | None, int]:
            self.streams[index : index + len(placed)] = replacement
            placed[:] = replacement
            step_ids.append(await self._next_chain_step())
            return step_ids[-1], len(self.streams) - index - len(replacement) if step_ids[-1] else 0

        replacement, output = await self._replace(placed[0], step, relink)
        self.streams[index : index + len(placed)] = replacement
        return output, len(replacement), step_ids[-1]

    async def _replace(
        self,
        failed: ServerStream,
        pending: StepInput | None = None,
        relink: Callable[[list[ServerStream]], Awaitable[tuple[str | None, int]]] | None = None,
    ) -> tuple[list[ServerStream], torch.Tensor | None]:
        """New servers for exactly the failed server's blocks, caches rebuilt from its inputs: one
        round trip per replacement server (`ClientOptions.replay_mode`, client/replay.py), the
        catch-up sent right behind the `Open` (answered together). `pending`: the step the failed
        server did not answer; a one-token step right after its history rides on a one-prefill
        catch-up, and its output is returned with the streams (None: it still has to run).
        `relink(replacement)`: puts the replacement into the chain before that catch-up and returns
        the chain step's id and the hops its last server pushes the step on (chain sessions)."""
        failed.close()
        started = asyncio.get_running_loop().time()
        timeout = self.connection.options.request_timeout
        riding = (
            pending is not None
            and pending.position == failed.position
            and pending.hidden.shape[1] == 1
            and self.connection.options.replay_mode == "prefill"
            and can_prefill([*failed.history, pending])
        )
        while True:
            replacement = await self._open_chain(failed.hop.start, failed.hop.end, answered_later=True)
            output = None
            try:
                if riding:
                    hop_inputs = [*failed.history, pending]
                    for stream in replacement[:-1]:  # each server's outputs: the next one's inputs
                        hop_inputs = await self._catch_up(stream, hop_inputs, last=False)
                    # the last server answers the last position only: the pending step's output
                    step_id, push_hops = await relink(replacement) if relink is not None else (None, 0)
                    output = await replacement[-1].step(
                        catch_up_input(hop_inputs, 0),
                        timeout,
                        last_only=True,
                        step_id=step_id,
                        push_hops=push_hops,
                    )
                else:
                    hop_inputs = failed.history
                    for index, stream in enumerate(replacement):
                        hop_inputs = await self._catch_up(
                            stream, hop_inputs, last=index == len(replacement) - 1
                        )
                    for stream in replacement:  # a step kept whole across a rewind replays past it
                        stream.rewind(failed.position)
            except Exception as error:
                for stream in replacement:
                    stream.close()
                if isinstance(error, RemoteError) and error.code in FATAL_CODES:
                    raise
                if isinstance(error, RemoteError) and error.code == ErrorCode.NO_CACHE_ROOM:
                    self.connection.refused(error.peer, error.message)  # its record was stale
                else:
                    self.connection.blame(getattr(error, "peer", "") or failed_peer(replacement), error)
                continue
            elapsed = asyncio.get_running_loop().time() - started
            logger.info(
                "session %s: replaced %s for blocks %d:%d with %d server(s), %s-replayed %d steps%s "
                "in %.0f ms",
                self.session_id[:8],
                failed.hop.peer_id[-8:],
                failed.hop.start,
                failed.hop.end,
                len(replacement),
                self.connection.options.replay_mode,
                len(failed.history),
                " and the failed step" if riding else "",
                elapsed * 1e3,
            )
            return replacement, output

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

    async def _verified_step(
        self, index: int, step: StepInput, timeout: float, step_id: str | None = None, push_hops: int = 0
    ) -> torch.Tensor:
        """The step on the chain's server and, in parallel, on a replica holding the same blocks (its
        cache caught up from this hop's history); a disagreement goes to a third server. In a chain
        session the server may have run the step from its predecessor's push: its answer carries the
        digest of that input, which `ServerStream.step` checks against the client's copy, the copy
        the replica runs, so the replica checks the very input the server ran."""
        stream = self.streams[index]
        history = list(stream.history)  # what the replicas must have seen before this step
        verifier = await self._replica(stream, self.verifiers.get((stream.hop.start, stream.hop.end)))
        if verifier is None:
            return await stream.step(step, timeout, step_id=step_id, push_hops=push_hops)
        self.verifiers[(stream.hop.start, stream.hop.end)] = verifier
        checking = asyncio.ensure_future(_replay_then_step(verifier, history, step, timeout))
        try:
            output = await stream.step(step, timeout, step_id=step_id, push_hops=push_hops)
        except BaseException:
            checking.cancel()
            self._drop_verifier(verifier)  # cut off mid-step: its stream is of no use any more
            raise  # the chain's server failed: ordinary failover
        try:
            checked = await checking
        except Exception as error:  # the replica failed: no verdict this time, and a new replica next time
            self._drop_verifier(verifier, error)
            return output
        tol = self._tolerance(stream.hop.peer_id, verifier.hop.peer_id)
        if tol is None:  # no replica of a kind that can check this one (`tolerance`)
            self.connection.unverifiable_steps += 1
            return output
        if agree(output, checked, tol):
            self.connection.verified_steps += 1
            return output
        return await self._arbitrate(index, verifier, history, output, checked, step, tol)

    async def _arbitrate(
        self,
        index: int,
        verifier: ServerStream,
        history: list,
        output: torch.Tensor,
        checked: torch.Tensor,
        step: StepInput,
        tol: float,
    ) -> torch.Tensor:
        """Two replicas disagree: a third server holding the blocks decides; the outvoted one is banned
        for long and the step continues with the majority's output."""
        stream, timeout = self.streams[index], self.connection.options.request_timeout
        primary, second = stream.hop.peer_id, verifier.hop.peer_id
        difference = relative_difference(output, checked)
        blocks = f"{stream.hop.start}:{stream.hop.end}"
        arbiter = await self._replica(stream, None, exclude={primary, second})
        if arbiter is None:
            raise SwarmUnavailable(
                f"servers {primary} and {second} disagree on blocks {blocks} (relative difference "
                f"{difference:.3g}, tolerance {tol:.3g}) and no third server holds them to decide"
            )
        third = await _replay_then_step(arbiter, history, step, timeout)
        tol = self._tolerance(primary, second, arbiter.hop.peer_id)
        if tol is None:  # the arbiter's kind cannot judge these two: no verdict, nobody banned
            arbiter.close()
            logger.warning(
                "servers %s and %s disagree on blocks %s (relative difference %.3g) and the only third "
                "server computes in a kind that cannot judge them: step not verified",
                primary, second, blocks, difference,
            )  # fmt: skip
            self.connection.unverifiable_steps += 1
            return output
        verdict = decide({primary: output, second: checked, arbiter.hop.peer_id: third}, tol)
        if verdict.liar is None:
            arbiter.close()
            raise SwarmUnavailable(
                f"servers {primary}, {second} and {arbiter.hop.peer_id} all disagree on blocks {blocks}"
            )
        self.connection.ban_liar(
            verdict.liar,
            (stream.hop.start, stream.hop.end),
            "outvoted",
            difference if verdict.liar != arbiter.hop.peer_id else relative_difference(third, output),
        )
        if self.caught_at_step is None:
            self.caught_at_step = self.steps_done + 1
        logger.warning(
            "server %s returned wrong outputs for blocks %s (relative difference %.3g, tolerance %.3g; two "
            "replicas agree): banned for %.0f s",
            verdict.liar,
            blocks,
            difference,
            tol,
            self.connection.options.liar_ban,
        )
        key = (stream.hop.start, stream.hop.end)
        if verdict.liar == primary:  # the replica takes its place: it has every input of this hop
            stream.close()
            self.streams[index], self.verifiers[key] = verifier, arbiter
            return checked
        if verdict.liar == second:
            verifier.close()
            self.verifiers[key] = arbiter
            return output
        arbiter.close()  # the arbiter itself was outvoted (its own cache is suspect)
        return output

    async def _replica(
        self, stream: ServerStream, current: ServerStream | None, exclude: set[str] = frozenset()
    ) -> ServerStream | None:
        """A server other than the chain's holding the stream's blocks, with an open stream (the
        current replica while it is healthy); None when there is none. A non-empty `exclude` asks
        for an arbiter, which is worth a fresh read of the roster: without one the step fails."""
        if (
            current is not None
            and current.healthy
            and not self.connection.bans.is_banned(current.hop.peer_id)
        ):
            return current
        skip = {stream.hop.peer_id, *exclude}
        replica = await self._open_replica(stream, skip)
        # the first read returned as soon as every block had a server: the rest may name a replica
        if replica is None and await self.connection.roster.finish_first_read():
            replica = await self._open_replica(stream, skip)
        if replica is None and exclude:  # an arbiter may have joined since the last read
            await self.connection.roster.servers(refresh=True)
            replica = await self._open_replica(stream, skip)
        if replica is None and not exclude:  # (without an arbiter the caller fails the step instead)
            logger.info(
                "no replica holds blocks %d:%d besides %s: step not verified",
                stream.hop.start, stream.hop.end, stream.hop.peer_id[-8:],
            )  # fmt: skip
        return replica

    async def _open_replica(self, stream: ServerStream, skip: set[str]) -> ServerStream | None:
        """An open stream to the best known server holding the stream's blocks, not in `skip`."""
        start, end = stream.hop.start, stream.hop.end
        kind = self._kind(stream.hop.peer_id)
        # a replica of the chain server's own kind first: it can check it tightly (`tolerance`)
        candidates = sorted(
            (
                c
                for c in await self.connection.chains.candidates(blocks=(start, end))
                if c.peer_id not in skip
            ),
            key=lambda candidate: (candidate.info.dtype != kind, candidate.rtt),
        )
        for candidate in candidates:
            info = candidate.info
            if not (info.has_blocks and info.start <= start and end <= info.end):
                continue
            replica = ServerStream(RouteHop(candidate.peer_id, start, end), uuid.uuid4().hex, self.shape)
            try:
                await replica.open(self.connection)
                return replica
            except Exception as error:
                replica.close()
                if isinstance(error, RemoteError) and error.code in FATAL_CODES:
                    raise
                logger.info(
                    "replica %s for blocks %d:%d unavailable: %s", candidate.peer_id[-8:], start, end, error
                )
        return None

    def _drop_verifier(self, verifier: ServerStream, error: BaseException | None = None) -> None:
        verifier.close()
        self.verifiers.pop((verifier.hop.start, verifier.hop.end), None)
        if error is not None:
            self.connection.blame(verifier.hop.peer_id, error)

    def _kind(self, peer: str) -> str:
        server = self.connection.roster.known.get(peer)
        return server.dtype if server is not None else ""

    def _tolerance(self, *peers: str) -> float | None:
        return tolerance(self._kind(peer) for peer in peers)

    async def _move_leavers(self) -> None:
        """Every stream whose server said it is leaving goes to a replacement now, between steps."""
        index = 0
        while index < len(self.streams):
            stream = self.streams[index]
            if not (stream.leaving and stream.healthy) or time.monotonic() < stream.stay_until:
                index += 1
                continue
            try:
                replacement = await self._move_off(stream)
            except Exception as error:  # it stays there while it serves; a failover follows if it stops
                stream.stay_until = time.monotonic() + MOVE_RETRY
                logger.info(
                    "session %s: no move off leaving %s now (%s): staying, trying again in %.0f s",
                    self.session_id[:8],
                    stream.hop.peer_id[-8:],
                    error,
                    MOVE_RETRY,
                )
                index += 1
                continue
            self.streams[index : index + 1] = replacement
            index += len(replacement)

    async def _move_off(self, leaving: ServerStream) -> list[ServerStream]:
        loop = asyncio.get_running_loop()
        started = loop.time()
        hop = leaving.hop
        source = self.connection.roster.known.get(hop.peer_id)  # its record may go once it is OFFLINE
        self.connection.ban(hop.peer_id)  # it refuses new sessions: route around it, even on stale records
        # only worth it now: where no server has room at once, the session stays a while (patient=False)
        replacement = await self._open_chain(hop.start, hop.end, cache_from=hop.peer_id, patient=False)
        how, costs = "replay", None
        policy = self.connection.options.handoff
        if len(replacement) == 1 and leaving.length > 0 and leaving.history and policy != "never":
            target = replacement[0]
            costs = self._move_costs(leaving, target, source)
            if policy == "always" or costs is None or costs.try_handoff:
                timeout = self.connection.options.request_timeout
                auto = policy == "auto" and costs is not None
                allowed = costs.replay_seconds if auto else ALWAYS_LIMIT
                try:
                    reply = await leaving.hand_off(target, target.cache_token, allowed, timeout)
                    rate = reply.bytes / max(reply.seconds, 1e-6)
                    self.connection.link_rates[(hop.peer_id, target.hop.peer_id)] = rate
                    how = "hand-off"
                except Exception as error:
                    logger.info("session %s: hand-off not done (%s): replaying", self.session_id[:8], error)
        if how == "replay":
            try:
                hop_inputs = leaving.history
                for index, stream in enumerate(replacement):
                    hop_inputs = await self._catch_up(stream, hop_inputs, last=index == len(replacement) - 1)
                for stream in replacement:
                    stream.rewind(leaving.position)
            except Exception as error:
                logger.info("session %s: replay after a leave failed (%s)", self.session_id[:8], error)
                for stream in replacement:
                    stream.close()
                return (await self._replace(leaving))[0]
        leaving.close()
        logger.info(
            "session %s: moved blocks %d:%d off leaving %s to %s by %s in %.0f ms (%d positions; "
            "estimated replay %s, hand-off %s)",
            self.session_id[:8],
            hop.start,
            hop.end,
            hop.peer_id[-8:],
            ", ".join(stream.hop.peer_id[-8:] for stream in replacement),
            how,
            (loop.time() - started) * 1e3,
            leaving.length,
            _seconds(costs.replay_seconds if costs else None),
            _seconds(costs.handoff_seconds if costs else None),
        )
        return replacement

    def _move_costs(
        self, leaving: ServerStream, target: ServerStream, source: ServerInfo | None
    ) -> MoveCosts | None:
        """None: the target's record is missing: try the hand-off. Without the leaving server's
        record, its cache is assumed as large per token as the target's (same model)."""
        connection = self.connection
        servers, rtts = connection.roster.known, connection.probes.measured()
        source_peer, target_peer = leaving.hop.peer_id, target.hop.peer_id
        if target_peer not in servers:
            return None
        return move_costs(
            tokens=leaving.length,
            batch_size=self.shape.batch_size,
            hidden_size=leaving.history[0].hidden.shape[-1],
            blocks=leaving.hop.end - leaving.hop.start,
            kept_positions=connection.limits.cached_positions(
                leaving.hop.start, leaving.hop.end, leaving.length
            ),
            source=source if source is not None else servers[target_peer],
            target=servers[target_peer],
            rtt_source=rtts.get(source_peer, 0.0),
            rtt_target=rtts.get(target_peer, 0.0),
            uplink_bytes_per_s=connection.options.uplink_mbps * 1e6 / 8,
            link_bytes_per_s=connection.link_rates.get((source_peer, target_peer)),
        )

    async def _open_scheduled_chain(self, first: bool = False) -> list[ServerStream] | None:
        """The scheduler's route, opened once admitted; None: route locally instead. `first`: the
        session's first chain, whose route an SLO miss stops (`ClientOptions.accept_slo_miss`)."""
        link, options = self.connection.scheduler, self.connection.options
        candidates = await self.connection.chains.candidates()
        rtts = {candidate.peer_id: candidate.rtt for candidate in candidates}
        request = RouteRequest(
            self.connection.client_id, rtts, self.shape, options.task_label or "", options.chain_push
        )
        reply = await link.route(request)
        if not await _usable_reply(link, reply, "the scheduler has no route (%s): routing locally"):
            return None
        if reply.slo_miss and first:
            if not options.accept_slo_miss:
                await link.end_session(reply.session_id)
                raise SwarmUnavailable(
                    f"the scheduler expects this session to miss its latency targets: {reply.slo_reason} "
                    f"(expected wait {reply.expected_wait:.1f} s; ClientOptions(accept_slo_miss=True) waits)"
                )
            logger.warning(
                "session %s: %s; waiting anyway (accept_slo_miss)", self.session_id[:8], reply.slo_reason
            )
        admission = Admission(reply.session_id, time.monotonic(), reply.expected_wait)
        self.admission = admission
        if not reply.admitted:
            logger.info(
                "session %s waits for cache room: expected %.1f s (WS-RR)",
                self.session_id[:8],
                reply.expected_wait,
            )
        while not reply.admitted:
            if time.monotonic() - admission.routed_at > options.wait_for_room:
                await link.end_session(reply.session_id)
                raise SwarmUnavailable(
                    f"the scheduler did not admit the session within {options.wait_for_room:.0f} s"
                )
            timeout = min(max(reply.expected_wait + 1.0, 1.0), 10.0)
            reply = await link.await_admission(admission.scheduler_session, timeout)
            if not await _usable_reply(
                link, reply, "scheduler: %s; routing locally", admission.scheduler_session
            ):
                return None
        admission.admitted_at = time.monotonic()
        hops = [RouteHop.from_proto(hop) for hop in reply.chain]
        # the records this client routed with back most chains; a fresh read of the DHT (4.25 round
        # trips on netem, BENCHMARKS.md) only when they do not: a server new to it, or one that moved
        servers = self.connection.roster.known
        problem = chain_problem(hops, servers, self.connection.num_blocks)
        if problem is not None:
            servers = await self.connection.roster.servers(refresh=True)
            problem = chain_problem(hops, servers, self.connection.num_blocks)
        if problem is not None:
            await link.end_session(admission.scheduler_session)
            link.distrust(f"routed through an impossible chain ({problem})")
            return None
        if not all(servers[hop.peer_id].role.serves("decode") for hop in hops):
            # a current scheduler never routes through one (an older one might): it takes no session
            await link.end_session(admission.scheduler_session)
            logger.info("the scheduler's route includes a prefill-only server: routing locally")
            return None
        streams = [ServerStream(hop, uuid.uuid4().hex, self.shape) for hop in hops]
        chosen: dict[int, str] = {}
        if first:  # the prompt phase: the scheduler's plan, or the client's own rule without one
            planned = [RouteHop.from_proto(hop) for hop in reply.prefill]
            chosen = (
                self._scheduled_choice(hops, planned) if reply.prefill_planned else self._choose_prefill(hops)
            )
        try:
            plan = await self._open_with_prefill(hops, streams, chosen)
        except Exception as error:
            for stream in streams:
                stream.close()
            await link.end_session(admission.scheduler_session)
            if isinstance(error, RemoteError) and error.code in FATAL_CODES:
                raise
            if isinstance(error, RemoteError) and error.code == ErrorCode.NO_CACHE_ROOM:
                self.connection.refused(error.peer, error.message)
                logger.warning("%s on the scheduler's route; routing locally", error)
            else:
                self.connection.blame(getattr(error, "peer", "") or failed_peer(streams), error)
            return None
        if first:
            self._adopt_prefill(plan, f"scheduler's plan: {'yes' if reply.prefill_planned else 'no'}")
        self._keep_alive = asyncio.ensure_future(self._renew_lease(admission.scheduler_session, reply.lease))
        logger.info(
            "session %s routed by the scheduler through %s (waited %.2f s, predicted %.2f s)",
            self.session_id[:8],
            " -> ".join(f"{s.hop.peer_id[-6:]}[{s.hop.start}:{s.hop.end}]" for s in streams),
            admission.admitted_at - admission.routed_at,
            admission.expected_wait,
        )
        return streams

    async def _renew_lease(self, scheduler_session: str, lease: float) -> None:
        while True:
            await asyncio.sleep(max(lease / 3, 0.5))
            await self.connection.scheduler.keep_alive(scheduler_session)

    def _scheduled_choice(self, chain: list[RouteHop], planned: Sequence[RouteHop]) -> dict[int, str]:
        """The scheduler's plan for the prompt (`RouteReply.prefill`: a prefill server per hop it
        chose); entries that name no known prefill server holding their hop's blocks are ignored
        (those hops prefill on their own server). `disaggregate="never"` keeps every prompt on its
        decode server; "always" uses the client's own rule."""
        policy = self.connection.options.disaggregate
        if policy == "never" or self.shape.l_in < MIN_PROMPT:
            return {}
        if policy == "always":
            return self._choose_prefill(chain)
        prefill_servers = self.connection.chains.routable_among(self.connection.roster.known, "prefill")
        index_of = {(hop.start, hop.end): index for index, hop in enumerate(chain)}
        chosen: dict[int, str] = {}
        ignored = []
        for hop in planned:
            info = prefill_servers.get(hop.peer_id)
            index = index_of.get((hop.start, hop.end))
            if index is None or info is None or not (info.start <= hop.start and hop.end <= info.end):
                ignored.append(hop)
                continue
            chosen[index] = hop.peer_id
        if ignored:  # one line, however many entries a faulty scheduler sends
            logger.info(
                "session %s: ignoring %d of the scheduler's %d prefill hops (e.g. %s)",
                self.session_id[:8],
                len(ignored),
                len(planned),
                ignored[0],
            )
        return chosen

    def _choose_prefill(self, chain: list[RouteHop]) -> dict[int, str]:
        """The client's own rule: per hop, the prefill server whose prefill plus hand-off beats the
        decode server's own prefill (`swarm.prefill_cost`), if any."""
        connection = self.connection
        policy = connection.options.disaggregate
        if policy == "never" or self.shape.l_in < MIN_PROMPT:
            return {}
        servers = connection.roster.known
        prefill_servers = connection.chains.routable_among(servers, "prefill")
        chosen: dict[int, str] = {}
        measured = connection.link_rates

        def link_rate(peer: str, info, decode_peer: str) -> float | None:
            return measured.get((peer, decode_peer)) or announced_rate(info, decode_peer)

        for index, hop in enumerate(chain):
            blocks = hop.end - hop.start
            costs = hop_prefill_costs(
                hop,
                prefill_servers,
                self.shape.l_in,
                self.shape.batch_size,
                link_rate,
                connection.limits.block_windows,
            )
            if not costs or hop.peer_id not in servers:
                continue
            colocated = prefill_seconds(servers[hop.peer_id], self.shape.l_in) * blocks
            peer = choose_prefill_server(costs, colocated, policy, spread=self.session_id)
            if peer is not None:
                chosen[index] = peer
        return chosen

    async def _open_prefill(self, chain: list[RouteHop], chosen: dict[int, str]) -> dict[int, ServerStream]:
        """Sessions on the chosen prefill servers for those hops' prompts, all opened at once (and at
        once with the decode chain: `RemoteBlockSession._open_with_prefill`); a server that will not
        take one leaves its hop to prefill on its decode server (opened to receive a cache that then
        never comes, it serves the session as any other)."""
        streams = {
            index: ServerStream(
                RouteHop(peer, chain[index].start, chain[index].end), uuid.uuid4().hex, self.shape
            )
            for index, peer in chosen.items()
        }
        results = await asyncio.gather(
            *(stream.open(self.connection) for stream in streams.values()), return_exceptions=True
        )
        plan: dict[int, ServerStream] = {}
        for (index, stream), result in zip(streams.items(), results, strict=True):
            if isinstance(result, Exception):  # that server will not take it: its decode server will
                stream.close()
                logger.info(
                    "session %s: no prefill on %s (%s)", self.session_id[:8], stream.hop.peer_id[-8:], result
                )
            elif isinstance(result, BaseException):
                for other in streams.values():
                    other.close()
                raise result
            else:
                plan[index] = stream
        return plan

    def _adopt_prefill(self, plan: dict[int, ServerStream], how: str) -> None:
        """The session's first chain is open: its prompt goes to `plan`'s prefill servers (`how` says
        who chose them, for the log)."""
        self._prefill = plan
        if plan:
            logger.info(
                "session %s: its prompt goes to prefill servers %s (%s)",
                self.session_id[:8],
                ", ".join(f"{s.hop.peer_id[-6:]}[{s.hop.start}:{s.hop.end}]" for s in plan.values()),
                how,
            )

    async def _handed_off(self) -> None:
        """Wait until the last prompt's hand-offs are done (the chain is then the decode servers);
        raises what a hand-off raised that no fallback could handle. Every later step, and the
        session's end, waits here first."""
        handing, self._handing = self._handing, None
        if handing is not None:
            await handing

    async def _prefill_step(self, step: StepInput):
        """The session's prompt through the prefill servers planned for it (the other hops as usual),
        then each prefill server's cache handed to its hop's decode server.

        The prompt's output (the first token's hidden states) returns as soon as the prefill servers
        computed it; the hand-offs finish in the background (`_handing`) while the client samples
        the first token, and the next step waits for them (`_handed_off`). So the first token does
        not wait for the last part of the cache to cross (Splitwise and DistServe answer the first
        token from the prefill instance too); the second one does, if it is not there yet.
        `ClientOptions.first_token_before_handoff = False` waits for the hand-offs here instead."""
        plan, self._prefill = self._prefill, {}
        if step.position != 0 or step.hidden.shape[1] < MIN_PROMPT:  # not a prompt: nothing to do
            for stream in plan.values():
                stream.close()
            return await self._chain_step(step)
        decode = {index: self.streams[index] for index in plan}
        for index, stream in plan.items():
            self.streams[index] = stream
        # each prefill server pushes its cache while the prompt runs (Splitwise's streaming): asked
        # before the step, it sends every chunk of the prompt's cache as soon as it is computed
        orders = {}
        for index, stream in plan.items():
            target = decode[index]
            info = self.connection.roster.known.get(stream.hop.peer_id)
            if info is None or not info.prefill_chunk:  # it predates streaming: a hand-off after the prompt
                continue
            try:
                allowed = self._handoff_allowed(stream, target, step.end)
                orders[index] = await stream.follow(
                    target, target.cache_token, allowed, step.end, self._timeout
                )
            except Exception as error:  # the step after it fails over this hop as any failed step does
                logger.info("session %s: no streamed hand-off (%s)", self.session_id[:8], error)
        try:
            output = await self._chain_step(step)
        except BaseException:
            for index, stream in plan.items():
                if self.streams[index] is stream:
                    self.streams[index] = decode[index]
                stream.close()
            raise
        self._handing = asyncio.ensure_future(self._finish_handoffs(plan, decode, orders))
        if not self.connection.options.first_token_before_handoff:
            await self._handed_off()
        return output

    async def _finish_handoffs(
        self, plan: dict[int, ServerStream], decode: dict[int, ServerStream], orders: dict[int, HandOff]
    ) -> None:
        """Each prefill server's cache to its hop's decode server (or the fallbacks); then the chain
        is the decode servers."""
        # every hop's cache crosses its own link at once: one hop's hand-off never waits for another's
        handed = [
            index for index, stream in enumerate(self.streams) if index in plan and stream is plan[index]
        ]
        results = await asyncio.gather(
            *(self._hand_prefill(self.streams[index], decode[index], orders.get(index)) for index in handed),
            return_exceptions=True,
        )
        by_hop = dict(zip(handed, results, strict=True))
        failure = next((result for result in results if isinstance(result, BaseException)), None)
        if failure is not None:  # only a fatal error gets here (others fell back to replay or failover)
            for result in results:
                for stream in result if not isinstance(result, BaseException) else ():
                    stream.close()
            raise failure
        chain: list[ServerStream] = []
        for index, stream in enumerate(self.streams):
            if index in by_hop:
                chain += by_hop[index]
            else:
                if index in decode:  # its prompt failed over elsewhere: the reserved decode session goes
                    decode[index].close()
                chain.append(stream)
        self.streams = chain

    @property
    def _timeout(self) -> float:
        return self.connection.options.request_timeout

    def _handoff_allowed(self, prefill: ServerStream, target: ServerStream, length: int) -> float:
        """How long a hand-off of `length` positions may take: the decode server's own prefill of them
        (what a replay costs instead), at least 0.5 s; the request timeout if it is unknown."""
        info = self.connection.roster.known.get(target.hop.peer_id)
        if info is None:
            return self._timeout
        return max(prefill_seconds(info, length) * (target.hop.end - target.hop.start), 0.5)

    async def _hand_prefill(
        self, prefill: ServerStream, target: ServerStream, order: HandOff | None
    ) -> list[ServerStream]:
        """`target` holding `prefill`'s cache: handed off (streamed during the prompt under `order`,
        else pushed now), else rebuilt by replay, else a failover."""
        timeout = self._timeout
        how = "hand-off" if order is None else "hand-off streamed during the prompt"
        try:
            if order is not None:
                reply = await prefill.handed_off(order, target, timeout)
            else:
                allowed = self._handoff_allowed(prefill, target, prefill.length)
                reply = await prefill.hand_off(target, target.cache_token, allowed, timeout)
            rate = reply.bytes / max(reply.seconds, 1e-6)
            self.connection.link_rates[(prefill.hop.peer_id, target.hop.peer_id)] = rate
        except Exception as error:
            how = f"replay ({error})"
            try:
                await self._catch_up(target, prefill.history, last=True)
            except Exception as replay_error:
                logger.info("session %s: replay of the prompt failed (%s)", self.session_id[:8], replay_error)
                target.close()
                prefill.close()
                return (await self._replace(prefill))[0]
        logger.info(
            "session %s: prompt of blocks %d:%d on prefill server %s, cache to %s by %s",
            self.session_id[:8],
            target.hop.start,
            target.hop.end,
            prefill.hop.peer_id[-8:],
            target.hop.peer_id[-8:],
            how,
        )
        prefill.close()
        return [target]


class RemoteBlocks(BlockBackend):
    """The swarm as a `BlockBackend`."""

    def __init__(self, connection: SwarmConnection):
        self.connection = connection

    def start_session(self, request: SessionRequest) -> RemoteBlockSession:
        return RemoteBlockSession(
            self.connection,
            request.batch_size,
            request.max_length,
            prompt_tokens=request.prompt_tokens,
            expected_new_tokens=request.expected_new_tokens,
        )

    def forward_sequence(
        self, hidden: torch.Tensor, padding_mask: torch.Tensor | None, prompts: torch.Tensor | None
    ) -> torch.Tensor:
        """Every block on whole sequences, differentiable (training through the swarm)."""
        return SequenceFunction.apply(
            hidden, prompts, padding_mask, self.connection, 0, self.connection.num_blocks
        )
