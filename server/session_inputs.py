"""What a session's handler waits for: the client's next request on the session stream, or a step
its predecessor pushed (chain sessions), whichever comes first."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable

from hivemind.proto import runtime_pb2


class SessionIdle(TimeoutError):
    """Nothing came within the session's idle timeout."""


class SessionLifetimeOver(TimeoutError):
    """The session reached its lifetime limit."""


class SessionInputs:
    def __init__(
        self,
        requests: AsyncIterator[runtime_pb2.ExpertRequest],
        inbox: asyncio.Queue,
        may_push: Callable[[], bool],
    ):
        self.requests, self.inbox = requests, inbox
        self.may_push = may_push  # whether a predecessor may push steps now (the session is linked)
        # the client's next request and the next push, each read across waits: a wait per message
        # costs no new task nor a cancelled one
        self._request: asyncio.Future | None = None
        self._pushed: asyncio.Future | None = None

    async def next(
        self, idle_timeout: float, ends_at: float, pushes: bool = True
    ) -> tuple[str, object] | None:
        """`("request", ExpertRequest)` or `("push", (PushedStep, tensors))`; None once the client
        ended its side. `pushes`: False waits for the client alone (pushes keep meanwhile).
        Raises SessionIdle or SessionLifetimeOver."""
        left = ends_at - time.monotonic()
        if self._request is None and self._pushed is None and not (pushes and self._push_possible()):
            # nothing but the client's request can come: await it here, without a task of its own
            # and a wait on two (each costs the event loop iterations of a hand-off per message)
            try:
                async with asyncio.timeout(min(idle_timeout, left)):
                    return "request", await anext(self.requests)
            except StopAsyncIteration:
                return None
            except TimeoutError:
                raise SessionLifetimeOver() if left <= idle_timeout else SessionIdle() from None
        if pushes:
            if self._pushed is not None and self._pushed.done():
                pushed, self._pushed = self._pushed, None
                return "push", pushed.result()
            if self._pushed is None:
                if not self.inbox.empty():
                    return "push", self.inbox.get_nowait()
                self._pushed = asyncio.ensure_future(self.inbox.get())
        if self._request is None:
            self._request = asyncio.ensure_future(anext(self.requests))
        waits = {self._request, self._pushed} if pushes else {self._request}
        done, _ = await asyncio.wait(
            waits, timeout=min(idle_timeout, left), return_when=asyncio.FIRST_COMPLETED
        )
        if pushes and self._pushed in done:
            pushed, self._pushed = self._pushed, None
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

    def _push_possible(self) -> bool:
        return not self.inbox.empty() or self.may_push()

    def close(self) -> None:
        for waiting in (self._request, self._pushed):
            if waiting is not None:
                waiting.cancel()
                with contextlib.suppress(BaseException):
                    waiting.exception()
        self._request = self._pushed = None
