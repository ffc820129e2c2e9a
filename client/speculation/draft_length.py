"""How many draft tokens to verify per round trip: a cost model fed by what the session measures.

Pure arithmetic (no torch, no clocks): the caller reports what it measured and asks for `k`.

A round of speculative decoding drafts `k` tokens locally (assistant model or prompt lookup), then
sends the last accepted token plus the `k` drafts through the swarm in one step of `k + 1` tokens.
If each draft token is accepted with probability `a` (independently, until the first rejection),
the round yields on average

    E(k) = 1 + a + a^2 + ... + a^k = (1 - a^(k+1)) / (1 - a)

tokens (the target's own token after the last accepted draft always counts), and costs

    T(k) = step(k + 1) + draft(k),   draft(0) = 0,

where `step(n) = fixed + per_token * n` is the measured time of a session step of `n` tokens (the
chain's round trips are `fixed`; the servers' extra work per verified token is `per_token`) and
`draft(k)` the measured time to draft `k` tokens. `k` is chosen to maximise the token rate
`E(k) / T(k)` over `0..max_draft`; `k = 0` is plain decoding (one token per step) and is chosen
whenever no draft length beats it, e.g. when drafts are rarely accepted or drafting costs more than
the round trip it saves.

The acceptance `a` is estimated from the rounds so far: accepted draft tokens count as successes
and a round's first rejection as one failure, with older rounds discounted by `memory` per round
(so the estimate follows a text whose predictability changes) and a prior worth `prior_rounds`
rounds at `initial_acceptance`. While speculation is off, no round says anything about `a`, so
every `probe_every` rounds one probe drafts a single token; each probe that fails doubles the
interval (up to `max_probe_every`), one that succeeds resets it.
"""

from __future__ import annotations

from dataclasses import dataclass

from llm_swarm.swarm.linear_fit import LinearCost, LinearFit


@dataclass(frozen=True)
class DraftLengthOptions:
    """How the draft length is chosen. `adaptive=False` keeps `transformers`' own schedule for one
    sequence (the assistant's `num_assistant_tokens` and its schedule, or `prompt_lookup_num_tokens`);
    the batched loop then drafts that many tokens every round."""

    adaptive: bool = True
    max_draft: int = 16  # never verify more than this many drafts per step
    first_draft: int = 4  # before any round was measured
    initial_acceptance: float = 0.5
    prior_rounds: float = 2.0
    memory: float = 0.9  # weight of a round's evidence after each later round
    probe_every: int = 4  # rounds of plain decoding between probes while speculation pays nothing
    max_probe_every: int = 64

    def __post_init__(self) -> None:
        if self.max_draft < 1 or self.first_draft < 0 or self.first_draft > self.max_draft:
            raise ValueError("need max_draft >= 1 and 0 <= first_draft <= max_draft")
        if not 0.0 < self.initial_acceptance < 1.0 or self.prior_rounds <= 0:
            raise ValueError("initial_acceptance must lie in (0, 1) and prior_rounds be positive")
        if not 0.0 < self.memory <= 1.0:
            raise ValueError("memory must lie in (0, 1]")
        if not 1 <= self.probe_every <= self.max_probe_every:
            raise ValueError("need 1 <= probe_every <= max_probe_every")


def expected_tokens(acceptance: float, k: int) -> float:
    """`E(k)`: tokens a round yields on average when each draft is accepted with `acceptance`."""
    if acceptance >= 1.0:
        return float(k + 1)
    return (1.0 - acceptance ** (k + 1)) / (1.0 - acceptance)


def best_draft_length(acceptance: float, step: LinearCost, draft: LinearCost, max_draft: int) -> int:
    """The `k` in `0..max_draft` with the highest `E(k) / T(k)` (ties: the shorter draft)."""
    best_k, best_rate = 0, 1.0 / max(step(1), 1e-9)
    for k in range(1, max_draft + 1):
        seconds = step(k + 1) + draft(k)
        rate = expected_tokens(acceptance, k) / max(seconds, 1e-9)
        if rate > best_rate * (1.0 + 1e-9):
            best_k, best_rate = k, rate
    return best_k


class DraftLength:
    """The running estimate for one generation: feed it measurements, ask it for `k`."""

    def __init__(self, options: DraftLengthOptions, step_costs: LinearFit | None = None):
        self.options = options
        # the session's measured step times (shared across generate() calls in one session)
        self.step_costs = step_costs if step_costs is not None else LinearFit(LinearCost(0.0, 1e-3))
        self.draft_costs = LinearFit(LinearCost(0.0, 0.0))
        self.successes = options.prior_rounds * options.initial_acceptance
        self.failures = options.prior_rounds * (1.0 - options.initial_acceptance)
        self.rounds = 0
        self.drafted = 0
        self.accepted = 0
        self.rejections = 0  # rounds that ended at a rejected draft
        self._off_rounds = 0
        self._probe_every = options.probe_every
        self._probing = False

    @property
    def acceptance(self) -> float:
        """The current estimate of a draft token's acceptance probability."""
        return self.successes / (self.successes + self.failures)

    @property
    def acceptance_rate(self) -> float:
        """Measured: accepted draft tokens over drafted ones (0 before any draft). Drafts after the
        first rejection of a round count as drafted and not accepted."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def token_acceptance(self) -> float:
        """Measured, per token: the chance that a draft token which was actually compared is accepted
        (accepted / (accepted + rejections)); the `a` of the cost model, undiscounted."""
        compared = self.accepted + self.rejections
        return self.accepted / compared if compared else 0.0

    def observe_step(self, tokens: int, seconds: float) -> None:
        """A session step of `tokens` new tokens took `seconds` (plain, verification or prefill)."""
        self.step_costs.observe(tokens, seconds)

    def observe_draft(self, tokens: int, seconds: float) -> None:
        if tokens > 0:
            self.draft_costs.observe(tokens, seconds)

    def observe_round(self, drafted: int, accepted: int) -> None:
        """A round verified `drafted` drafts, of which the first `accepted` were accepted."""
        if drafted <= 0:  # nothing drafted (prompt lookup found no match): no evidence
            self._probing = False
            return
        accepted = max(0, min(accepted, drafted))
        memory = self.options.memory
        self.successes = self.successes * memory + accepted
        self.failures = self.failures * memory + (1.0 if accepted < drafted else 0.0)
        self.rounds += 1
        self.drafted += drafted
        self.accepted += accepted
        self.rejections += accepted < drafted
        if self._probing:
            self._probing = False
            if accepted == 0:
                self._probe_every = min(self._probe_every * 2, self.options.max_probe_every)
            else:
                self._probe_every = self.options.probe_every

    def choose(self, limit: int | None = None) -> int:
        """The draft length for the next round, at most `limit` (e.g. the tokens still wanted)."""
        cap = self.options.max_draft if limit is None else max(0, min(limit, self.options.max_draft))
        if cap == 0 or not self.options.adaptive:
            return cap
        if self.rounds == 0 and self.options.first_draft:
            return min(self.options.first_draft, cap)
        k = best_draft_length(self.acceptance, self.step_costs.cost(), self.draft_costs.cost(), cap)
        if k > 0:
            self._off_rounds = 0
            return k
        self._off_rounds += 1
        if self._off_rounds >= self._probe_every:
            self._off_rounds = 0
            self._probing = True
            return 1
        return 0
