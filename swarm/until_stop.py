"""Awaiting a DHT call in a loop that must also stop when asked.

A DHT call waits on the DHT process; a DHT process that stopped answering (frozen, swapped out) would
hold the loop, and with it the process's orderly stop, until the stop deadline forced an exit
(tests/test_stop_bounded.py: a scheduler and a health monitor asked to stop during a roster read).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")

DHT_READ_TIMEOUT = 10.0  # seconds a periodic roster read may take before the next round retries


class Stopped(Exception):
    """A stop was asked before the awaited call answered (the call was cancelled)."""


async def until_stop(call: Awaitable[T], stop: asyncio.Event, timeout: float) -> T:
    """`call`'s result, within `timeout` seconds (else TimeoutError); raises Stopped as soon as
    `stop` is set first."""
    answering = asyncio.ensure_future(asyncio.wait_for(call, timeout))
    stopping = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({answering, stopping}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopping.cancel()
    if not answering.done():
        answering.cancel()
        raise Stopped
    return answering.result()
