"""How long sessions really run next to what eq. 1 predicted for them (pure).

WS-RR predicts a session's service time from the servers' announced per-block times and the
client's round trips (eq. 1). A real session runs longer: it opens a stream per hop, the client
does its own work per token (embedding, LM head, sampling) and reports its end one round trip
later. Those costs are the same for every session of a swarm, so the scheduler learns their size
as a ratio: the median of `measured / predicted` over the sessions that ended lately, and stretches
its predictions by it (the wait a new request is told, and when a running one will free its room).

A client reports its own end, so one client could lie. The ratio is a median over a window of
many sessions, bounded to [`LOWEST`, `HIGHEST`], and only moves predictions: admission always
counts cache slots, never times.
"""

from __future__ import annotations

import math
import statistics
from collections import deque

WINDOW = 64  # the latest ended sessions the ratio is taken over
MIN_SAMPLES = 5  # fewer ended sessions than this: predictions are used as they are
LOWEST, HIGHEST = 0.5, 10.0


class DurationCalibration:
    def __init__(self) -> None:
        self._ratios: deque[float] = deque(maxlen=WINDOW)

    def observe(self, measured: float, predicted: float) -> None:
        """A session ended after running `measured` seconds since admission; eq. 1 said `predicted`."""
        if math.isfinite(measured) and math.isfinite(predicted) and measured > 0 and predicted > 0:
            self._ratios.append(measured / predicted)

    @property
    def scale(self) -> float:
        """The factor to stretch predicted service times by (1 until enough sessions ended)."""
        if len(self._ratios) < MIN_SAMPLES:
            return 1.0
        return min(max(statistics.median(self._ratios), LOWEST), HIGHEST)
