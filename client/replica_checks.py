"""Replica verification of a session's steps: a fraction of each server's steps also runs on a
replica holding the same blocks; a disagreement goes to a third server, and the outvoted one is banned.

`ReplicaChecks` is a part of `RemoteBlockSession` (client/remote.py): it uses the session's
`connection`, `streams`, `verifiers`, `shape` and step counters.
"""

from __future__ import annotations

import asyncio
import logging
import uuid

import torch

from client.connection import SwarmUnavailable
from client.stream import FATAL_CODES, ServerStream, StepInput, catch_up_input
from client.verification import agree, decide, relative_difference, tolerance
from swarm.route_request import RouteHop
from swarm.wire import RemoteError

logger = logging.getLogger(__name__)


class ReplicaChecks:
    """The verification half of `RemoteBlockSession` (see the module docstring)."""

    async def _verified_step(self, index: int, step: StepInput, timeout: float) -> torch.Tensor:
        """The step on the chain's server and, in parallel, on a replica holding the same blocks (its
        cache caught up from this hop's history); a disagreement goes to a third server."""
        stream = self.streams[index]
        history = list(stream.history)  # what the replicas must have seen before this step
        verifier = await self._replica(stream, self.verifiers.get((stream.hop.start, stream.hop.end)))
        if verifier is None:
            return await stream.step(step, timeout)
        self.verifiers[(stream.hop.start, stream.hop.end)] = verifier
        checking = asyncio.ensure_future(_replay_then_step(verifier, history, step, timeout))
        try:
            output = await stream.step(step, timeout)
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
        if current is not None and current.healthy and not self.connection.is_banned(current.hop.peer_id):
            return current
        skip = {stream.hop.peer_id, *exclude}
        replica = await self._open_replica(stream, skip)
        # the first read returned as soon as every block had a server: the rest may name a replica
        if replica is None and await self.connection.finish_first_read():
            replica = await self._open_replica(stream, skip)
        if replica is None and exclude:  # an arbiter may have joined since the last read
            await self.connection.servers(refresh=True)
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
            (c for c in await self.connection.candidates(blocks=(start, end)) if c.peer_id not in skip),
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
        server = self.connection.known_servers.get(peer)
        return server.dtype if server is not None else ""

    def _tolerance(self, *peers: str) -> float | None:
        return tolerance(self._kind(peer) for peer in peers)


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
