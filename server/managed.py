"""How a *managed* server (started without `--blocks`) gets its span and follows the scheduler.

It measures its speed on a probe block, announces itself without blocks, and takes its span from
the scheduler service; when no scheduler answers within `scheduler_timeout` it chooses a span
itself, PETALS-style (SPEC 3.3), so the swarm never depends on the scheduler for liveness. While
serving it keeps asking the scheduler and moves when the placement changes: it stops accepting
sessions, drains the open ones, keeps the blocks both spans share and loads only the missing ones.

`ManagedSpan` is a mixin of `server.server.SwarmServer`: it uses the server's DHT, announcements,
cache budget and servicer, and adds only what managing the span needs.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import TYPE_CHECKING

from server.block_choice import BlockChoice, choose_blocks, petals_model_spec, served_spans
from server.handler import BlockServicer
from server.memory import CacheBudget
from server.throughput import cached_block_timings
from swarm.cost import dtype_bytes
from swarm.dht_records import fetch_servers_async
from swarm.models.span import TransformerSpan, load_span, rebuild_span
from swarm.scheduler_api.scheduler_pb2 import Assignment
from swarm.server_info import ServerState

if TYPE_CHECKING:
    from server.server import SwarmServer

    _Base = SwarmServer
else:
    _Base = object

logger = logging.getLogger(__name__)


class ManagedSpan(_Base):
    """The managed half of `SwarmServer`: probe, wait for (or choose) a span, follow the placement."""

    def _measure_probe(self) -> None:
        """Managed: measure on block 0 alone what the scheduler needs to place us (tau, tau_prefill,
        s_m, cache bytes per token); blocks are alike, so one block tells it for any span."""
        config = self.config
        started = time.perf_counter()
        self._probe, _files = load_span(
            config.model_dir, 0, 1, dtype=config.dtype, device=config.device, quant=config.quant
        )
        self.block_bytes, self.cache_token_bytes = (
            self._probe.block_bytes,
            self._probe.cache_bytes(num_tokens=1),
        )
        self.timings = cached_block_timings(self._probe, config.prefill_tokens, config.compute_delay)
        self._announce()  # JOINING without blocks: the scheduler can place us from now on
        logger.info(
            "managed: probe on block 0 in %.0f ms: %d bytes per block, tau %.2f ms/block/token, "
            "tau_prefill(%d) %.2f ms/block, memory %d bytes; waiting for a span",
            (time.perf_counter() - started) * 1e3,
            self.block_bytes,
            self.timings.tau * 1e3,
            self.timings.prefill_tokens,
            self.timings.tau_prefill * 1e3,
            config.memory_bytes,
        )

    # --- managed: getting a span ----------------------------------------------------------------
    @property
    def model_blocks(self) -> int:
        """`L`, the model's number of blocks."""
        span = self._model_span()
        return span.family.num_blocks(span.config)

    def _model_span(self) -> TransformerSpan:
        """Whatever blocks we hold (the probe until a span is loaded): they know the model's shape."""
        return self.span if self.span is not None else self._probe

    async def _wait_for_span(self) -> tuple[int, int] | None:
        """Ask the scheduler until it assigns us a span; choose one ourselves if no scheduler answers
        for `scheduler_timeout` seconds. A scheduler that answers "not placed" is waited for as long
        as it takes (it may keep us as a spare). Re-announces meanwhile so our record stays alive.
        Returns None if the server is stopped first."""
        config, loop = self.config, asyncio.get_running_loop()
        started = loop.time()
        deadline = started + config.scheduler_timeout
        next_announce = started + config.announce_period
        last_reason = None
        if self.link.trusted_key is None:  # no scheduler may place us: choose at once
            choice = await self._choose_locally()
            return choice.start, choice.end
        while not self._stop.is_set():
            assignment = await self.link.get_assignment(self.peer_id)
            now = loop.time()
            wait = 1.0
            if assignment is not None:
                deadline = now + config.scheduler_timeout  # it answers: no fallback while it does
                if assignment.assigned and self._usable(assignment):
                    self.epoch = assignment.epoch
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
                await self._announce_quietly()
            await self._sleep_unless_stopped(min(wait, max(next_announce - now, 0.05)))
        return None

    def _usable(self, assignment: Assignment) -> bool:
        """Whether we can serve an assigned span: inside the model and within our memory (eq. 2 with no
        sessions). A span we cannot serve is logged once per epoch and otherwise ignored."""
        start, end = assignment.start, assignment.end
        problem = None
        if not 0 <= start < end <= self.model_blocks:
            problem = f"it is not inside the model's {self.model_blocks} blocks"
        elif self.block_bytes * (end - start) > self.config.memory_bytes:
            memory = self.config.memory_bytes
            problem = f"{end - start} blocks of {self.block_bytes} bytes exceed our {memory} bytes"
        if problem is None:
            return True
        if assignment.epoch != self._ignored_epoch:
            self._ignored_epoch = assignment.epoch
            self.link.distrust(f"assigned blocks {start}:{end} (epoch {assignment.epoch}): {problem}")
        return False

    async def _choose_locally(self) -> BlockChoice:
        """PETALS-style fallback (SPEC 3.3): as many blocks as PETALS' memory rule gives (at least one),
        on the window the servers already announced serve least."""
        config, span = self.config, self._model_span()
        try:
            servers = await asyncio.wait_for(
                fetch_servers_async(self.dht, config.dht_prefix, self.limits),
                config.scheduler_rpc_timeout * 3,
            )
        except Exception as error:  # without a view of the swarm, every block looks unserved
            logger.warning(
                "could not read the swarm's servers from the DHT: %s", error or type(error).__name__
            )
            servers = {}
        others = served_spans(servers, exclude=self.peer_id)
        family = span.family
        model = petals_model_spec(
            num_blocks=self.model_blocks,
            block_bytes=self.block_bytes,
            hidden_size=family.hidden_size(span.config),
            kv_dim=family.num_kv_heads(span.config) * family.head_dim(span.config),
            dtype_bytes=dtype_bytes(span.dtype),
            cache_bytes=self.cache_token_bytes * config.slot_tokens,
        )
        choice = choose_blocks(model, config.memory_bytes, self.timings.tau, others)
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

    async def _load_managed_span(self, start: int, end: int) -> None:
        """Load the span, keeping the probe's block 0 if the span holds it; timings stay the probe's."""
        started = time.perf_counter()
        self.span, reused, loaded = await asyncio.to_thread(
            rebuild_span, self._probe, self.config.model_dir, start, end
        )
        self._probe = None
        self.start_block, self.end_block = start, end
        self.budget = CacheBudget(self.config.memory_bytes, self.block_bytes * self.span.num_blocks)
        logger.info(
            "blocks %d:%d loaded in %.0f ms (%d reused from the probe, %d read); %d cache bytes for sessions",
            start,
            end,
            (time.perf_counter() - started) * 1e3,
            len(reused),
            len(loaded),
            self.budget.total_bytes,
        )

    # --- managed: following the scheduler while serving -------------------------------------------
    async def _follow_scheduler(self, p2p) -> None:
        """Ask for our assignment every `assignment_poll` seconds and move when the placement changes.
        Without an answer (or without a placement for us) we keep serving what we have."""
        # after a local choice the silence is already logged: warn only when a scheduler we had goes quiet
        config, warned = self.config, self._chose_locally
        try:
            while not self._stop.is_set():
                await self._sleep_unless_stopped(config.assignment_poll)
                if self._stop.is_set():
                    return
                assignment = await self.link.get_assignment(self.peer_id)
                if assignment is None:
                    if not warned:
                        warned = True
                        logger.warning(
                            "scheduler unreachable (%s): serving blocks %s meanwhile, asking every %.1f s",
                            self.link.last_error,
                            self.span_text,
                            config.assignment_poll,
                        )
                    continue
                if warned:
                    warned = False
                    logger.info("scheduler at %s answers", self.link.address)
                if assignment.assigned and self._should_move(assignment) and self._usable(assignment):
                    await self._move(p2p, assignment)
        except Exception as error:  # a failed move leaves nothing to serve: stop, and say why
            logger.exception("following the scheduler failed: %s", error)
            self._failure = error
            self._stop.set()

    def _should_move(self, assignment: Assignment) -> bool:
        """A different span under another epoch than the one we serve. Epochs only grow at one
        scheduler; a smaller one means it restarted, and we follow the new one rather than wait for
        its epochs to catch up."""
        if (assignment.start, assignment.end) == (self.start_block, self.end_block):
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
        """Switch to the assigned span: refuse new sessions (MOVING), drain open ones for up to
        `drain_timeout`, stop the old servicer, keep the shared blocks and load the missing ones,
        then serve the new span with a fresh servicer and cache budget."""
        config, loop = self.config, asyncio.get_running_loop()
        old_text, start, end = self.span_text, assignment.start, assignment.end
        old_servicer = self.servicer
        began = loop.time()
        self.state = ServerState.MOVING
        old_servicer.accepting = False
        await self._bounded("announcing MOVING", self._announce(wait=False), 5.0)
        logger.info(
            "moving from blocks %s to %d:%d (epoch %d, policy %s): draining %d sessions for up to %.0f s",
            old_text,
            start,
            end,
            assignment.epoch,
            assignment.policy or "?",
            len(old_servicer.sessions),
            config.drain_timeout,
        )
        deadline = began + config.drain_timeout
        while old_servicer.sessions and loop.time() < deadline and not self._stop.is_set():
            await asyncio.sleep(0.1)
        if self._stop.is_set():
            logger.info("stopping while moving: the move to %d:%d is abandoned", start, end)
            return  # _leave drains what is left of the old servicer
        switch_began = loop.time()
        unfinished = len(old_servicer.sessions)
        await self._stop_computing(old_servicer)
        self.span, reused, loaded = await asyncio.to_thread(
            rebuild_span, self.span, config.model_dir, start, end
        )
        await self._bounded(
            "removing the old handlers",
            old_servicer.remove_p2p_handlers(p2p, namespace=config.dht_prefix),
            2.0,
        )
        self.start_block, self.end_block = start, end
        self.budget = CacheBudget(config.memory_bytes, self.block_bytes * self.span.num_blocks)
        self.servicer = self._new_servicer()
        await self.servicer.add_p2p_handlers(p2p, namespace=config.dht_prefix)
        self.state, self.epoch = ServerState.ONLINE, assignment.epoch
        self.metrics.span_changes.inc()
        await self._announce_quietly()
        logger.info(
            "moved blocks %s -> %d:%d (epoch %d): %d blocks reused, %d loaded; drain %.0f ms "
            "(%d sessions cut), switch %.0f ms",
            old_text,
            start,
            end,
            assignment.epoch,
            len(reused),
            len(loaded),
            (switch_began - began) * 1e3,
            unfinished,
            (loop.time() - switch_began) * 1e3,
        )

    @staticmethod
    async def _stop_computing(servicer: BlockServicer) -> None:
        """Shut the servicer down and wait until its compute thread is idle: a step still running on
        the old blocks must finish before `rebuild_span` renumbers them for the new span."""
        servicer.shutdown()
        await asyncio.to_thread(servicer.executor.shutdown, True)
        engine = getattr(servicer, "engine", None)  # the batching engine's own thread, when batching
        if engine is not None:
            await asyncio.to_thread(engine.shutdown, True)

    async def _stop_follower(self, follower: asyncio.Task) -> None:
        """Let the follower reach a safe point (it checks `_stop`; a move under way finishes loading),
        then cancel it if it still runs, so leaving never races a half-done move."""
        done, _pending = await asyncio.wait({follower}, timeout=60.0)
        if not done:
            follower.cancel()
            logger.warning("the scheduler follower did not stop within 60 s: cancelled")
