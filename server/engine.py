"""The server's compute engine: one compute thread that batches decode steps across sessions.

Without it, every session's step is its own forward on the compute thread, so a busy server does
many tiny matrix products (PETALS does the same). Here steps are queued, and the compute thread
runs, at each iteration, either

- one *batched decode*: the single-token steps of several sessions that serve the same block range,
  as one forward (`TransformerSpan.forward_batch`; each session keeps its own cache and position),
  collected over a short window (`batch_wait`, 2 ms by default) or whatever piled up while the
  previous iteration ran; or
- one *prefill* (any step of several tokens, or a single-token step whose own padding masks the new
  token, which must run alone to be exact), run as today.

Which of the two goes next is `swarm.step_scheduler.decide` (Pang et al.'s prefill-vs-decode rule
with starvation caps), fed with cost fits of this thread's own measured run times.

Errors stay with their session: a step that fails validation against its cache (e.g. it would
overflow its `max_length`) is run alone and fails alone, and if a batched forward fails for any
other reason every step of the batch is rerun individually, so each session gets exactly the
result or error it would have got without batching.

A decode step that would run alone anyway (the compute thread is idle, nothing is queued and no
other session decodes on its blocks) and whose measured cost is below `inline_below` runs on the
thread that asked for it (the server's event loop, through `run`), with the same bookkeeping: for
the cheap steps where the two thread hand-offs cost a fifth of the step or more, a hop then costs
what its messages and its compute cost.

`compute_delay` (emulating a slower accelerator, seconds per block per step) is paid once per
block per *iteration*: a batched decode of 16 sessions sleeps as long as one session's step, like a
GPU whose step time hardly depends on the batch size for small batches.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Coroutine
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, ParamSpec, TypeVar

import torch

from llm_swarm.server.emulated_delay import emulated_seconds_per_block
from llm_swarm.swarm import step_scheduler
from llm_swarm.swarm.models.adapters import adapter_rows
from llm_swarm.swarm.models.cache import SpanCache
from llm_swarm.swarm.models.span import TransformerSpan

logger = logging.getLogger(__name__)

# Until this thread has measured anything, a decode row and a prefill token cost the same (paper
# 004 measured 0.21 vs 0.13 ms per token); only the ratio matters to the decision.
DEFAULT_PRIOR = step_scheduler.LinearCost(fixed=0.0, per_unit=1e-3)

# A lone decode step measured to cost at most this runs on the caller's event loop instead of the
# compute thread: handing it to the thread and back costs two thread wake-ups (0.1-0.4 ms on a busy
# host, a fifth or more of such a step), and what else the loop serves meanwhile (a ping, another
# session's message, whose step would wait for the compute thread's step anyway) waits at most this.
INLINE_BELOW = 0.002

_P = ParamSpec("_P")
_T = TypeVar("_T")


def _awaiting(submit: Callable[_P, Future[_T]]) -> Callable[_P, Coroutine[Any, Any, _T]]:
    """A coroutine method taking `submit`'s arguments that waits for the result of its future (`run`)."""

    async def awaited(*args: _P.args, **kwargs: _P.kwargs) -> _T:
        """What `submit` with these arguments computes, awaited (or its exception, raised); a future
        done on return (an inline step) is read at once, without a trip through the event loop."""
        future = submit(*args, **kwargs)
        if future.done():
            return future.result()
        return await asyncio.wrap_future(future)

    return awaited


@dataclass(eq=False)
class _Step:
    span: TransformerSpan
    cache: SpanCache
    hidden: torch.Tensor
    position: int
    padding_mask: torch.Tensor | None
    arrived: float
    adapter: str | None = None  # the session's LoRA adapter (rows of one batch may use different ones)
    future: Future = field(default_factory=Future)
    skips: int = 0  # decode iterations that ran while this (prefill) step waited
    chunk: int = 0  # a prefill longer than this runs in chunks of this many tokens (0: whole)
    done: int = 0  # tokens of this step computed so far (chunked prefill)
    outputs: list = field(default_factory=list)  # the computed chunks' outputs
    started: bool = False  # its future is running (a chunked prefill's first chunk has run)
    expected_ahead: int | None = None  # learned decode work left (`ahead`); None: the cache room
    progress: Callable[[int], None] | None = None  # told each chunk's end position (a following push)

    def __post_init__(self) -> None:
        # batchable: one new token that is itself not padding (a masked-out query has no key to
        # attend to, and its softmax would then depend on how many padded keys the batch holds)
        self.decode = self.hidden.shape[1] == 1 and (
            self.padding_mask is None or bool(self.padding_mask[:, -1].all())
        )
        self.group = (id(self.span), self.cache.block_offset, self.cache.num_blocks)

    @property
    def rows(self) -> int:
        return self.hidden.shape[0]

    @property
    def ahead(self) -> int:
        """Tokens this session is expected to decode still, this one included (`N^d_i`): what the
        server learned of its sessions' lengths, at most its cache's room."""
        room = max(self.cache.max_length - self.position, 1)
        return min(max(self.expected_ahead, 1), room) if self.expected_ahead is not None else room

    @property
    def tokens(self) -> int:
        """The work its next run does: the next chunk of a chunked prefill, else the whole step."""
        return self.hidden.shape[0] * self.next_width

    @property
    def next_width(self) -> int:
        left = self.hidden.shape[1] - self.done
        return min(left, self.chunk) if self.chunk else left

    def next_chunk(self) -> tuple[torch.Tensor, int, torch.Tensor | None]:
        """(hidden, position, padding mask) of the next run: the positions after those done."""
        first, last = self.done, self.done + self.next_width
        mask = self.padding_mask[:, : self.position + last] if self.padding_mask is not None else None
        return self.hidden[:, first:last], self.position + first, mask


@dataclass
class EngineStats:
    """Counters for logs, tests and benchmarks."""

    decode_iterations: int = 0
    decode_steps: int = 0  # session steps run inside decode iterations
    max_batch: int = 0  # most session steps in one decode iteration
    prefills: int = 0
    prefill_chunks: int = 0  # chunks run of prefills longer than the chunk size
    fallbacks: int = 0  # batched forwards that failed and were rerun step by step
    decisions: dict[str, int] = field(default_factory=dict)  # rule tag -> iterations it decided

    def summary(self) -> str:
        average = self.decode_steps / self.decode_iterations if self.decode_iterations else 0.0
        return (
            f"{self.decode_iterations} decode iterations ({average:.1f} steps each, max {self.max_batch}), "
            f"{self.prefills} prefills, {self.fallbacks} fallbacks, decisions {self.decisions}"
        )


class BatchingEngine:
    """Queue of steps plus the compute thread that runs them; see the module docstring."""

    def __init__(
        self,
        *,
        batch_wait: float = 0.002,
        compute_delay: float = 0.0,
        compute_delay_per_token: float = 0.0,
        prefill_chunk: int = 0,
        max_batch_rows: int = 64,
        policy: step_scheduler.SchedulerPolicy | None = None,
        decode_prior: step_scheduler.LinearCost = DEFAULT_PRIOR,
        prefill_prior: step_scheduler.LinearCost = DEFAULT_PRIOR,
        clock: Callable[[], float] = time.monotonic,
        active_horizon: float = 0.25,
        on_decode_batch: Callable[[int], None] = lambda steps: None,
        inline_below: float = INLINE_BELOW,
    ):
        self.policy = policy or step_scheduler.SchedulerPolicy(
            batch_wait=batch_wait, max_batch_rows=max_batch_rows
        )
        self.compute_delay = compute_delay
        self.compute_delay_per_token = compute_delay_per_token
        self.prefill_chunk = prefill_chunk  # longer prefills run in chunks of this many tokens (0: whole)
        self.decode_fit = step_scheduler.LinearFit(decode_prior)
        self.prefill_fit = step_scheduler.LinearFit(prefill_prior)
        self.stats = EngineStats()
        self.on_decode_batch = on_decode_batch  # session steps of each decode iteration (server metrics)
        self.inline_below = inline_below  # seconds; 0 turns inline steps off
        # moving average of what a lone decode step took (None until one ran): the inline rule's
        # prediction; the decode fit's line, pulled by its prior at many rows, overestimates one row
        self.lone_decode_seconds: float | None = None
        self._clock = clock
        self._condition = threading.Condition()
        self._decodes: list[_Step] = []  # in arrival order
        self._prefills: deque[_Step] = deque()
        # per block range: when each session last sent a decode step (id(cache) -> time), to know
        # how many sessions a decode batch can expect; forgotten after `active_horizon` seconds
        self._decoders: dict[tuple, dict[int, float]] = {}
        self.active_horizon = active_horizon
        self._stopped = False
        self._busy = False  # an iteration runs (on the compute thread, or inline on the caller's loop)
        self._thread = threading.Thread(target=self._loop, name="compute", daemon=True)
        self._thread.start()

    # --- submitting -----------------------------------------------------------------------------
    def submit(
        self,
        span: TransformerSpan,
        cache: SpanCache,
        hidden: torch.Tensor,
        position: int,
        padding_mask: torch.Tensor | None = None,
        adapter: str | None = None,
        ahead: int | None = None,
        progress: Callable[[int], None] | None = None,
    ) -> Future:
        """Queue `span(hidden, cache, position, padding_mask)` with LoRA `adapter` (None: none); the
        future gets its output (in `hidden`'s dtype) or its exception. `ahead`: the tokens this
        session is expected to decode still, this one included (`server.session_lengths`; None: its
        cache room). `progress`: called on the compute thread with the end position of each finished
        chunk of a prefill (`server.cache_progress`). A cheap lone decode step runs on the caller's
        thread instead (module docstring): its future is done on return."""
        step = _Step(
            span, cache, hidden, position, padding_mask, self._clock(), adapter, expected_ahead=ahead
        )
        step.progress = progress
        if self._claim_inline(step):
            try:
                self._run_decode([step])
            finally:
                with self._condition:
                    self._busy = False
                    if self._decodes or self._prefills:  # queued meanwhile (another thread's step)
                        self._condition.notify()
            return step.future
        if not step.decode:
            step.chunk = self.prefill_chunk
        with self._condition:
            if self._stopped:
                step.future.cancel()
                return step.future
            (self._decodes if step.decode else self._prefills).append(step)
            if step.decode:
                self._decoders.setdefault(step.group, {})[id(cache)] = step.arrived
            self._condition.notify()
        return step.future

    def forget(self, cache: SpanCache) -> None:
        """The session of `cache` has ended: stop expecting its decode steps. Without this, the next
        session on the same blocks (e.g. a client's following request) would wait `batch_wait` at
        every step for up to `active_horizon` s, for a companion that never comes."""
        with self._condition:
            for group, seen in list(self._decoders.items()):
                seen.pop(id(cache), None)
                if not seen:
                    del self._decoders[group]
            self._condition.notify()  # a batch waiting for this session may now be complete

    run = _awaiting(submit)

    def _claim_inline(self, step: _Step) -> bool:
        """Whether `step` runs on the caller's thread; if so, the compute thread is held off until it ends."""
        if not step.decode or self.inline_below <= 0 or self.compute_delay or self.compute_delay_per_token:
            return False
        with self._condition:
            if self._stopped or self._busy or self._decodes or self._prefills:
                return False
            others = set(self._recent_decoders(step.arrived).get(step.group, {})) - {id(step.cache)}
            lone = self.lone_decode_seconds
            if others or lone is None or lone > self.inline_below:
                return False
            self._decoders.setdefault(step.group, {})[id(step.cache)] = step.arrived
            self._busy = True
            step.started = True
            step.future.set_running_or_notify_cancel()
            self.stats.decisions["inline"] = self.stats.decisions.get("inline", 0) + 1
        return True

    def shutdown(self, wait: bool = False) -> None:
        """Stop the thread; steps not started yet are cancelled (like `executor.shutdown(cancel_futures)`)."""
        with self._condition:
            self._stopped = True
            pending = [*self._decodes, *self._prefills]
            self._decodes.clear()
            self._prefills.clear()
            self._condition.notify_all()
        for step in pending:
            if step.started:  # a chunked prefill between two chunks: its caller waits on a running future
                step.future.set_exception(RuntimeError("the server is shutting down"))
            else:
                step.future.cancel()
        if wait:
            self._thread.join()

    # --- the compute thread ---------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._condition:
                while True:
                    if self._stopped:
                        return
                    if self._busy:  # a step runs inline on the caller's loop
                        self._condition.wait()
                        continue
                    view, batch = self._view()
                    decision = step_scheduler.decide(view, self.costs(), self.policy)
                    if decision.action is step_scheduler.Action.IDLE:
                        self._condition.wait()
                    elif decision.action is step_scheduler.Action.WAIT:
                        self._condition.wait(decision.wait)
                    else:
                        break
                self.stats.decisions[decision.rule] = self.stats.decisions.get(decision.rule, 0) + 1
                if decision.action is step_scheduler.Action.DECODE:
                    work = self._take_decodes(batch)
                else:
                    work = [self._prefills.popleft()]
                # a step whose caller went away (cancelled future) is dropped here, not computed
                work = [step for step in work if step.started or step.future.set_running_or_notify_cancel()]
                for step in work:
                    step.started = True
                self._busy = True
            try:
                if decision.action is step_scheduler.Action.DECODE:
                    self._run_decode(work)
                else:
                    self._run_prefill(work)
            except BaseException as error:  # never let the thread die with callers waiting
                logger.exception("compute iteration failed")
                for step in work:
                    if not step.future.done():
                        step.future.set_exception(error)
            finally:
                with self._condition:
                    self._busy = False

    def costs(self) -> step_scheduler.CostModel:
        return step_scheduler.CostModel(decode=self.decode_fit.cost(), prefill=self.prefill_fit.cost())

    def _view(self) -> tuple[step_scheduler.QueueView, list[_Step]]:
        """The queue as the scheduler sees it, and the decode batch that would run next: the steps
        of the oldest waiting decode step's block range, oldest first, up to `max_batch_rows`."""
        now = self._clock()
        batch: list[_Step] = []
        expected = 0
        if self._decodes:
            group, rows = self._decodes[0].group, 0
            for step in self._decodes:
                if step.group != group:
                    continue
                if batch and rows + step.rows > self.policy.max_batch_rows:
                    break
                batch.append(step)
                rows += step.rows
            expected = len(self._recent_decoders(now).get(group, {}))
        prefill = self._prefills[0] if self._prefills else None
        view = step_scheduler.QueueView(
            now=now,
            decode_rows=sum(step.rows for step in batch),
            decode_oldest=batch[0].arrived if batch else None,
            decode_sessions=len({id(step.cache) for step in batch}),
            decode_expected=expected,
            decode_ahead_max=max((step.ahead for step in batch), default=0),
            decode_ahead_rows=sum(step.ahead * step.rows for step in batch),
            prefill_tokens=prefill.tokens if prefill else 0,
            prefill_oldest=prefill.arrived if prefill else None,
            prefill_skips=prefill.skips if prefill else 0,
            prefill_started=bool(prefill and prefill.started),
        )
        return view, batch

    def _recent_decoders(self, now: float) -> dict[tuple, dict[int, float]]:
        """Forget sessions (and block ranges) that sent no decode step for `active_horizon` s."""
        for group in list(self._decoders):
            seen = self._decoders[group]
            for key in [key for key, at in seen.items() if now - at > self.active_horizon]:
                del seen[key]
            if not seen:
                del self._decoders[group]
        return self._decoders

    def _take_decodes(self, batch: list[_Step]) -> list[_Step]:
        taken, seen = [], set()
        for step in batch:
            if id(step.cache) in seen:
                continue  # a second step of the same session waits for the next iteration
            seen.add(id(step.cache))
            taken.append(step)
        chosen = {id(step) for step in taken}
        self._decodes = [step for step in self._decodes if id(step) not in chosen]
        for prefill in self._prefills:
            prefill.skips += 1
        return taken

    def _run_prefill(self, work: list[_Step]) -> None:
        for step in work:
            tokens, started = step.tokens, time.perf_counter()
            if step.chunk and step.hidden.shape[1] > step.chunk:
                self._run_chunk(step)
            else:
                self._run_alone(step)
            self.prefill_fit.observe(tokens, time.perf_counter() - started)
            self.stats.prefills += 1

    def _run_chunk(self, step: _Step) -> None:
        """The next chunk of a long prefill; the rest goes back to the head of the prefill queue, so
        the scheduler can run decode iterations in between (TetriInfer's fixed-size chunks)."""
        hidden, position, mask = step.next_chunk()
        try:
            with adapter_rows(step.span, [step.adapter] * step.rows):
                output = step.span(hidden, step.cache, position, mask)
            self._delay(step.cache, hidden.shape[0] * hidden.shape[1])
        except Exception as error:
            step.future.set_exception(error)
            return
        step.outputs.append(output.to(step.hidden.device, step.hidden.dtype))
        step.done += hidden.shape[1]
        self.stats.prefill_chunks += 1
        if step.progress is not None:
            step.progress(position + hidden.shape[1])
        if step.done == step.hidden.shape[1]:
            step.future.set_result(torch.cat(step.outputs, dim=1))
            return
        with self._condition:
            if self._stopped:
                step.future.set_exception(RuntimeError("the server is shutting down"))
                return
            # the rest waits as a new arrival: its wait and skips count from this chunk, not the first
            step.arrived, step.skips = self._clock(), 0
            self._prefills.appendleft(step)
            self._condition.notify()

    def _run_decode(self, work: list[_Step]) -> None:
        if not work:
            return
        started = time.perf_counter()
        batchable: list[_Step] = []
        for step in work:
            try:
                step.cache.begin_step(step.position, 1)  # what `forward` checks first; no side effects
                batchable.append(step)
            except ValueError:
                self._run_alone(step)  # fails with the same error it gets without batching
        if len(batchable) == 1:
            self._run_alone(batchable[0])
        elif batchable:
            # peft applies each row's own adapter (or none) inside the one batched forward
            rows = [step.adapter for step in batchable for _ in range(step.rows)]
            try:
                with adapter_rows(batchable[0].span, rows):
                    outputs = batchable[0].span.forward_batch(
                        [(step.hidden, step.cache, step.position, step.padding_mask) for step in batchable]
                    )
            except Exception as error:
                logger.warning(
                    "batched step of %d sessions failed (%s): running them one by one", len(batchable), error
                )
                self.stats.fallbacks += 1
                for step in batchable:
                    self._run_alone(step)
            else:
                self._delay(batchable[0].cache, sum(step.rows for step in batchable))
                for step, output in zip(batchable, outputs, strict=True):
                    step.future.set_result(output.to(step.hidden.device, step.hidden.dtype))
        elapsed = time.perf_counter() - started
        self.decode_fit.observe(sum(step.rows for step in work), elapsed)
        if len(work) == 1:
            last = self.lone_decode_seconds
            self.lone_decode_seconds = elapsed if last is None else 0.8 * last + 0.2 * elapsed
        self.stats.decode_iterations += 1
        self.stats.decode_steps += len(work)
        self.stats.max_batch = max(self.stats.max_batch, len(work))
        self.on_decode_batch(len(work))

    def _run_alone(self, step: _Step) -> None:
        """Exactly what the server did before batching: one forward, then the emulated delay."""
        try:
            with adapter_rows(step.span, [step.adapter] * step.rows):
                output = step.span(step.hidden, step.cache, step.position, step.padding_mask)
            self._delay(step.cache, step.hidden.shape[0] * step.hidden.shape[1])
            if step.progress is not None:
                step.progress(step.position + step.hidden.shape[1])
            step.future.set_result(output.to(step.hidden.device, step.hidden.dtype))
        except Exception as error:
            step.future.set_exception(error)

    def _delay(self, cache: SpanCache, tokens: int) -> None:
        """Emulation: launch-bound or compute-bound, whichever is longer (`emulated_delay`)."""
        seconds = emulated_seconds_per_block(self.compute_delay, self.compute_delay_per_token, tokens)
        if seconds:
            time.sleep(seconds * cache.num_blocks)
