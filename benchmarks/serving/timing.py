"""Timing helpers shared by the benchmarks (no imports from the project: `benchmarks.serving.trust`
runs them inside an older checkout too)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from transformers.generation.streamers import BaseStreamer


@dataclass
class TokenClock(BaseStreamer):
    """A `generate()` streamer that records when each generated token arrives: `times[0]` is the
    prompt's `put`, `times[1]` the first token (prefill), and decode steps follow."""

    times: list[float] = field(default_factory=list)

    def put(self, value) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        """Nothing to flush: every arrival is recorded as it comes."""

    @property
    def first(self) -> float | None:
        """When the first generated token arrived (None before it has)."""
        return self.times[1] if len(self.times) > 1 else None

    @property
    def tokens(self) -> int:
        """How many tokens arrived (the prompt is not one)."""
        return max(len(self.times) - 1, 0)

    def intervals(self) -> list[float]:
        """The decode steps' times: the gaps between consecutive tokens after the first."""
        return [b - a for a, b in zip(self.times[1:], self.times[2:], strict=False)]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]
