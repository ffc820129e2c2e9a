"""What a simulated server's compute thread runs next: the live server's rule, for the contended model.

This is `server.step_scheduler.decide` (Pang et al.'s prefill-vs-decode rule with its starvation caps,
chunked prefills alternating with decode iterations, and the decode batching window), restated over
plain numbers: `scheduler/` may not import `server/` (docs/architecture.md, "Dependencies point one
way"), and the simulator needs nothing of the live module but the rule itself. The two must agree:
`tests/test_sim_contended.py` feeds both the same queue views and compares their actions.

Times are the simulation's seconds. Costs are the server's own: a decode iteration of `rows` rows
costs `decode_fixed + decode_per_row * rows` and a prefill of `tokens` tokens `prefill(tokens)`, the
shapes the live engine fits to its measured run times (`swarm.linear_fit`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

IDLE, WAIT, DECODE, PREFILL = "idle", "wait", "decode", "prefill"


@dataclass(frozen=True)
class RulePolicy:
    """`server.step_scheduler.SchedulerPolicy`'s knobs, with the live server's defaults."""

    batch_wait: float = 0.002  # seconds a decode step waits for others to batch with (--batch-wait-ms)
    max_batch_rows: int = 64
    max_prefill_skips: int = 8
    max_prefill_wait: float = 0.5
    max_decode_wait: float = 0.2

    def __post_init__(self) -> None:
        if not self.batch_wait >= 0 or self.max_batch_rows < 1 or self.max_prefill_skips < 0:
            raise ValueError("batch_wait must be >= 0, max_batch_rows >= 1 and max_prefill_skips >= 0")
        if not (self.max_prefill_wait >= 0 and self.max_decode_wait >= 0):
            raise ValueError("the rule's wait caps must be >= 0")


@dataclass(frozen=True)
class View:
    """The queue as the rule sees it (field for field `server.step_scheduler.QueueView`)."""

    now: float
    decode_rows: int = 0
    decode_oldest: float | None = None
    decode_sessions: int = 0
    decode_expected: int = 0
    decode_ahead_max: int = 0
    decode_ahead_rows: int = 0
    prefill_tokens: int = 0
    prefill_oldest: float | None = None
    prefill_skips: int = 0
    prefill_started: bool = False


@dataclass(frozen=True)
class RuleCosts:
    decode_fixed: float
    decode_per_row: float
    prefill: Callable[[int], float]


def decide(view: View, costs: RuleCosts, policy: RulePolicy) -> tuple[str, float]:
    """(action, seconds to wait for WAIT); the same branches in the same order as the live rule."""
    has_decode = view.decode_rows > 0 and view.decode_oldest is not None
    has_prefill = view.prefill_oldest is not None
    if not has_decode and not has_prefill:
        return IDLE, 0.0
    if not has_decode:
        return PREFILL, 0.0
    decode_age = view.now - view.decode_oldest
    everyone_here = 0 < view.decode_expected <= view.decode_sessions
    full = view.decode_rows >= policy.max_batch_rows or everyone_here
    window_left = 0.0 if full else policy.batch_wait - decode_age
    if has_prefill and view.prefill_started:
        if view.prefill_skips >= 1:
            return PREFILL, 0.0  # a chunk's turn: a decode iteration ran since its last chunk
        has_prefill = False
    if has_prefill:
        if view.prefill_skips >= policy.max_prefill_skips:
            return PREFILL, 0.0
        if view.now - view.prefill_oldest >= policy.max_prefill_wait:
            return PREFILL, 0.0
        if decode_age < policy.max_decode_wait and costs.prefill(view.prefill_tokens) < _decode_stage(
            view, costs
        ):
            return PREFILL, 0.0
    if window_left > 0:
        return WAIT, window_left
    return DECODE, 0.0


def _decode_stage(view: View, costs: RuleCosts) -> float:
    """`C_d` (eq. 43): the decode time still ahead of the waiting steps; one iteration if unknown."""
    if view.decode_ahead_max <= 0:
        return costs.decode_fixed + costs.decode_per_row * view.decode_rows
    rows_tokens = max(view.decode_ahead_rows, view.decode_rows)
    return costs.decode_fixed * view.decode_ahead_max + costs.decode_per_row * rows_tokens
