"""Recent request metrics (docs/reference.md section 6) for operators: TTFT, TPOT and admission wait
percentiles.

Clients report TTFT and TPOT when they end a session; the scheduler measures the admission wait
itself. A bounded window of the latest requests keeps memory constant and the numbers current.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

WINDOW = 1000
SUMMARY_KEYS = ("finished_requests", "ttft_p50", "ttft_p95", "tpot_p50", "tpot_p95", "wait_p50", "wait_p95")


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (0 for no values): simple, and exact for the small windows we keep."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = max(math.ceil(q / 100 * len(ordered)), 1)
    return ordered[rank - 1]


@dataclass
class RequestStats:
    ttft: deque = field(default_factory=lambda: deque(maxlen=WINDOW))
    tpot: deque = field(default_factory=lambda: deque(maxlen=WINDOW))
    wait: deque = field(default_factory=lambda: deque(maxlen=WINDOW))

    def record_wait(self, seconds: float) -> None:
        self.wait.append(seconds)

    def record_finished(self, ttft: float, tpot: float, tokens: int) -> None:
        """A client's report; ignored unless plausible (finite, non-negative)."""
        if math.isfinite(ttft) and ttft > 0:
            self.ttft.append(ttft)
        if tokens > 0 and math.isfinite(tpot) and tpot > 0:
            self.tpot.append(tpot)

    def summary(self) -> dict[str, float | int]:
        ttft, tpot, wait = list(self.ttft), list(self.tpot), list(self.wait)
        return {
            "finished_requests": len(ttft),
            "ttft_p50": percentile(ttft, 50),
            "ttft_p95": percentile(ttft, 95),
            "tpot_p50": percentile(tpot, 50),
            "tpot_p95": percentile(tpot, 95),
            "wait_p50": percentile(wait, 50),
            "wait_p95": percentile(wait, 95),
        }
