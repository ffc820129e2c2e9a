"""Test helpers for local swarms whose processes must all be gone when a test ends."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from harness.local_swarm import LocalSwarm


@contextlib.contextmanager
def dht_started(swarm: LocalSwarm) -> Iterator[LocalSwarm]:
    """`swarm` with its DHT started. On exit, every process it started (servers and schedulers added
    inside the block included) is stopped, and the test fails if any was left running.

    Callers construct the `LocalSwarm(...)` themselves: conftest marks a test `swarm` by finding that
    call in its source or its fixtures'."""
    try:
        swarm.start_dht()
        yield swarm
    finally:
        leaked = swarm.close()
        assert not leaked, f"process groups left running: {leaked}"
