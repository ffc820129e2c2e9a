"""Joining the swarm's DHT so that clients can actually connect: directly, or through a relay.

    mode "auto"   : join, ask the bootstrap peers to dial us back (`swarm.reachability`); reachable
                    -> DIRECT. Not reachable -> rejoin behind NAT: a DHT client that reserves a slot
                    with the bootstrap peers (and `--relay-peers`) as circuit relays -> RELAY, or
                    UNREACHABLE when no relay accepts us (announced, so that nobody routes here).
    mode "always" : skip the check, serve through a relay (a known home connection).
    mode "never"  : never use a relay: DIRECT, or UNREACHABLE when the check fails.

A server listening on a loopback address is reachable by the peers it can talk to at all (a local
swarm) and skips the check, as does a server without bootstrap peers (the first of its swarm). A
check nobody answers (bootstrap peers that predate it) keeps the old assumption: DIRECT.
"""

from __future__ import annotations

import ipaddress
import logging
import time
from dataclasses import dataclass, field
from functools import partial

from hivemind.dht import DHT

from llm_swarm.swarm.dht_peer import PeerIdentity, dht_options
from llm_swarm.swarm.dht_process import SwarmDHT
from llm_swarm.swarm.p2p_daemon_flags import behind_nat_flags, daemon_flags, relay_flags
from llm_swarm.swarm.reachability import check_reachability, has_circuit
from llm_swarm.swarm.server_info import Reachability

logger = logging.getLogger(__name__)

RELAY_MODES = ("auto", "always", "never")
RELAY_WAIT = 30.0  # seconds to wait for a relay reservation at start-up


@dataclass(frozen=True)
class JoinOptions:
    initial_peers: list[str]
    host: str
    port: int
    relay: str = "auto"  # one of RELAY_MODES
    relay_peers: list[str] = field(default_factory=list)  # extra circuit relays (multiaddrs with /p2p/)
    serve_as_relay: bool = False  # relay for others, within swarm.p2p_daemon_flags.RELAY_LIMITS
    extra_dht_options: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.relay not in RELAY_MODES:
            raise ValueError(f"relay must be one of {RELAY_MODES}, got {self.relay!r}")
        if self.relay == "always" and not self.initial_peers + self.relay_peers:
            raise ValueError("serving through a relay needs relays: give --initial-peers or --relay-peers")

    @property
    def relays(self) -> list[str]:
        return [*self.initial_peers, *self.relay_peers]


def join_dht(options: JoinOptions, identity: PeerIdentity, secret) -> tuple[DHT, Reachability]:
    """A started DHT peer and how clients can reach this server (logged plainly)."""
    if options.relay == "always":
        return _join_behind_nat(options, identity, secret, rejoining=False)
    dht = _start(options, identity, secret, client_mode=False, flags=relay_flags(options.serve_as_relay))
    if _is_loopback(options.host) or not options.initial_peers:
        return dht, Reachability.DIRECT
    started = time.monotonic()
    verdict, answers = check_reachability(dht, options.initial_peers)
    took = time.monotonic() - started
    if verdict is None:
        logger.warning(
            "reachability: no peer could dial us back to check (%s); assuming clients can connect",
            "; ".join(answers),
        )
        return dht, Reachability.DIRECT
    if verdict == Reachability.DIRECT:
        logger.info("reachability: directly reachable (checked in %.1f s: %s)", took, "; ".join(answers))
        return dht, Reachability.DIRECT
    logger.warning(
        "reachability: NOT directly reachable from the internet (%s); behind NAT or a firewall without "
        "a forwarded port", "; ".join(answers),
    )  # fmt: skip
    dht.shutdown()
    if options.relay == "never":
        logger.error(
            "reachability: --relay never, so clients cannot connect to this server: it announces itself "
            "UNREACHABLE and is not routed to (forward a port and use --announce-host, or allow relays)"
        )
        dht = _start(options, identity, secret, client_mode=True, flags=relay_flags(False), rejoining=True)
        return dht, Reachability.UNREACHABLE
    return _join_behind_nat(options, identity, secret, rejoining=True)


def _join_behind_nat(options: JoinOptions, identity, secret, rejoining: bool) -> tuple[DHT, Reachability]:
    dht = _start(
        options, identity, secret, client_mode=True, flags=behind_nat_flags(), rejoining=rejoining,
        use_auto_relay=True, force_reachability="private", trusted_relays=options.relays,
    )  # fmt: skip
    deadline = time.monotonic() + RELAY_WAIT
    while True:
        circuits = [m for m in visible_maddrs(dht) if "/p2p-circuit" in m]
        if circuits:
            logger.info("reachability: serving through relay circuit(s) %s", circuits)
            return dht, Reachability.RELAY
        if time.monotonic() > deadline:
            logger.error(
                "reachability: no relay (%s) accepted a reservation in %.0f s: clients cannot connect; "
                "announcing UNREACHABLE and retrying in the background",
                options.relays, RELAY_WAIT,
            )  # fmt: skip
            return dht, Reachability.UNREACHABLE
        time.sleep(0.5)


def visible_maddrs(dht: DHT) -> list[str]:
    return [str(m) for m in dht.get_visible_maddrs(latest=True)]


async def current_relay_state(dht: DHT) -> Reachability:
    """RELAY while the daemon holds a relay reservation (it announces a circuit), else UNREACHABLE."""
    maddrs = await dht.run_coroutine(partial(DHT._get_visible_maddrs, latest=True), return_future=True)
    return Reachability.RELAY if has_circuit([str(m) for m in maddrs]) else Reachability.UNREACHABLE


def _start(
    options: JoinOptions, identity: PeerIdentity, secret, *, client_mode: bool, flags: dict,
    rejoining: bool = False, **relay_options,
) -> DHT:  # fmt: skip
    dht_kwargs = {**dht_options(identity, secret), **options.extra_dht_options, **relay_options}
    if rejoining:
        dht_kwargs["check_if_identity_free"] = False  # we held it a moment ago
    with daemon_flags(flags):
        return SwarmDHT(
            initial_peers=options.initial_peers,
            host_maddrs=[f"/ip4/{options.host}/tcp/{options.port}"],
            client_mode=client_mode,
            start=True,
            **dht_kwargs,
        )


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
