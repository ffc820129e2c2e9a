"""How much of a session's cache its prompt has computed so far, for a hand-off that follows it.

A push that follows a prompt (`HandOff.follow`, Splitwise's streaming) sends each range of positions
as soon as the prompt's chunk that computes it is done (the engine runs long prompts in chunks,
`--prefill-chunk`), while the next chunk computes. The compute thread reports each finished chunk
(`advance`, any thread: its emulated delay included, so an emulated server streams no sooner than a
real one would); the push waits on the event loop (`wait_beyond`).
"""

from __future__ import annotations

import asyncio


class CacheProgress:
    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = loop
        self.ready = 0  # positions [0, ready) of every block hold their final keys and values
        self.abandoned = False  # the push must stop: its step failed or never came
        self._changed = asyncio.Event()

    def advance(self, end: int) -> None:
        """The compute thread finished positions up to `end` (safe from any thread)."""
        self._loop.call_soon_threadsafe(self._set, end)

    def _set(self, end: int) -> None:
        self.ready = max(self.ready, end)
        self._changed.set()

    def abandon(self) -> None:
        """No more positions will come (on the event loop): a waiting push stops. A flag as well as
        the task's cancellation, which Python 3.11's `wait_for` may swallow."""
        self.abandoned = True
        self._changed.set()

    async def wait_beyond(self, position: int, timeout: float) -> int:
        """Positions ready once more than `position` are (TimeoutError after `timeout` s of none;
        CancelledError once abandoned)."""
        while self.ready <= position:
            if self.abandoned:
                raise asyncio.CancelledError("the step the push followed ended without its positions")
            self._changed.clear()
            await asyncio.wait_for(self._changed.wait(), timeout)
        return self.ready
