"""Make SIGTERM behave like Ctrl-C during synchronous start-up, so `finally:` blocks clean up."""

from __future__ import annotations

import signal


def _raise_keyboard_interrupt(_signum, _frame) -> None:
    raise KeyboardInterrupt


def terminate_like_interrupt() -> None:
    signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
