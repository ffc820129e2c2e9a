"""Output-length prediction for routing (TetriInfer-style, pure and bounded).

WS-RR's wait estimate (eq. 20) needs each running session's end, so its output length `l_out`. A
client rarely knows it: it declares `generate()`'s `max_new_tokens`, a cap that real answers often
stay far below (the Azure code trace: median 13 generated tokens). TetriInfer predicts output
lengths with a small classifier over 200-token buckets; we have no prompt text at the scheduler,
only the prompt's length and, optionally, a task label the client declares, so this predictor
learns the *distribution* of output lengths per log-spaced prompt-length bucket and per label from
finished sessions, and answers with a statistic of it (`OutputLengthPredictor`).

Bounded memory: a fixed number of histograms (global, one per prompt bucket, one per label and one
per label and prompt bucket, at most `MAX_LABELS` labels) of fixed size; no raw samples are kept.
Each histogram halves its counts once it holds `2 * window` observations, so old sessions fade and
the counters stay small.

`SessionLengthLearner` is the scheduler's side: what it may learn from a session's end report
(validated, clamped to the declared cap, at most one observation per routed session, and at most a
share of recent observations per client, so that one client cannot poison the model).
"""

from __future__ import annotations

import bisect
import math
import numbers
from collections import Counter, deque
from collections.abc import Hashable
from dataclasses import dataclass

import numpy as np

from llm_swarm.swarm.task_label import check_label

MAX_LENGTH = 1 << 20  # tokens: what a route request may declare (scheduler.service.grpc_api.MAX_TOKENS)
BUCKET_TOKENS = 200  # TetriInfer's output buckets: [0, 200), [200, 400), ...
NUM_OUTPUT_BUCKETS = 64  # the last 200-token bucket holds every length >= 12,600
NUM_PROMPT_BUCKETS = 21  # prompt lengths in [2^k, 2^(k+1)), k = 0..20 (2^20 = MAX_LENGTH)
MIN_OBSERVATIONS = 16  # a distribution with fewer observations answers nothing: fall back
MAX_LABELS = 64  # labels beyond these are not learned (their sessions count as unlabelled)
WINDOW = 4096  # a histogram halves its counts when it holds twice this many observations
STATISTICS = ("mean", "median")

# Output-length bins of the quantile histograms: one per length up to 32 tokens (short answers are
# common and their exact length matters), then 8 per octave (each at most ~9% wide) up to MAX_LENGTH.
_EXACT = 32
_BINS_PER_OCTAVE = 8
_EDGES = tuple(
    sorted(
        set(range(1, _EXACT + 1))
        | {math.ceil(_EXACT * 2 ** (k / _BINS_PER_OCTAVE)) for k in range(1, 15 * _BINS_PER_OCTAVE + 1)}
    )
)  # the lowest length of each bin; the last bin is [MAX_LENGTH, MAX_LENGTH]
NUM_BINS = len(_EDGES)


def _bin_range(k: int) -> tuple[int, int]:
    """Bin `k` holds lengths `low .. high - 1`."""
    return _EDGES[k], (_EDGES[k + 1] if k + 1 < NUM_BINS else MAX_LENGTH + 1)


def output_bucket(length: int) -> int:
    """TetriInfer's 200-token bucket of an output length (the last bucket is open-ended)."""
    return min(length // BUCKET_TOKENS, NUM_OUTPUT_BUCKETS - 1)


def prompt_bucket(length: int) -> int:
    """Log-spaced prompt-length bucket: `floor(log2(length))` (lengths >= 1)."""
    return min(length.bit_length() - 1, NUM_PROMPT_BUCKETS - 1)


def check_length(name: str, value: object, maximum: int = MAX_LENGTH) -> int:
    """A token count in [1, maximum] as an int; anything else (NaN, inf, negative, fractional, too
    large, not a number) raises ValueError naming `name`."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a whole number of tokens, got {value!r}")
    if isinstance(value, numbers.Integral):
        length = int(value)
    else:
        number = float(value)
        if not math.isfinite(number) or number != int(number):
            raise ValueError(f"{name} must be a whole, finite number of tokens, got {value!r}")
        length = int(number)
    if not 1 <= length <= maximum:
        raise ValueError(f"{name} must be in 1..{maximum} tokens, got {length}")
    return length


class _Histogram:
    """Counts of output lengths: quantile bins, 200-token buckets, and their sum (for the mean)."""

    __slots__ = ("bins", "buckets", "total", "length_sum")

    def __init__(self) -> None:
        self.bins = np.zeros(NUM_BINS)
        self.buckets = np.zeros(NUM_OUTPUT_BUCKETS)
        self.total = 0.0
        self.length_sum = 0.0

    def add(self, length: int, window: int) -> None:
        self.bins[bisect.bisect_right(_EDGES, length) - 1] += 1
        self.buckets[output_bucket(length)] += 1
        self.total += 1
        self.length_sum += length
        if self.total >= 2 * window:  # forget the older half, keeping the shape
            self.bins *= 0.5
            self.buckets *= 0.5
            self.total *= 0.5
            self.length_sum *= 0.5

    def quantile(self, mass: float) -> int:
        """The length below which `mass` of the observations lie (0 < mass <= total): the bin that
        holds it spreads its count evenly over its lengths `low .. high - 1` (length `x` over
        `[x, x + 1)`), so a one-length bin answers exactly."""
        cumulative = np.cumsum(self.bins)
        k = min(int(np.searchsorted(cumulative, mass, side="left")), NUM_BINS - 1)
        while self.bins[k] == 0 and k > 0:  # rounding put `mass` past the last occupied bin
            k -= 1
        low, high = _bin_range(k)
        before = cumulative[k - 1] if k > 0 else 0.0
        fraction = min(max((mass - before) / self.bins[k], 0.0), 1.0)
        return max(math.ceil(low + fraction * (high - low)) - 1, low)

    def mean(self) -> float:
        return self.length_sum / self.total

    def mean_beyond(self, generated: int) -> float | None:
        """E[length | length > generated], each bin's count spread evenly over its lengths; None when
        no observation is that long."""
        mass = weighted = 0.0
        for k in range(bisect.bisect_right(_EDGES, generated) - 1, NUM_BINS):
            count = self.bins[k]
            if count <= 0:
                continue
            low, high = _bin_range(k)
            low = max(low, generated + 1)  # only the part of the bin above `generated`
            if low >= high:
                continue
            share = count * (high - low) / (_bin_range(k)[1] - _bin_range(k)[0])
            mass += share
            weighted += share * (low + high - 1) / 2
        return weighted / mass if mass > 0 else None

    def likeliest_bucket(self) -> int:
        return int(np.argmax(self.buckets))  # ties: the shorter bucket


@dataclass(frozen=True)
class LengthPrediction:
    length: int  # tokens the session is expected to generate (the predictor's statistic, capped)
    bucket: int  # the likeliest 200-token bucket: lengths [200 * bucket, 200 * (bucket + 1))
    source: str  # the distribution that answered: label+prompt, label, prompt, global or constant
    observations: float  # how many (decayed) observations that distribution holds


class OutputLengthPredictor:
    """Learns output lengths from finished sessions; predicts a new session's from its prompt length
    and optional task label.

    The most specific distribution with at least `min_observations` answers: the label's within the
    prompt bucket, the label's, the prompt bucket's, everyone's, else `default` (the scheduler's
    `--l-out`). The label comes before the prompt length: tasks (code completion, chat, summaries)
    differ far more in answer length than prompts of one task do.

    `statistic`: "mean" (default) or "median". The mean is what minimises WS-RR's waiting error.
    A request waits when its chain is full, until enough of the sessions ahead of it ended; in a
    busy period those are many sessions in turn, so its wait is a *sum* of their run times, and the
    expected sum is the sum of the means, whatever the distribution. Output lengths are heavy-tailed
    (code trace: median 13, mean 28, p99 251 tokens), so a median undercounts every sum: on the
    code trace's second half (`benchmarks/scheduling/length_prediction.py`, BENCHMARKS.md) the waits WS-RR
    told were off by 5.7 s on average with the median and 2.5 s with the mean (measured waits
    7-8 s; the constant 128: 71 s). A mean is easier to pull by lying reports than a median (one
    report at the cap moves it by cap / n); `SessionLengthLearner` bounds that (clamped to the
    declared cap, a bounded share per client), and a wrong length only moves wait estimates and
    chain choices: admission counts cache slots.
    """

    def __init__(
        self,
        default: int = 128,
        statistic: str = "mean",
        min_observations: int = MIN_OBSERVATIONS,
        window: int = WINDOW,
        max_labels: int = MAX_LABELS,
    ):
        self.default = check_length("default", default)
        if statistic not in STATISTICS:
            raise ValueError(f"statistic must be one of {', '.join(STATISTICS)}, got {statistic!r}")
        if not (isinstance(min_observations, int) and min_observations >= 1):
            raise ValueError(f"min_observations must be a positive int, got {min_observations!r}")
        if not (isinstance(window, int) and window >= min_observations):
            raise ValueError(f"window must be an int >= min_observations, got {window!r}")
        if not (isinstance(max_labels, int) and 0 <= max_labels <= 1024):
            raise ValueError(f"max_labels must be an int in 0..1024, got {max_labels!r}")
        self.statistic, self.min_observations = statistic, min_observations
        self.window, self.max_labels = window, max_labels
        # key: (label or None, prompt bucket or None); (None, None) is everyone's
        self._cells: dict[tuple[str | None, int | None], _Histogram] = {}
        self._labels: set[str] = set()
        self.observations = 0  # accepted since creation (not decayed)

    @property
    def labels(self) -> frozenset[str]:
        return frozenset(self._labels)

    @property
    def num_histograms(self) -> int:
        """At most `(1 + max_labels) * (1 + NUM_PROMPT_BUCKETS)`."""
        return len(self._cells)

    def observe(self, l_in: int, l_out: int, label: str | None = None) -> None:
        """A session with an `l_in`-token prompt generated `l_out` tokens (ValueError if either is not
        a token count in 1..MAX_LENGTH, or the label is not one)."""
        bucket = prompt_bucket(check_length("l_in", l_in))
        length = check_length("l_out", l_out)
        label = check_label(label)
        if label is not None and label not in self._labels:
            if len(self._labels) >= self.max_labels:
                label = None  # bounded: later labels are learned as unlabelled sessions
            else:
                self._labels.add(label)
        keys = [(None, None), (None, bucket)]
        if label is not None:
            keys += [(label, None), (label, bucket)]
        for key in keys:
            cell = self._cells.get(key)
            if cell is None:
                cell = self._cells[key] = _Histogram()
            cell.add(length, self.window)
        self.observations += 1

    def predict(self, l_in: int, label: str | None = None, cap: int | None = None) -> LengthPrediction:
        """The expected output length of a new session; `cap` (its declared `max_new_tokens`) bounds it."""
        bucket = prompt_bucket(check_length("l_in", l_in))
        label = check_label(label)
        limit = MAX_LENGTH if cap is None else check_length("cap", cap)
        candidates = []
        if label is not None:
            candidates += [("label+prompt", (label, bucket)), ("label", (label, None))]
        candidates += [("prompt", (None, bucket)), ("global", (None, None))]
        for source, key in candidates:
            cell = self._cells.get(key)
            if cell is not None and cell.total >= self.min_observations:
                value = cell.quantile(cell.total / 2) if self.statistic == "median" else round(cell.mean())
                length = min(max(value, 1), limit)
                bucket_now = min(cell.likeliest_bucket(), output_bucket(limit))
                return LengthPrediction(length, bucket_now, source, cell.total)
        length = min(self.default, limit)
        return LengthPrediction(length, output_bucket(length), "constant", 0.0)

    def predict_remaining(
        self, l_in: int, generated: int, label: str | None = None, cap: int | None = None
    ) -> int:
        """Tokens a running session is still expected to generate, given it has generated `generated`
        (>= 0) of at most `cap`: the mean residual length of the distribution `predict` would use,
        E[length - generated | length > generated] (heavy tails: a session already long is expected
        to run on, not to stop at the mean). Without a distribution, or past every observation: what
        the cap leaves (as if nothing were known). At least 1, at most `cap - generated`."""
        bucket = prompt_bucket(check_length("l_in", l_in))
        label = check_label(label)
        limit = MAX_LENGTH if cap is None else check_length("cap", cap)
        if not (isinstance(generated, int) and 0 <= generated):
            raise ValueError(f"generated must be a count of tokens >= 0, got {generated!r}")
        room = max(limit - generated, 1)
        keys = [(label, bucket), (label, None)] if label is not None else []
        for key in [*keys, (None, bucket), (None, None)]:
            cell = self._cells.get(key)
            if cell is not None and cell.total >= self.min_observations:
                beyond = cell.mean_beyond(generated)
                if beyond is None:
                    return room
                return min(max(round(beyond - generated), 1), room)
        return room


# -- the scheduler's side: learning from end reports ---------------------------------------------------

CLIENT_WINDOW = 256  # recent ended sessions the per-client share is counted over
CLIENT_SHARE = 0.125  # one client's learned observations among them at most


class SessionLengthLearner:
    """What a scheduler learns from sessions it routed when their clients report the end.

    A report is a claim: `tokens` (decode steps after the first, `SessionRef.tokens`) may be
    anything a client sends. So an ended session teaches at most one observation, only if the
    scheduler routed and admitted it (the caller checks), with `l_out = tokens + 1` clamped to the
    `l_out` it declared when routed (its `max_new_tokens`: the session could not generate more), and
    only while its client holds less than `share` of the observations among the last `window` ended
    sessions. A report of 0 tokens counts as a one-token answer only if the client also reported a
    first-token time; a negative or non-integral one teaches nothing.

    So a lying client moves the mean by at most `share x` its declared cap (fewer than `1 / share`
    clients: each holds at most its fair part). Client ids are themselves claims: the share bounds a
    client that keeps its id, and the scheduler's per-client and total session limits bound how many
    ids one can use at once. Whatever is learned moves only wait estimates and chain choices (as the
    declared `l_out` did before); admission counts cache slots.
    """

    def __init__(
        self,
        predictor: OutputLengthPredictor | None = None,
        window: int = CLIENT_WINDOW,
        share: float = CLIENT_SHARE,
    ):
        if not (isinstance(window, int) and window >= 1) or not 0 < share <= 1:
            raise ValueError(f"need window >= 1 and 0 < share <= 1, got {window!r}, {share!r}")
        self.predictor = predictor or OutputLengthPredictor()
        self.window, self.share = window, share
        self._recent: deque[tuple[Hashable, bool]] = deque()  # (client, learned) of the last ended sessions
        self._learned_by_client: Counter[Hashable] = Counter()

    def l_out_for(self, l_in: int, declared_l_out: int, label: str | None = None) -> int:
        """The output length to route a new session by: the prediction, at most what it declared."""
        return self.predictor.predict(l_in, label, cap=declared_l_out).length

    def session_ended(
        self,
        client_id: Hashable,
        l_in: int,
        declared_l_out: int,
        tokens: object,
        ttft: object = 0.0,
        label: str | None = None,
    ) -> bool:
        """An admitted session of `client_id` that declared `l_in`/`declared_l_out` ended, reporting
        `tokens` decode steps after its first; returns whether it taught the predictor."""
        length = _reported_length(tokens, ttft)
        learned = False
        if length is not None and self._learned_by_client[client_id] < self.share * self.window:
            try:
                self.predictor.observe(l_in, min(length, declared_l_out), label)
                learned = True
            except ValueError:  # declared lengths are checked at routing; a bad label is not learned
                learned = False
        self._recent.append((client_id, learned))
        if learned:
            self._learned_by_client[client_id] += 1
        if len(self._recent) > self.window:
            old_client, old_learned = self._recent.popleft()
            if old_learned:
                self._learned_by_client[old_client] -= 1
                if self._learned_by_client[old_client] <= 0:
                    del self._learned_by_client[old_client]
        return learned


def _reported_length(tokens: object, ttft: object) -> int | None:
    """Generated tokens from an end report (eq. 1: a prefill then `l_out - 1` decode steps), or None."""
    if isinstance(tokens, bool) or not isinstance(tokens, numbers.Integral) or not 0 <= tokens < MAX_LENGTH:
        return None
    if tokens == 0:
        ran = isinstance(ttft, numbers.Real) and math.isfinite(ttft) and ttft > 0
        return 1 if ran else None  # proto3 sends 0 for "not reported" too
    return int(tokens) + 1
