"""JFFC: Join-the-Fastest-Free-Chain load balancing (Sun, He and Hou, Alg. 3; docs/reference.md 3.4).

A small state machine for a discrete-event simulator or the scheduler: it decides, it does not keep
time. `arrive` returns the chain a new job starts on (or None: it joins the central FIFO queue);
`finish` frees a slot on a chain and returns the queued job that takes it over (if any).
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Hashable, Sequence


class JffcDispatcher:
    """Dispatch jobs over chains given as (service rate mu_k, capacity c_k), in a fixed order.

    "Fastest" is the largest mu_k; equal rates go to the lowest chain index (tie rule of docs/reference.md 3).
    """

    def __init__(self, chains: Sequence[tuple[float, int]]):
        if any(capacity < 0 for _, capacity in chains):
            raise ValueError("chain capacities must be non-negative")
        self._capacity = [capacity for _, capacity in chains]
        self._busy = [0] * len(chains)
        fastest_first = sorted(range(len(chains)), key=lambda k: -chains[k][0])  # stable: lowest index first
        self._rank = {chain: rank for rank, chain in enumerate(fastest_first)}
        self._free = [(self._rank[k], k) for k in range(len(chains)) if self._capacity[k] > 0]
        heapq.heapify(self._free)  # chains with a free slot, fastest on top
        self._queue: deque[Hashable] = deque()

    @property
    def queue_length(self) -> int:
        return len(self._queue)

    def busy(self, chain: int) -> int:
        """Jobs running on `chain` now."""
        return self._busy[chain]

    def arrive(self, job: Hashable) -> int | None:
        """A job arrives: the fastest chain with a free slot takes it, else it waits in the queue."""
        if not self._free:
            self._queue.append(job)
            return None
        _, chain = self._free[0]
        self._busy[chain] += 1
        if self._busy[chain] == self._capacity[chain]:
            heapq.heappop(self._free)
        return chain

    def finish(self, chain: int) -> Hashable | None:
        """A job on `chain` completed: the head of the queue starts there (returned), or the slot frees."""
        if self._busy[chain] == 0:
            raise ValueError(f"chain {chain} has no running job")
        if self._queue:
            return self._queue.popleft()
        if self._busy[chain] == self._capacity[chain]:
            heapq.heappush(self._free, (self._rank[chain], chain))
        self._busy[chain] -= 1
        return None
