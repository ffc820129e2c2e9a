"""p2p daemon (libp2p) options that hivemind 1.1.12's `P2P.create` has no parameter for.

hivemind starts `p2pd` with a fixed set of flags. Two that matter for NAT traversal are missing:

- `-relayDiscovery`: hivemind leaves it on, and with discovery on libp2p's auto-relay collects at
  least four relay candidates or waits three minutes (its boot delay) before reserving a slot.
  A server behind NAT that names its relays (the swarm's bootstrap peers) should reserve at once,
  which `-relayDiscovery=0` plus `-trustedRelays` gives (static relays only).
- `-relayService` and the relay's limits: every hivemind peer would otherwise relay for anyone
  once libp2p thinks it is public, with libp2p's default limits. Our peers relay only when their
  operator opts in, within the bounds in `RELAY_LIMITS`.

`DHT` forks its own process that starts the daemon, so the flags are added to the class's argv
builder only while a DHT is being started (`with daemon_flags(...): start it`): the forked child
keeps the flags, and every other P2P this process starts is left as hivemind makes it.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from hivemind.p2p import P2P

# what one relaying peer gives others: p2pd's circuit relay v2 resources
RELAY_LIMITS = {
    "relayMaxReservations": 64,  # peers holding a slot at once
    "relayMaxCircuits": 8,  # relayed connections per peer at once
    "relayBufferSize": 1 << 20,  # bytes buffered per relayed connection and direction
    "relayDataLimit": 1 << 32,  # bytes per relayed connection and direction before it is reset
    "relayTimeLimit": "30m",  # a relayed connection's longest life (sessions then fail over)
}

_lock = threading.Lock()


def relay_flags(serve_as_relay: bool) -> dict:
    """Flags for a peer that relays for others within `RELAY_LIMITS`, or never relays."""
    return {"relayService": True, **RELAY_LIMITS} if serve_as_relay else {"relayService": False}


def behind_nat_flags() -> dict:
    """Reserve a slot with the trusted relays (passed as `trusted_relays`) at once."""
    return {"relayDiscovery": False, "relayService": False}


@contextlib.contextmanager
def daemon_flags(flags: dict) -> Iterator[None]:
    """Daemons started (forked) inside this block get `flags` on top of hivemind's own."""
    if not flags:
        yield
        return
    with _lock:
        original = P2P.__dict__["_make_process_args"]

        def with_flags(*args, **kwargs):
            return original.__func__(*args, **{**kwargs, **flags})

        P2P._make_process_args = staticmethod(with_flags)
        try:
            yield
        finally:
            P2P._make_process_args = original
