"""Running the planned batch: one worker thread per lane (a session slot of a chain), each taking jobs
from `WorkQueues` and generating each prompt greedily in a session pinned to its chain.

A finished prompt is written at once (`ResultsWriter`: appended, fsynced); a prompt that fails after
the client's own failovers and retries is written as an error line, and the worker goes on. The
progress bar (tqdm, on stderr) counts prompts and shows the generated tokens per second.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from tqdm import tqdm
from transformers.generation.streamers import BaseStreamer

from llm_swarm.client.batch.jobs import Job
from llm_swarm.client.batch.pinned import PinnedConnection, open_pinned_session
from llm_swarm.client.batch.queues import WorkQueues
from llm_swarm.client.batch.records import error_record, result_record
from llm_swarm.client.batch.results import ResultsWriter
from llm_swarm.client.model import DistributedModelForCausalLM

logger = logging.getLogger(__name__)


class StepClock(BaseStreamer):
    """A `generate()` streamer that only notes when each step's tokens arrive: the first call brings
    the prompt (before any step), each later one the token of one step, so the gaps are step times."""

    def __init__(self):
        self.marks: list[float] = []

    def put(self, value) -> None:
        self.marks.append(time.perf_counter())

    def end(self) -> None:
        pass

    @property
    def steps(self) -> list[float]:
        return [b - a for a, b in zip(self.marks, self.marks[1:], strict=False)]


@dataclass(frozen=True)
class Generated:
    tokens: list[int]
    seconds: float  # generate()'s wall time, opening the session included
    steps: list[float]  # each step's seconds: the prompt's first, then one per decoded token


def generate_pinned(
    model: DistributedModelForCausalLM, connection: PinnedConnection, job: Job, pad_token_id: int | None
) -> Generated:
    """Greedy generation of `job` in a session over `connection`'s chain."""
    started = time.perf_counter()
    input_ids = torch.tensor([job.input_ids], dtype=torch.long, device=model.device)
    clock = StepClock()
    session = open_pinned_session(connection, job.prompt_tokens, job.new_tokens)
    try:
        output = model.generate(
            input_ids,
            session=session,
            max_new_tokens=job.new_tokens,
            do_sample=False,
            pad_token_id=pad_token_id,
            streamer=clock,
        )
    finally:
        session.close()
    tokens = output[0, job.prompt_tokens :].tolist()
    return Generated(tokens, time.perf_counter() - started, clock.steps)


@dataclass
class RunStats:
    done: int = 0
    errors: int = 0
    tokens: int = 0
    started: float = field(default_factory=time.monotonic)
    finished: float | None = None
    # job index -> (lane, start, end), seconds since `started`: the run's timeline
    timeline: dict[int, tuple[int, float, float]] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def makespan(self) -> float:
        return (self.finished or time.monotonic()) - self.started


class BatchRunner:
    """Runs `jobs` on `connections` (one per chain) as `queues` hands them out."""

    def __init__(
        self,
        model: DistributedModelForCausalLM,
        tokenizer,
        jobs: Sequence[Job],
        connections: Sequence[PinnedConnection],
        queues: WorkQueues,
        writer: ResultsWriter,
        progress: bool = True,
        generate: Callable[[DistributedModelForCausalLM, PinnedConnection, Job, int | None], Generated] = (
            generate_pinned
        ),
    ):
        self.model, self.tokenizer, self.jobs = model, tokenizer, jobs
        self.connections, self.queues, self.writer = connections, queues, writer
        self.generate = generate
        eos = model.generation_config.eos_token_id
        self.eos_ids = {int(eos)} if isinstance(eos, int) else {int(e) for e in (eos or [])}
        self.pad_token_id = tokenizer.pad_token_id
        self.stats = RunStats()
        self.bar = tqdm(total=len(jobs), unit="prompt", disable=not progress, dynamic_ncols=True)
        self._stop = threading.Event()
        self._failure: BaseException | None = None

    def run(self) -> RunStats:
        """Every job, then the stats; a bug (or an interrupt) in a worker stops the others after
        their current prompt and is raised here."""
        lanes = range(len(self.queues.lane_chain))
        threads = [threading.Thread(target=self._worker, args=(lane,), daemon=True) for lane in lanes]
        self.stats.started = time.monotonic()
        for thread in threads:
            thread.start()
        try:
            for thread in threads:
                while thread.is_alive():
                    thread.join(timeout=0.5)  # wakes up for Ctrl-C / SIGTERM
        except KeyboardInterrupt:
            self._stop.set()
            raise
        finally:
            self.stats.finished = time.monotonic()
            self.bar.close()
        if self._failure is not None:
            raise self._failure
        return self.stats

    def _worker(self, lane: int) -> None:
        chain = self.queues.lane_chain[lane]
        try:
            while not self._stop.is_set():
                assignment = self.queues.next_job(lane)
                if assignment is None:
                    return
                if assignment.stolen_from is not None:
                    logger.info(
                        "lane %d (chain %d) took a job planned for lane %d (chain %d)",
                        lane,
                        chain,
                        assignment.stolen_from,
                        self.queues.lane_chain[assignment.stolen_from],
                    )
                self._run_job(lane, chain, assignment.job)
        except BaseException as error:  # a bug or a failed write: stop everyone
            self._failure = self._failure or error
            self._stop.set()

    def _run_job(self, lane: int, chain: int, index: int) -> None:
        job = self.jobs[index]
        started = time.monotonic() - self.stats.started
        try:
            generated = self.generate(self.model, self.connections[chain], job, self.pad_token_id)
        except Exception as error:  # what the client's failover could not save: this prompt only
            logger.warning("prompt %s failed on chain %d: %s", job.record.key, chain, error)
            self.writer.write(error_record(job.record, f"{type(error).__name__}: {error}", chain))
            self.queues.finished(lane, index, None)
            self._count(0, failed=True)
            return
        stopped = bool(generated.tokens) and generated.tokens[-1] in self.eos_ids
        finish = "stop" if stopped and len(generated.tokens) < job.new_tokens else "length"
        text = self.tokenizer.decode(generated.tokens, skip_special_tokens=True)
        record = result_record(
            job.record, text, generated.tokens, job.prompt_tokens, finish, chain, generated.seconds
        )
        self.writer.write(record)
        self.queues.finished(lane, index, generated.seconds)
        with self.stats.lock:
            self.stats.timeline[index] = (lane, started, time.monotonic() - self.stats.started)
        self._count(len(generated.tokens))

    def _count(self, tokens: int, failed: bool = False) -> None:
        with self.stats.lock:
            self.stats.done += 1
            self.stats.errors += failed
            self.stats.tokens += tokens
            rate = self.stats.tokens / max(time.monotonic() - self.stats.started, 1e-9)
            self.bar.set_postfix_str(f"{rate:.1f} tokens/s, {self.stats.errors} errors", refresh=False)
            self.bar.update(1)
