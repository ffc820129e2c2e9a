"""How a *managed* server (started without `--blocks`) gets its span and follows the scheduler.

It measures its speed on a probe block, announces itself without blocks, and takes its span from
`swarm-scheduler`; when no scheduler answers within `scheduler_timeout` it chooses a span
itself, PETALS-style (docs/reference.md 3.3), so the swarm never depends on the scheduler for liveness. While
serving it keeps asking the scheduler and moves when the placement changes: it stops accepting
sessions, drains the open ones, keeps the blocks both spans share and loads only the missing ones.

`SpanManager` makes these decisions for a `server.server.SwarmServer` it is given (the server loads,
serves, announces and moves; the manager decides where to) and owns the link to the scheduler.
"""

from __future__ import annotations

import asyncio
import logging
import math
from typing import TYPE_CHECKING

from llm_swarm.server.block_choice import BlockChoice, choose_blocks, petals_model_spec, served_spans
from llm_swarm.swarm.cost import dtype_bytes
from llm_swarm.swarm.dht_records import fetch_servers_async
from llm_swarm.swarm.scheduler_api.scheduler_pb2 import Assignment
from llm_swarm.swarm.scheduler_link import SchedulerLink

if TYPE_CHECKING:
    from llm_swarm.server.server import SwarmServer

logger = logging.getLogger(__name__)


class SpanManager:
    """A managed server's span: wait for the scheduler's (or choose one), then follow the placement."""

    def __init__(self, server: SwarmServer):
        self.server = server
        self.config = config = server.config
        self.link = SchedulerLink(
            server.dht,
            config.dht_prefix,
            config.scheduler_key,
            timeout=config.scheduler_rpc_timeout,
            retry_after=0.0,  # the managed loops pace their own questions
            refresh_period=10.0,  # a scheduler that restarted elsewhere is found within this
            distrust_for=120.0,
            swarm_secret=config.swarm_secret,
            log_outages=False,  # the managed loops say what they do without one
        )
        self.epoch: int | None = None  # placement epoch of the span we serve; None: not the scheduler's
        self._ignored_epoch: int | None = None  # an assignment we could not follow (logged once)
        self._chose_locally = False  # no scheduler answered at start-up (already logged)

    async def close(self) -> None:
        await self.link.close()

    # --- getting a span --------------------------------------------------------------------------
    async def wait_for_span(self) -> tuple[int, int] | None:
        """Ask the scheduler until it assigns us a span; choose one ourselves if no scheduler answers
        for `scheduler_timeout` seconds. A scheduler that answers "not placed" is waited for as long
        as it takes (it may keep us as a spare). Re-announces meanwhile so our record stays alive.
        Returns None if the server is stopped first."""
        server, config, loop = self.server, self.config, asyncio.get_running_loop()
        started = loop.time()
        deadline = started + config.scheduler_timeout
        next_announce = started + config.announce_period
        last_reason = None
        if self.link.trusted_key is None:  # no scheduler may place us: choose at once
            choice = await self._choose_locally()
            return choice.start, choice.end
        while not server.stopped.is_set():
            assignment = await self.link.get_assignment(server.peer_id)
            now = loop.time()
            wait = 1.0
            if assignment is not None:
                deadline = now + config.scheduler_timeout  # it answers: no fallback while it does
                if assignment.assigned and self._usable(assignment):
                    self.epoch = assignment.epoch
                    server.role.follow(assignment.role)  # announced with the span
                    logger.info(
                        "scheduler at %s assigned blocks %d:%d (epoch %d, policy %s) after %.1f s",
                        self.link.address,
                        assignment.start,
                        assignment.end,
                        assignment.epoch,
                        assignment.policy or "?",
                        now - started,
                    )
                    return assignment.start, assignment.end
                if not assignment.assigned and assignment.reason != last_reason:
                    last_reason = assignment.reason
                    logger.info(
                        "scheduler at %s has not placed us yet (epoch %d): %s",
                        self.link.address,
                        assignment.epoch,
                        assignment.reason or "no reason given",
                    )
                if assignment.assigned:  # unusable, so the scheduler is distrusted: choose ourselves now
                    deadline, wait = now, 0.0
                else:  # bounded: a scheduler's number must not park us forever
                    retry = assignment.retry_after
                    wait = min(retry, 10.0) if math.isfinite(retry) and retry > 0 else 1.0
            elif now >= deadline:
                choice = await self._choose_locally()
                return choice.start, choice.end
            else:
                wait = min(1.0, deadline - now)
            if now >= next_announce:
                next_announce = now + config.announce_period
                await server.announce_quietly()
            await server.sleep_unless_stopped(min(wait, max(next_announce - now, 0.05)))
        return None

    def _usable(self, assignment: Assignment) -> bool:
        """Whether we can serve an assigned span: inside the model and within our memory (eq. 2 with no
        sessions). A span we cannot serve is logged once per epoch and otherwise ignored."""
        start, end, server = assignment.start, assignment.end, self.server
        problem = None
        if not 0 <= start < end <= server.model_blocks:
            problem = f"it is not inside the model's {server.model_blocks} blocks"
        elif server.block_bytes * (end - start) > self.config.memory_bytes:
            memory = self.config.memory_bytes
            problem = f"{end - start} blocks of {server.block_bytes} bytes exceed our {memory} bytes"
        if problem is None:
            return True
        if assignment.epoch != self._ignored_epoch:
            self._ignored_epoch = assignment.epoch
            self.link.distrust(f"assigned blocks {start}:{end} (epoch {assignment.epoch}): {problem}")
        return False

    async def _choose_locally(self) -> BlockChoice:
        """PETALS-style fallback (docs/reference.md 3.3): as many blocks as PETALS' memory rule gives
        (at least one), on the window the servers already announced serve least."""
        server, config = self.server, self.config
        span = server.model_span()
        try:
            servers = await asyncio.wait_for(
                fetch_servers_async(server.dht, config.dht_prefix, server.limits),
                config.scheduler_rpc_timeout * 3,
            )
        except Exception as error:  # without a view of the swarm, every block looks unserved
            logger.warning(
                "could not read the swarm's servers from the DHT: %s", error or type(error).__name__
            )
            servers = {}
        others = served_spans(servers, exclude=server.peer_id)
        family = span.family
        model = petals_model_spec(
            num_blocks=server.model_blocks,
            block_bytes=server.block_bytes,
            hidden_size=family.hidden_size(span.config),
            kv_dim=family.kv_dim(span.config),
            dtype_bytes=dtype_bytes(span.dtype),
            cache_bytes=server.cache_token_bytes * config.slot_tokens,
        )
        choice = choose_blocks(model, config.memory_bytes, server.timings.tau, others)
        self._chose_locally = True
        logger.info(
            "no scheduler answered within %.1f s (%s): chose blocks %d:%d PETALS-style: %d blocks fit "
            "%d bytes (PETALS count %d), least-served window among %d servers, per-block throughput %s",
            config.scheduler_timeout,
            self.link.last_error,
            choice.start,
            choice.end,
            choice.num_blocks,
            config.memory_bytes,
            choice.fitted,
            len(others),
            [round(value, 1) for value in choice.block_throughput],
        )
        return choice

    # --- following the scheduler while serving ----------------------------------------------------
    async def follow(self, p2p) -> None:
        """Ask for our assignment every `assignment_poll` seconds and move when the placement changes.
        Without an answer (or without a placement for us) we keep serving what we have."""
        # after a local choice the silence is already logged: warn only when a scheduler we had goes quiet
        server, config, warned = self.server, self.config, self._chose_locally
        try:
            while not server.stopped.is_set():
                await server.sleep_unless_stopped(config.assignment_poll)
                if server.stopped.is_set():
                    return
                assignment = await self.link.get_assignment(server.peer_id)
                if assignment is None:
                    if not warned:
                        warned = True
                        logger.warning(
                            "scheduler unreachable (%s): serving blocks %s meanwhile, asking every %.1f s",
                            self.link.last_error,
                            server.span_text,
                            config.assignment_poll,
                        )
                    continue
                if warned:
                    warned = False
                    logger.info("scheduler at %s answers", self.link.address)
                if assignment.assigned and server.role.follow(assignment.role):
                    await server.announce_quietly()
                if assignment.assigned and self._should_move(assignment) and self._usable(assignment):
                    await self._move(p2p, assignment)
        except Exception as error:  # a failed move leaves nothing to serve: stop, and say why
            logger.exception("following the scheduler failed: %s", error)
            server.fail(error)

    def _should_move(self, assignment: Assignment) -> bool:
        """A different span under another epoch than the one we serve. Epochs only grow at one
        scheduler; a smaller one means it restarted, and we follow the new one rather than wait for
        its epochs to catch up."""
        served = self.server.served
        if served is not None and (assignment.start, assignment.end) == (served.start, served.end):
            self.epoch = assignment.epoch
            return False
        if self.epoch is not None and assignment.epoch == self.epoch:
            return False  # same placement, other span: not the contract; wait for a new epoch
        if self.epoch is not None and assignment.epoch < self.epoch:
            logger.info(
                "scheduler epoch went back from %d to %d (restarted?): following it",
                self.epoch,
                assignment.epoch,
            )
        return True

    async def _move(self, p2p, assignment: Assignment) -> None:
        if await self.server.move_to(p2p, assignment.start, assignment.end, f"epoch {assignment.epoch}"):
            self.epoch = assignment.epoch


async def stop_follower(follower: asyncio.Task) -> None:
    """Let the scheduler follower reach a safe point (it checks `stopped`; a move under way finishes
    loading), then cancel it if it still runs, so leaving never races a half-done move."""
    done, _pending = await asyncio.wait({follower}, timeout=60.0)
    if not done:
        follower.cancel()
        logger.warning("the scheduler follower did not stop within 60 s: cancelled")
