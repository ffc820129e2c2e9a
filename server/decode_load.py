"""How much a server's decode step slows down per session decoding on it at the same time (announced
as `ServerInfo.tau_per_session`).

The `tau` a server announces is measured alone, at start. Under load its steps take longer: a
batched forward costs more per row, a step that arrives while another session's iteration runs
waits for it, and every session's step costs the server's own process some work (decoding the
request, checks, the reply). Measured as clients see it, per token: on one H100, 6 ms with one
session against 13 ms with four (BENCHMARKS.md, "Batching concurrent sessions on one server, on a
GPU"); on the emulated swarm, a session's time per token grew by about 20 ms for each other session
decoding on its server. WS-RR with the idle `tau` alone sends every session to the alike server that
happened to measure the lowest `tau` until its cache is full.

So the server fits, online, `step seconds = fixed + per_session * n` over its decode steps (each
step's time from its arrival at the compute queue to its output, over the server's blocks; `n` the
sessions that sent a decode step within `horizon` seconds, this one included) and announces
`per_session / blocks`. Nothing is announced until `min_steps` steps were measured with at least two
different `n`. Pure bookkeeping: the caller passes the clock's readings.
"""

from __future__ import annotations

from llm_swarm.swarm.linear_fit import LinearCost, LinearFit

HORIZON_S = 0.5  # a session that sent no decode step for this long no longer counts as decoding
MIN_STEPS = 50  # measured steps before anything is announced
DECAY = 0.995  # each step's weight in the fit: about the last 200 steps count
MAX_TRACKED = 4096  # sessions remembered at once (bounded: entries older than the horizon go first)


class DecodeLoad:
    """The online fit of decode step time against concurrent decoding sessions (module docstring)."""

    def __init__(self, horizon: float = HORIZON_S, min_steps: int = MIN_STEPS):
        self.horizon, self.min_steps = horizon, min_steps
        # the prior (no slowdown) only keeps the fit defined; a few real steps outweigh it
        self._fit = LinearFit(LinearCost(0.0, 0.0), decay=DECAY, prior_weight=1e-6, prior_span=2.0)
        self._last_step: dict[str, float] = {}  # session id -> when its last decode step arrived
        self._counts: set[int] = set()  # the different `n` measured (at most a few)

    def decoding(self, session_id: str, now: float) -> int:
        """A decode step of `session_id` arrives at `now`: the sessions decoding here, it included."""
        # re-inserted, so the dict stays oldest first: the stale ones are dropped from its front (every
        # decode step comes here: no pass over all sessions)
        self._last_step.pop(session_id, None)
        self._last_step[session_id] = now
        while self._last_step:
            oldest = next(iter(self._last_step))
            if now - self._last_step[oldest] <= self.horizon and len(self._last_step) <= MAX_TRACKED:
                break
            del self._last_step[oldest]  # quiet for the horizon, or more sessions than any server decodes
        return len(self._last_step)

    def observe(self, sessions: int, seconds: float) -> None:
        """One decode step took `seconds` while `sessions` sessions were decoding here."""
        if sessions < 1 or not seconds >= 0:
            return
        self._fit.observe(sessions, seconds)
        if len(self._counts) < 2:
            self._counts.add(sessions)

    def forget(self, session_id: str) -> None:
        """The session ended: it no longer counts as decoding."""
        self._last_step.pop(session_id, None)

    def tau_per_session(self, num_blocks: int) -> float | None:
        """Seconds per block per token each other decoding session adds here; None until measured."""
        if self._fit.observations < self.min_steps or len(self._counts) < 2 or num_blocks < 1:
            return None
        return self._fit.cost().per_unit / num_blocks
