"""A bound on how long a process of ours may take to stop once asked (SIGTERM or SIGINT).

Each step of an orderly stop is bounded on its own (draining, announcing OFFLINE, the DHT process), but
an operator's service manager or a test's clean-up needs one promise for the whole: stopped within
`seconds`, whatever is stuck. Past the deadline, the process kills every process it started (its DHT
process, p2pd daemons) and exits with FORCED_EXIT_CODE, after one log line saying so.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time

import psutil

logger = logging.getLogger(__name__)

STOP_DEADLINE = 25.0  # seconds from the stop request to a forced exit (a server adds its drain timeout)
FORCED_EXIT_CODE = 143  # what a shell reports for a process ended by SIGTERM (128 + 15)

_armed = threading.Lock()


def arm_stop_deadline(seconds: float = STOP_DEADLINE) -> None:
    """Start the countdown (once per process; later calls keep the first deadline)."""
    if not _armed.acquire(blocking=False):
        return
    asked = time.monotonic()
    countdown = threading.Thread(
        target=_force_exit_after, args=(asked, seconds), name="stop-deadline", daemon=True
    )
    countdown.start()


def _force_exit_after(asked: float, seconds: float) -> None:
    time.sleep(max(seconds - (time.monotonic() - asked), 0.0))
    started = psutil.Process().children(recursive=True)
    for process in started:
        with contextlib.suppress(psutil.Error):
            process.kill()
    logger.error(
        "did not stop within %.0f s of being asked: forced exit (%d process(es) it started killed)",
        seconds,
        len(started),
    )
    for handler in logging.getLogger().handlers:
        with contextlib.suppress(Exception):
            handler.flush()
    os._exit(FORCED_EXIT_CODE)
