"""What the simulator's WS-RR knows of a request's output length (`--length-info`).

The engine always runs a request for its true `l_out`; this only sets the `l_out` routing and the
wait estimates (eq. 20) use, so the simulator can be given what a live client has:

- `oracle`: the true length (the papers' simulator assumes it);
- `constant:N`: N for every request (a scheduler told nothing: its `--l-out`, default 128);
- `max-new-tokens`: what the client declares, its cap on the answer: `--max-l-out` when given,
  else `TRACE_MAX_NEW_TOKENS` for a trace replay; a Poisson request's `l_out` (it asks for exactly
  that many tokens);
- `predicted`: `swarm.length_prediction`'s mean for the request's prompt length, capped as
  `max-new-tokens`, learned online from the requests that finished so far (the constant `--l-out`
  until enough have); a caller may hand in a warm-started predictor.
"""

from __future__ import annotations

from typing import Protocol

from llm_swarm.scheduler.sim.workload import Request
from llm_swarm.swarm.length_prediction import OutputLengthPredictor

LENGTH_INFO = ("oracle", "constant:N", "max-new-tokens", "predicted")
# What a client replaying the Azure code trace declares as max_new_tokens: its longest answer is
# 1,899 tokens, and 2,048 is the usual round cap above that.
TRACE_MAX_NEW_TOKENS = 2048


class LengthSource(Protocol):
    def estimate(self, request: Request) -> int:
        """The `l_out` WS-RR routes `request` by (>= 1)."""

    def observe(self, request: Request) -> None:
        """`request` finished: its true length is now known to the scheduler."""


class OracleLengths:
    def estimate(self, request: Request) -> int:
        return request.l_out

    def observe(self, request: Request) -> None:
        pass


class ConstantLengths:
    def __init__(self, length: int):
        self.length = length

    def estimate(self, request: Request) -> int:
        return self.length

    def observe(self, request: Request) -> None:
        pass


class DeclaredLengths:
    """The client's declared cap (`cap`; None: the request's own `l_out`, a fixed-length workload)."""

    def __init__(self, cap: int | None):
        self.cap = cap

    def estimate(self, request: Request) -> int:
        return request.l_out if self.cap is None else self.cap

    def observe(self, request: Request) -> None:
        pass


class PredictedLengths(DeclaredLengths):
    """The predictor's answer for the request's prompt length, at most the declared cap; it learns
    every finished request's true length (what its client reports at the end)."""

    def __init__(self, predictor: OutputLengthPredictor, cap: int | None):
        super().__init__(cap)
        self.predictor = predictor

    def estimate(self, request: Request) -> int:
        return self.predictor.predict(request.l_in, cap=super().estimate(request)).length

    def observe(self, request: Request) -> None:
        self.predictor.observe(request.l_in, request.l_out)


def check_length_info(spec: str) -> None:
    """ValueError unless `spec` is one of `LENGTH_INFO` (`constant:N` with an int N >= 1)."""
    if spec in ("oracle", "max-new-tokens", "predicted"):
        return
    if spec.startswith("constant:"):
        value = spec.removeprefix("constant:")
        if value.isdigit() and int(value) >= 1:
            return
    raise ValueError(f"--length-info must be one of {', '.join(LENGTH_INFO)} (N >= 1), got {spec!r}")


def length_source(spec: str, default_l_out: int, cap: int | None) -> LengthSource | None:
    """The source `spec` names; None for `oracle` (WS-RR then knows every length exactly).

    `default_l_out`: the scheduler's `--l-out` (the predictor's answer until it learned enough);
    `cap`: what clients declare as max_new_tokens (None: each request's own `l_out`).
    """
    check_length_info(spec)
    if spec == "oracle":
        return None
    if spec.startswith("constant:"):
        return ConstantLengths(int(spec.removeprefix("constant:")))
    if spec == "max-new-tokens":
        return DeclaredLengths(cap)
    return PredictedLengths(OutputLengthPredictor(default=default_l_out), cap)
