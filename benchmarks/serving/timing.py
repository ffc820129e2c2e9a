"""Timing helpers shared by the benchmarks (no imports from the project: `benchmarks.serving.trust`
runs them inside an older checkout too)."""

from __future__ import annotations

import time

from transformers.generation.streamers import BaseStreamer


class TokenClock(BaseStreamer):
    """Records when each generated token arrives (the first `put` is the prompt)."""

    def __init__(self):
        self.times: list[float] = []

    def put(self, value) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass

    def intervals(self) -> list[float]:
        # times[0] is the prompt, times[1] the first token (prefill); decode steps follow
        return [b - a for a, b in zip(self.times[1:], self.times[2:], strict=False)]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]
