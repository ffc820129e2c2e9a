"""How our commands stop on SIGTERM/SIGINT: an orderly stop, bounded by a deadline (swarm.stop_deadline).

Start-up is synchronous code (loading a model, joining the DHT): there SIGTERM raises KeyboardInterrupt
so that `finally:` blocks stop what was started. Once a command serves from an event loop, the signals
set its stop event instead. Either way the stop deadline starts counting at the first signal.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable

from llm_swarm.swarm.stop_deadline import STOP_DEADLINE, arm_stop_deadline

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def _raise_keyboard_interrupt(_signum, _frame) -> None:
    arm_stop_deadline()
    raise KeyboardInterrupt


def terminate_like_interrupt() -> None:
    """Until the event loop takes over: SIGTERM behaves like Ctrl-C (which Python already turns into
    KeyboardInterrupt; it arms the deadline too)."""
    signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
    signal.signal(signal.SIGINT, _raise_keyboard_interrupt)


def stop_on_signals(
    loop: asyncio.AbstractEventLoop, stop: Callable[[], None], deadline: float = STOP_DEADLINE
) -> None:
    """SIGTERM/SIGINT call `stop` (an orderly stop) and arm the deadline of `deadline` seconds."""

    def on_signal() -> None:
        arm_stop_deadline(deadline)
        stop()

    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, on_signal)
