"""Planning a batch of prompts onto chains: makespan bin packing and its lower bound. Pure.

The input is `times[k, j]`, the estimated seconds job j costs a session slot of chain k (inf where it
cannot run, e.g. longer than the chain's servers accept; `chains.ChainSpeed.lane_seconds` charges a
job's prompt once per concurrent session, as a prompt stalls the others), and `slots[k]`, the sessions
chain k runs at once. Each slot is a *lane*, a machine of its own. Planning (Pang et al.'s offline
half) minimises the makespan, the time until the last lane is done:

- `lpt_plan`: longest job first (by its time on the fastest chain), each onto the lane where it
  would finish earliest (LPT for machines of different speeds), then local search that moves or
  swaps jobs off the lane that finishes last while that lowers it;
- `fcfs_plan`: what first-come-first-served does (the next job in input order goes to the lane that
  is free first), the baseline the benchmark compares with;
- `lower_bound`: no schedule can finish sooner than the longest job alone on its fastest chain, nor sooner
  than the fractional relaxation, in which jobs split across chains (the dual of that linear program,
  `max_y sum_j min_k y_k times[k, j]` over `y >= 0, sum_k slots[k] y_k = 1`, is "all the work over
  all the speed": with times proportional to one size per job, exactly total work / total speed).
  Any `y` gives a valid bound; two chains are solved exactly, more by mirror ascent.

`choose_steal` is the online half: the job an idle lane takes from a busier one.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

EPSILON = 1e-9
MAX_IMPROVE_ROUNDS = 2000  # local search's moves and swaps, at most: planning stays seconds at 100k jobs
MAX_SWAP_PAIRS = 200_000  # swaps are tried between two lanes only while their queues are this small


@dataclass(frozen=True)
class Plan:
    lane_chain: tuple[int, ...]  # the chain of each lane
    queues: tuple[tuple[int, ...], ...]  # job indices per lane, in the order they run
    loads: tuple[float, ...]  # estimated seconds of each lane's queue
    unplaceable: tuple[int, ...]  # jobs no chain can run

    @property
    def makespan(self) -> float:
        return max(self.loads, default=0.0)


@dataclass(frozen=True)
class LowerBound:
    longest_job: float  # the longest job, each on its fastest chain
    fractional: float  # every job's work spread over every lane (the LP relaxation's dual)

    @property
    def value(self) -> float:
        return max(self.longest_job, self.fractional)


def lanes_of(slots: Sequence[int]) -> tuple[int, ...]:
    """The chain of each lane: chain k contributes `slots[k]` lanes, in chain order."""
    if any(s < 1 for s in slots):
        raise ValueError(f"every chain needs at least one slot, got {list(slots)}")
    return tuple(k for k, count in enumerate(slots) for _ in range(count))


def _check(times: np.ndarray, slots: Sequence[int]) -> np.ndarray:
    times = np.asarray(times, dtype=float)
    if times.ndim != 2 or times.shape[0] != len(slots) or not len(slots):
        raise ValueError(f"times must be [chains, jobs] with one row per chain, got shape {times.shape}")
    if np.isnan(times).any() or (times < 0).any():
        raise ValueError("job times must be non-negative (inf: the chain cannot run the job)")
    return times


def placeable(times: np.ndarray) -> np.ndarray:
    """Indices of the jobs some chain can run."""
    return np.flatnonzero(np.isfinite(times).any(axis=0))


def _ordered(queue: list[int], lane_times: np.ndarray) -> tuple[int, ...]:
    """A lane's queue longest first: what is left at the end is short, and easy to steal."""
    return tuple(sorted(queue, key=lambda j: (-lane_times[j], j)))


def _plan(times: np.ndarray, lane_chain: tuple[int, ...], queues: list[list[int]]) -> Plan:
    loads = tuple(float(times[lane_chain[lane], queue].sum()) for lane, queue in enumerate(queues))
    missing = np.flatnonzero(~np.isfinite(times).any(axis=0))
    return Plan(
        lane_chain,
        tuple(_ordered(queue, times[lane_chain[lane]]) for lane, queue in enumerate(queues)),
        loads,
        tuple(int(j) for j in missing),
    )


def lpt_plan(times: np.ndarray, slots: Sequence[int], improve_rounds: int | None = None) -> Plan:
    """LPT onto the lanes, then local search (at most `improve_rounds` moves or swaps; default 4 per
    job, at most `MAX_IMPROVE_ROUNDS`)."""
    times = _check(times, slots)
    lane_chain = lanes_of(slots)
    lane_times = times[list(lane_chain)]  # [lanes, jobs]
    jobs = placeable(times)
    work = times[:, jobs].min(axis=0)
    order = jobs[np.lexsort((jobs, -work))]  # longest first; ties: input order
    loads = np.zeros(len(lane_chain))
    queues: list[list[int]] = [[] for _ in lane_chain]
    for j in order:
        finish = loads + lane_times[:, j]
        lane = int(np.argmin(finish))  # ties: the lowest lane, i.e. the fastest chain listed first
        loads[lane] = finish[lane]
        queues[lane].append(int(j))
    rounds = min(4 * len(jobs), MAX_IMPROVE_ROUNDS) if improve_rounds is None else improve_rounds
    for _ in range(rounds):
        if not _improve_once(lane_times, loads, queues):
            break
    return _plan(times, lane_chain, queues)


def _improve_once(lane_times: np.ndarray, loads: np.ndarray, queues: list[list[int]]) -> bool:
    """The best single move or swap of a job off the lane that finishes last, if one lowers that
    lane without raising the other to its level; True if one was made. Each change lowers the sorted
    list of loads, so repeating this ends."""
    critical = int(np.argmax(loads))
    top = loads[critical]
    mine = np.array(queues[critical], dtype=int)
    if not len(mine):
        return False
    best = (top - EPSILON, None)
    for other in range(len(loads)):
        if other == critical:
            continue
        # moves: job j leaves the critical lane for `other`
        after_critical = top - lane_times[critical, mine]
        after_other = loads[other] + lane_times[other, mine]
        worst = np.maximum(after_critical, after_other)
        k = int(np.argmin(worst))
        if worst[k] < best[0]:
            best = (float(worst[k]), ("move", other, int(mine[k]), None))
        theirs = np.array(queues[other], dtype=int)
        if not len(theirs) or len(mine) * len(theirs) > MAX_SWAP_PAIRS:
            continue
        # swaps: j (critical) with i (other)
        gain_critical = lane_times[critical, theirs][None, :] - lane_times[critical, mine][:, None]
        gain_other = lane_times[other, mine][:, None] - lane_times[other, theirs][None, :]
        worst = np.maximum(top + gain_critical, loads[other] + gain_other)
        a, b = np.unravel_index(int(np.argmin(worst)), worst.shape)
        if worst[a, b] < best[0]:
            best = (float(worst[a, b]), ("swap", other, int(mine[a]), int(theirs[b])))
    if best[1] is None:
        return False
    kind, other, job, swapped = best[1]
    queues[critical].remove(job)
    queues[other].append(job)
    loads[critical] -= lane_times[critical, job]
    loads[other] += lane_times[other, job]
    if kind == "swap":
        queues[other].remove(swapped)
        queues[critical].append(swapped)
        loads[other] -= lane_times[other, swapped]
        loads[critical] += lane_times[critical, swapped]
    return True


def fcfs_plan(times: np.ndarray, slots: Sequence[int]) -> Plan:
    """First come, first served: jobs in input order, each to the lane that is free first (ties: the
    lowest lane), whatever its speed; a job a lane cannot run goes to the first free one that can."""
    times = _check(times, slots)
    lane_chain = lanes_of(slots)
    lane_times = times[list(lane_chain)]
    loads = np.zeros(len(lane_chain))
    queues: list[list[int]] = [[] for _ in lane_chain]
    for j in placeable(times):
        free = np.where(np.isfinite(lane_times[:, j]), loads, math.inf)
        lane = int(np.argmin(free))
        loads[lane] += lane_times[lane, j]
        queues[lane].append(int(j))
    plan = _plan(times, lane_chain, queues)
    # FCFS runs each lane's jobs in input order, not longest first
    return Plan(plan.lane_chain, tuple(tuple(q) for q in queues), plan.loads, plan.unplaceable)


def lower_bound(times: np.ndarray, slots: Sequence[int], alone: np.ndarray | None = None) -> LowerBound:
    """A lower bound on any schedule's makespan (module docstring); placeable jobs only. `alone[k, j]`:
    job j's own duration on chain k where that is less than the lane time `times[k, j]` it is charged
    (a lane's time also counts the stalls its prompt causes the chain's other sessions)."""
    times = _check(times, slots)
    jobs = placeable(times)
    alone = times if alone is None else np.minimum(_check(alone, slots), times)
    times = times[:, jobs]
    if not times.shape[1]:
        return LowerBound(0.0, 0.0)
    longest = float(alone[:, jobs].min(axis=0).max())
    capacity = np.asarray(slots, dtype=float)
    if len(capacity) == 1:
        return LowerBound(longest, float(times.sum() / capacity[0]))
    if len(capacity) == 2:
        return LowerBound(longest, _two_chain_dual(times, capacity))
    return LowerBound(longest, _mirror_ascent_dual(times, capacity))


def _dual_value(times: np.ndarray, weights: np.ndarray, capacity: np.ndarray) -> float:
    """`sum_j min_k y_k t_kj` at `y_k = weights_k / capacity_k` (weights on the simplex: feasible)."""
    y = weights / capacity
    scaled = np.where(np.isfinite(times), times * y[:, None], math.inf)
    scaled = np.where((y[:, None] == 0) & np.isfinite(times), 0.0, scaled)
    return float(scaled.min(axis=0).sum())


def _two_chain_dual(times: np.ndarray, capacity: np.ndarray) -> float:
    """The exact dual optimum for two chains, in O(n log n): with weight w on the first chain it is
    `g(w) = sum_j min(w a_j, (1 - w) b_j)` plus the jobs only one chain runs, concave and piecewise
    linear with a break where job j costs the same on both (`w = b_j / (a_j + b_j)`); its maximum is
    at the break where the slope turns negative."""
    both = np.isfinite(times).all(axis=0)
    a, b = times[0, both] / capacity[0], times[1, both] / capacity[1]
    only_first = times[0, ~both & np.isfinite(times[0])].sum() / capacity[0]
    only_second = times[1, ~both & np.isfinite(times[1])].sum() / capacity[1]
    counted = a + b > 0  # a job free on both chains adds nothing anywhere
    a, b = a[counted], b[counted]
    order = np.argsort(b / (a + b))
    breaks, a, b = (b / (a + b))[order], a[order], b[order]
    # past i breaks (w just above breaks[i - 1]): jobs i.. still grow with w, jobs ..i-1 shrink
    a_after = np.concatenate([np.cumsum(a[::-1])[::-1], [0.0]])
    b_before = np.concatenate([[0.0], np.cumsum(b)])
    slope = only_first - only_second + a_after - b_before  # non-increasing in i
    turning = int(np.argmax(slope <= 0)) if (slope <= 0).any() else len(slope)
    w = 0.0 if turning == 0 else (1.0 if turning == len(slope) else float(breaks[turning - 1]))
    return float(np.minimum(w * a, (1 - w) * b).sum() + w * only_first + (1 - w) * only_second)


def _mirror_ascent_dual(times: np.ndarray, capacity: np.ndarray, iterations: int | None = None) -> float:
    """The dual by exponentiated supergradient ascent on the weights' simplex; the best value met
    (each is a valid bound, so stopping early only loosens it). Iterations: 3000, fewer for huge
    batches (about 2e7 job-chain evaluations in all)."""
    if iterations is None:
        iterations = max(100, min(3000, 20_000_000 // max(times.size, 1)))
    finite_rows = np.isfinite(times)
    per_chain = np.where(finite_rows, times, 0.0).sum(axis=1)
    # start where times proportional to one speed per chain would be optimal: weights ~ capacity x speed
    speed = capacity * finite_rows.sum(axis=1) / np.maximum(per_chain, EPSILON)
    weights = speed / speed.sum()
    best = _dual_value(times, weights, capacity)
    for step in range(1, iterations + 1):
        y = weights / capacity
        scaled = np.where(finite_rows, times * y[:, None], math.inf)
        winner = scaled.argmin(axis=0)
        value = float(scaled[winner, np.arange(times.shape[1])].sum())
        best = max(best, value)
        gradient = (
            np.bincount(winner, weights=times[winner, np.arange(times.shape[1])], minlength=len(capacity))
            / capacity
        )
        gradient /= max(np.abs(gradient).max(), EPSILON)
        weights = weights * np.exp(0.5 * gradient / math.sqrt(step))
        weights /= weights.sum()
    return max(best, _dual_value(times, weights, capacity))


def choose_steal(
    now: float,
    thief_chain: int,
    lane_chain: Sequence[int],
    queues: Sequence[Sequence[int]],
    busy_until: Sequence[float],
    times: np.ndarray,
) -> tuple[int, int] | None:
    """The (lane, job) an idle lane of `thief_chain` takes, or None.

    Lanes are tried from the one expected to finish last (`busy_until`: when its running job is
    expected to end; then its queue at its chain's speed); from it, the not-yet-started job with the
    most work that the thief finishes before that lane would have (so the pair ends sooner)."""
    finish = [
        max(busy_until[lane], now) + float(times[lane_chain[lane], list(queue)].sum())
        for lane, queue in enumerate(queues)
    ]
    victims = sorted(
        (lane for lane, queue in enumerate(queues) if queue), key=lambda lane: (-finish[lane], lane)
    )
    for victim in victims:
        own = times[lane_chain[victim]]
        for job in sorted(queues[victim], key=lambda j: (-own[j], j)):
            if now + times[thief_chain, job] < finish[victim] - EPSILON:
                return victim, job
    return None
