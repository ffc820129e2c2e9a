"""The lanes' queues while a batch runs: whose job is next, work stealing, and learning real speeds.

Thread-safe; no network. Each lane (one session slot of a chain) takes the head of its own queue;
once that is empty it steals (`plan.choose_steal`): from the lane expected to finish last, the
not-yet-started job with the most work that it finishes sooner. A job is handed out exactly once.

Estimates follow what the chains really do: when a job ends, its measured seconds over its estimate
updates the chain's correction factor (an exponential average), which scales every later estimate
of that chain, so stealing decides on measured speeds rather than announced ones.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from llm_swarm.client.batch.plan import Plan, choose_steal

SMOOTHING = 0.3  # weight of the newest job in a chain's correction factor


@dataclass(frozen=True)
class Assignment:
    job: int
    stolen_from: int | None  # the lane it was planned on, if another lane's


class WorkQueues:
    def __init__(
        self,
        plan: Plan,
        times: np.ndarray,
        steal: bool = True,
        shared: bool = False,
        clock: Callable[[], float] = time.monotonic,
    ):
        """`times[k, j]`: estimated seconds of job j on chain k. `shared`: one queue in input order
        for every lane (first come, first served) instead of the plan's lanes."""
        self.lane_chain = plan.lane_chain
        self._times = np.asarray(times, dtype=float)
        self._queues = [deque(queue) for queue in plan.queues]
        self._shared = deque(sorted(job for queue in plan.queues for job in queue)) if shared else None
        self._steal = steal
        self._clock = clock
        self._lock = threading.Lock()
        self._correction = np.ones(self._times.shape[0])
        self._running: dict[int, tuple[int, float]] = {}  # lane -> (job, started at)
        self.steals = 0

    def planned(self, chain: int, job: int) -> float:
        """Seconds job `job` was planned to take on `chain` (before any correction)."""
        return float(self._times[chain, job])

    def estimate(self, chain: int, job: int) -> float:
        """Seconds job `job` is now expected to take on `chain` (announced or probed, corrected)."""
        with self._lock:
            return float(self._times[chain, job] * self._correction[chain])

    def next_job(self, lane: int) -> Assignment | None:
        """The job lane `lane` runs next, marked running; None when nothing is left for it."""
        with self._lock:
            now = self._clock()
            chain = self.lane_chain[lane]
            if self._shared is not None:
                # the first job in file order this chain can run (almost always the head)
                runnable = next((j for j in self._shared if np.isfinite(self._times[chain, j])), None)
                if runnable is None:
                    return None
                self._shared.remove(runnable)
                return self._start(lane, runnable, None, now)
            if self._queues[lane]:
                return self._start(lane, self._queues[lane].popleft(), None, now)
            if not self._steal:
                return None
            scaled = self._times * self._correction[:, None]
            busy_until = [self._busy_until(other, scaled, now) for other in range(len(self._queues))]
            choice = choose_steal(now, chain, self.lane_chain, self._queues, busy_until, scaled)
            if choice is None:
                return None
            victim, job = choice
            self._queues[victim].remove(job)
            self.steals += 1
            return self._start(lane, job, victim, now)

    def _busy_until(self, lane: int, scaled: np.ndarray, now: float) -> float:
        running = self._running.get(lane)
        if running is None:
            return now
        job, started = running
        return max(started + scaled[self.lane_chain[lane], job], now)

    def _start(self, lane: int, job: int, stolen_from: int | None, now: float) -> Assignment:
        self._running[lane] = (job, now)
        return Assignment(job, stolen_from)

    def finished(self, lane: int, job: int, seconds: float | None) -> None:
        """Lane `lane` is done with `job`; `seconds`: how long it took (None: it failed, which
        teaches nothing about speed)."""
        with self._lock:
            self._running.pop(lane, None)
            chain = self.lane_chain[lane]
            expected = self._times[chain, job]
            if seconds is not None and expected > 0 and np.isfinite(expected):
                ratio = seconds / expected
                self._correction[chain] = (1 - SMOOTHING) * self._correction[chain] + SMOOTHING * ratio

    def corrections(self) -> Sequence[float]:
        with self._lock:
            return tuple(float(c) for c in self._correction)

    def remaining(self) -> int:
        with self._lock:
            queued = len(self._shared) if self._shared is not None else sum(map(len, self._queues))
            return queued + len(self._running)
