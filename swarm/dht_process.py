"""hivemind's DHT process, made stoppable in bounded time whatever state it is in.

hivemind runs each DHT peer in a forked process (plus its p2pd daemon, a child of that process) and
stops it by asking through a pipe, then with SIGTERM. Two things defeat that: a parent that installed a
Python signal handler before the fork (the child inherits it, so SIGTERM only sets an event there),
and a child that is frozen or stuck (a SIGTERM to a stopped process stays pending; a child blocked on
its p2pd never exits). Then the parent's multiprocessing exit handler joins the child forever and p2pd
outlives both. `SwarmDHT` resets the child's signal handlers and stops with SIGKILL as the last step,
child and daemon alike.
"""

from __future__ import annotations

import contextlib
import logging
import select
import signal

import psutil
from hivemind.dht import DHT
from hivemind.utils.mpfuture import MPFuture

logger = logging.getLogger(__name__)

STOP_GRACE = 3.0  # seconds a DHT process gets to stop when asked (normally well under one; hivemind: 3)
TERM_WAIT = 2.0  # seconds after SIGTERM before SIGKILL
KILL_WAIT = 5.0  # seconds to reap a killed process (SIGKILL works on stopped processes too)


class SwarmDHT(DHT):
    """A hivemind DHT whose process obeys SIGTERM and whose `shutdown()` always ends it and its p2pd."""

    def run(self) -> None:
        # Handlers the parent installed before forking (a stop event, an event loop's wake-up pipe, a
        # KeyboardInterrupt) make no sense here and would swallow hivemind's own terminate()
        with contextlib.suppress(ValueError):  # only the main thread may; a fork's one thread is
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            signal.set_wakeup_fd(-1)
        super().run()

    def shutdown(self) -> None:
        stop_dht_process(self)


def stop_dht_process(dht: DHT, grace: float = STOP_GRACE) -> None:
    """Ask `dht`'s process to stop, then SIGTERM, then SIGKILL it and the daemons it started; one log
    line says what had to be forced. Returns within about grace + TERM_WAIT + 2 x KILL_WAIT seconds."""
    if dht.pid is None:
        return  # never started
    # found now: once their parent is gone, p2pd daemons belong to init and to nobody we know
    helpers = _descendants(dht.pid)
    forced: list[str] = []
    if dht.is_alive():
        _ask_to_stop(dht)
        dht.join(grace)
        if dht.is_alive():
            dht.terminate()
            dht.join(TERM_WAIT)
            forced.append("SIGTERM")
        if dht.is_alive():
            dht.kill()
            dht.join(KILL_WAIT)
            forced.append("SIGKILL")
            # a process killed while holding one of the locks hivemind's futures share between
            # processes would block every later DHT of this process: fresh ones
            MPFuture.reset_backend()
    left = [helper for helper in helpers if _running(helper)]
    if left:
        for helper in left:
            with contextlib.suppress(psutil.Error):
                helper.terminate()
        _gone, alive = psutil.wait_procs(left, timeout=TERM_WAIT)
        for helper in alive:
            with contextlib.suppress(psutil.Error):
                helper.kill()
        psutil.wait_procs(alive, timeout=KILL_WAIT)
        names = ", ".join(f"{_name(helper)} {helper.pid}" for helper in left)
        how = " with SIGKILL" if alive else ""
        forced.append(f"{len(left)} left-over daemon(s) stopped{how} ({names})")
    if forced:
        logger.warning(
            "DHT process %d did not stop within %.0f s of being asked: %s",
            dht.pid,
            grace,
            "; ".join(forced),
        )


def _ask_to_stop(dht: DHT) -> None:
    """hivemind's own request (DHT.shutdown's message), sent only if the pipe takes it now: a frozen
    child with a full pipe would otherwise block us here."""
    pipe = dht._outer_pipe  # hivemind keeps the request pipe private; its shutdown() would block
    with contextlib.suppress(OSError, ValueError, EOFError, BrokenPipeError):
        _readable, writable, _errors = select.select([], [pipe.fileno()], [], 1.0)
        if writable:
            pipe.send(("_shutdown", [], {}))
        pipe.close()


def _descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


def _running(process: psutil.Process) -> bool:
    try:  # is_running() also checks the creation time: a reused pid is not ours
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _name(process: psutil.Process) -> str:
    try:
        return process.name()
    except psutil.Error:
        return "process"
