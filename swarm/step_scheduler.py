"""What a server's compute thread runs next: a batch of decode steps, a waiting prefill, or nothing yet.
The live engine (`server/engine.py`) and the contended simulator (`scheduler/sim/contended.py`) both
decide by this one rule.

Pure decision logic (no I/O, no torch, no clocks of its own), so that the rule can be tested on
hand-computed cases and reasoned about apart from threads and tensors.

The rule follows the online iteration scheduling of Pang et al. (the "Lagrangian" heuristic, eqs.
41-43): at every iteration compare the cost of inserting a prefill stage, `C_p = sum_l T^p_l` (the
time the prefill takes), with the decode time it would preempt, `C_d = T^d * sum_i N^d_i w_i` (eq.
43: the decode work still ahead of the sessions waiting to decode). If `C_p < C_d` the prefill is
cheap next to the decoding it interrupts, so it is inserted now (its session then joins the decode
batches, which costs little more per iteration); otherwise decoding goes on and the prefill waits,
e.g. when the decoders are about to finish and the prefill would delay every one of them for
little gain. `N^d_i` is what session i may still decode: the positions its cache reserves past
its current one (an upper bound: the server cannot know when a client stops early). With the
fitted per-iteration cost `fixed + per_row * rows`, decoding those tokens takes
`C_d = fixed * max_i N^d_i + per_row * sum_i rows_i N^d_i` (iterations shrink as sessions end);
when `N^d_i` is unknown, `C_d` is one iteration. Because an expensive prefill could lose this
comparison for a long time, and a stream of cheap prefills could hold decoding up, two caps bound
the waits: a prefill runs once it was passed over `max_prefill_skips` decode iterations or waited
`max_prefill_wait` seconds, and decoding runs once its oldest step waited `max_decode_wait`.

A chunked prefill (`--prefill-chunk`) is inserted by the same rule, as a stage of one chunk. Once
its first chunk has run, its remaining chunks strictly alternate with decode iterations: a waiting
decode batch runs before the next chunk, and the next chunk runs after at most one decode
iteration. Without that, every chunk would again be "cheaper than the decoding ahead" and the
chunks would run back to back, stalling decoders as long as an unchunked prefill (up to
`max_decode_wait`); with it, a decoder waits at most one chunk, and the prompt at most one decode
iteration per chunk.

Decode steps are also batched over a short window (`batch_wait`): the first decode step that
arrives waits up to that long for others, unless the batch is already full or every session that
has been decoding lately on this block range is already in it (so a lone session, or sessions in
lockstep, never wait for nobody). While the compute thread is busy, steps pile up anyway, so under
load the window rarely costs anything.

Costs come from `LinearCost` fits of measured run times (seconds = fixed + per_unit * units, where a
unit is a decode row or a prefill token), updated after every run by the engine.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

from llm_swarm.swarm.linear_fit import LinearCost, LinearFit  # noqa: F401  (the engine and tests know them from here)


class Action(Enum):
    IDLE = "idle"  # nothing waits: sleep until a step arrives
    WAIT = "wait"  # decode steps wait for their batch to fill, for at most `Decision.wait` seconds
    DECODE = "decode"  # run the waiting decode steps (of one block range) as one batch
    PREFILL = "prefill"  # run the oldest waiting prefill (or multi-token step) alone


@dataclass(frozen=True)
class Decision:
    action: Action
    rule: str  # which part of the rule decided (a short tag, counted by the engine)
    wait: float = 0.0  # for WAIT: seconds until the decision should be taken again


@dataclass(frozen=True)
class SchedulerPolicy:
    batch_wait: float = 0.002  # seconds a decode step waits for others to batch with
    max_batch_rows: int = 64  # a decode batch this large runs without waiting further
    max_prefill_skips: int = 8  # decode iterations a waiting prefill may be passed over
    max_prefill_wait: float = 0.5  # seconds a prefill may wait behind decoding
    max_decode_wait: float = 0.2  # seconds decode steps may wait behind prefills

    def __post_init__(self) -> None:
        if not self.batch_wait >= 0 or self.max_batch_rows < 1 or self.max_prefill_skips < 0:
            raise ValueError("batch_wait must be >= 0, max_batch_rows >= 1 and max_prefill_skips >= 0")
        if not (self.max_prefill_wait >= 0 and self.max_decode_wait >= 0):
            raise ValueError("the rule's wait caps must be >= 0")


@dataclass(frozen=True)
class QueueView:
    """What waits, as the decision needs it. Times are on the caller's monotonic clock."""

    now: float
    decode_rows: int = 0  # rows of the decode batch that would run next (0: no decode step waits)
    decode_oldest: float | None = None  # arrival time of the oldest of those steps
    decode_sessions: int = 0  # sessions with a step in that batch
    decode_expected: int = 0  # sessions of that block range decoding lately (0: unknown)
    decode_ahead_max: int = 0  # most tokens one of those sessions may still decode (0: unknown)
    decode_ahead_rows: int = 0  # sum over their rows of the tokens each may still decode
    prefill_tokens: int = 0  # tokens (rows x new positions) of the oldest waiting prefill
    prefill_oldest: float | None = None  # its arrival time (None: no prefill waits)
    prefill_skips: int = 0  # decode iterations that ran while it waited (since its last chunk)
    prefill_started: bool = False  # it is a chunked prefill whose first chunk has run


@dataclass(frozen=True)
class CostModel:
    decode: LinearCost  # units: rows in the decode batch
    # seconds for a prefill of so many tokens: the engine's fit, or a simulated server's own cost
    prefill: Callable[[int], float]


def decide(view: QueueView, costs: CostModel, policy: SchedulerPolicy) -> Decision:
    """The next action for the compute thread (see the module docstring for the rule)."""
    has_decode = view.decode_rows > 0 and view.decode_oldest is not None
    has_prefill = view.prefill_oldest is not None
    if not has_decode and not has_prefill:
        return Decision(Action.IDLE, "idle")
    if not has_decode:
        return Decision(Action.PREFILL, "prefill-alone")
    decode_age = view.now - view.decode_oldest
    everyone_here = 0 < view.decode_expected <= view.decode_sessions
    full = view.decode_rows >= policy.max_batch_rows or everyone_here
    window_left = 0.0 if full else policy.batch_wait - decode_age
    if has_prefill and view.prefill_started:
        if view.prefill_skips >= 1:
            return Decision(Action.PREFILL, "chunk-turn")  # a decode iteration ran since its last chunk
        has_prefill = False  # decoding goes first; the window rule below still applies
    if has_prefill:
        prefill_age = view.now - view.prefill_oldest
        if view.prefill_skips >= policy.max_prefill_skips:
            return Decision(Action.PREFILL, "prefill-skips-cap")
        if prefill_age >= policy.max_prefill_wait:
            return Decision(Action.PREFILL, "prefill-wait-cap")
        if decode_age < policy.max_decode_wait:
            if costs.prefill(view.prefill_tokens) < decode_stage_cost(view, costs):
                return Decision(Action.PREFILL, "prefill-cheaper")  # C_p < C_d
    if window_left > 0:
        return Decision(Action.WAIT, "batch-window", wait=window_left)
    return Decision(Action.DECODE, "decode")


def decode_stage_cost(view: QueueView, costs: CostModel) -> float:
    """`C_d`: the decode time still ahead of the waiting decode steps (one iteration if unknown)."""
    if view.decode_ahead_max <= 0:
        return costs.decode(view.decode_rows)
    rows_tokens = max(view.decode_ahead_rows, view.decode_rows)
    return costs.decode.fixed * view.decode_ahead_max + costs.decode.per_unit * rows_tokens
