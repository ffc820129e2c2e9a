"""What a session's handler waits for: the client's next request on the session stream, or a step
its predecessor pushed (chain sessions), whichever comes first."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

from hivemind.proto import runtime_pb2


class SessionIdle(TimeoutError):
    """Nothing came within the session's idle timeout."""


class SessionLifetimeOver(TimeoutError):
    """The session reached its lifetime limit."""


class SessionInputs:
    def __init__(self, requests: AsyncIterator[runtime_pb2.ExpertRequest], inbox: asyncio.Queue):
        self.requests, self.inbox = requests, inbox
        self._request: asyncio.Future | None = None  # the client's next request, read across waits

    async def next(
        self, idle_timeout: float, ends_at: float, pushes: bool = True
    ) -> tuple[str, object] | None:
        """`("request", ExpertRequest)` or `("push", (PushedStep, tensors))`; None once the client
        ended its side. `pushes`: False waits for the client alone (pushes keep meanwhile).
        Raises SessionIdle or SessionLifetimeOver."""
        left = ends_at - time.monotonic()
        if pushes and not self.inbox.empty():
            return "push", self.inbox.get_nowait()
        if self._request is None:
            self._request = asyncio.ensure_future(anext(self.requests))
        waits = {self._request}
        pushed = asyncio.ensure_future(self.inbox.get()) if pushes else None
        if pushed is not None:
            waits.add(pushed)
        try:
            done, _ = await asyncio.wait(
                waits, timeout=min(idle_timeout, left), return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            if pushed is not None and not pushed.done():
                pushed.cancel()
        if pushed is not None and pushed in done:
            return "push", pushed.result()
        if self._request in done:
            request, self._request = self._request, None
            try:
                return "request", request.result()
            except StopAsyncIteration:
                return None
        if left <= idle_timeout:
            raise SessionLifetimeOver()
        raise SessionIdle()

    def close(self) -> None:
        if self._request is not None:
            self._request.cancel()
            with contextlib.suppress(BaseException):
                self._request.exception()
            self._request = None
