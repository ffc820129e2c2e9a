"""How the scheduler admitted a session: what WS-RR predicted for it and when it was let in."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Admission:
    """How the scheduler admitted a session (monotonic seconds): what WS-RR predicted, what happened."""

    scheduler_session: str
    routed_at: float
    expected_wait: float
    admitted_at: float | None = None
