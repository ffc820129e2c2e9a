"""Admission of requests by how many generations they run (their choices: prompts times `n`).

A request that asks for k choices runs k generations at once, each in its own inference session, so
it counts k against `--max-concurrent` (generations running) and `--max-queued` (waiting beyond
those): more than that in flight gets 429 at once. Slots are taken all together and first come,
first served, so a wide request neither starves behind narrow ones nor holds half its slots while
waiting for the rest (two such requests could otherwise block each other forever).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import AsyncIterator

from llm_swarm.client.api.errors import ApiError


class GenerationSlots:
    def __init__(self, max_concurrent: int, max_queued: int):
        self.max_concurrent, self.max_queued = max_concurrent, max_queued
        self.admitted = 0  # generations running or waiting for a slot
        self.running = 0
        self._waiters: collections.deque[tuple[int, asyncio.Future]] = collections.deque()

    def enter(self, weight: int) -> None:
        """Count `weight` generations in, or raise 429 when the server already has as many in flight
        as it runs and queues. Each `enter` needs a `leave`."""
        if self.admitted + weight > self.max_concurrent + self.max_queued:
            raise ApiError(
                429, "too many requests in flight; retry later", "rate_limit_exceeded", "rate_limit_exceeded"
            )
        self.admitted += weight

    def leave(self, weight: int) -> None:
        self.admitted -= weight

    @contextlib.asynccontextmanager
    async def slots(self, weight: int) -> AsyncIterator[None]:
        """Hold `weight` generation slots for the body, waiting for them in turn."""
        await self._acquire(weight)
        try:
            yield
        finally:
            self.running -= weight
            self._wake()

    async def _acquire(self, weight: int) -> None:
        if not self._waiters and self.running + weight <= self.max_concurrent:
            self.running += weight
            return
        turn = asyncio.get_running_loop().create_future()
        entry = (weight, turn)
        self._waiters.append(entry)
        try:
            await turn
        except asyncio.CancelledError:
            if turn.done() and not turn.cancelled():  # granted just as the client left: give it back
                self.running -= weight
            else:
                self._waiters.remove(entry)
            self._wake()
            raise

    def _wake(self) -> None:
        while self._waiters and self.running + self._waiters[0][0] <= self.max_concurrent:
            weight, turn = self._waiters.popleft()
            self.running += weight
            turn.set_result(None)
