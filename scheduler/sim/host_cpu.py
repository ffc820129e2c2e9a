"""A machine's CPU cores shared by every emulated process (processor sharing), for the contended model.

An emulated swarm (benchmarks/table2/run.py) runs all its servers, their p2p daemons and the client on
one machine, so what each server computes on its CPU (its blocks' forward, the handling of each
step's messages) and what the client does per step compete for the same few cores: under load a
step's CPU work takes longer than its idle cost, on every server at once. `SharedCpu` models that
as processor sharing: `cores` cores, of which `background` are busy with work the model does not
follow (DHT upkeep, announcements, the scheduler); each of the `n` jobs running progresses at
`min(1, (cores - background) / n)` CPU-seconds per second. With one job at a time it runs at full
speed, so an idle swarm sees no slowdown.

Only the emulation's prediction uses it (`benchmarks/scheduling/sim_contended.py`); a swarm of real
machines gives each server its own CPU.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

Schedule = Callable[[float, Callable[[float, object], None], object], None]
MIN_CAPACITY = 0.05  # cores left to the modelled work however busy the background is


@dataclass(frozen=True)
class HostCpuModel:
    """The machine and the CPU costs of the work the contended model follows on it."""

    cores: float
    background: float = 0.0  # cores busy with work the model does not follow
    handler_s: float = 0.0  # a server's CPU per step it answers (messages, validation, bookkeeping)
    client_s: float = 0.0  # the client's CPU per step it sends (one per hop per token)
    client_token_s: float = 0.0  # the client's CPU per token (embedding, LM head, sampling)

    def __post_init__(self) -> None:
        if not self.cores > 0 or not self.background >= 0:
            raise ValueError("a host needs cores > 0 and background >= 0")
        if not (self.handler_s >= 0 and self.client_s >= 0 and self.client_token_s >= 0):
            raise ValueError("per-step CPU costs must be >= 0")


class SharedCpu:
    """Processor sharing over the engine's event queue (`schedule(time, callback, argument)`)."""

    def __init__(self, model: HostCpuModel, schedule: Schedule):
        self.capacity = max(model.cores - model.background, MIN_CAPACITY)
        self._schedule = schedule
        self._jobs: dict[int, list] = {}  # id -> [remaining CPU seconds, callback, argument]
        self._next_id = 0
        self._updated = 0.0
        self._version = 0

    def _rate(self) -> float:
        return min(1.0, self.capacity / len(self._jobs)) if self._jobs else 1.0

    def _advance(self, now: float) -> None:
        elapsed = (now - self._updated) * self._rate()
        if elapsed > 0:
            for job in self._jobs.values():
                job[0] -= elapsed
        self._updated = now

    def run(
        self, now: float, seconds: float, callback: Callable[[float, object], None], argument: object
    ) -> None:
        """Run `seconds` of CPU work from `now`; `callback(time, argument)` when it is done."""
        if seconds <= 0:
            callback(now, argument)
            return
        self._advance(now)
        self._jobs[self._next_id] = [seconds, callback, argument]
        self._next_id += 1
        self._plan(now)

    def _plan(self, now: float) -> None:
        self._version += 1
        if self._jobs:
            least = min(job[0] for job in self._jobs.values())
            self._schedule(now + max(least, 0.0) / self._rate(), self._due, self._version)

    def _due(self, now: float, version: object) -> None:
        if version != self._version:
            return  # the job mix changed since this completion was planned
        self._advance(now)
        # the planned job is due now; any other within float noise of it finishes with it
        least = min(job[0] for job in self._jobs.values())
        tolerance = max(least, 0.0) + 1e-12 * max(1.0, math.fabs(now))
        finished = [
            self._jobs.pop(key) for key in [k for k, job in self._jobs.items() if job[0] <= tolerance]
        ]
        self._plan(now)
        for _, callback, argument in finished:
            callback(now, argument)
