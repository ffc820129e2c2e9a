"""Can other peers open connections to this one? Dial-back checks between peers of the swarm.

A server behind a home router listens on a private address that nobody outside can dial. Before
it announces itself, it asks peers it is already connected to (the bootstrap peers) to dial it
back (`ask_peers_to_dial_back`). Each checker (`DialBackService`, run by `swarm-dht` and every
server) opens a connection with a fresh daemon that uses no relay and has never seen the asker,
so only a direct connection can succeed, and libp2p's handshake proves the answering peer holds
the asker's key.

Like libp2p's AutoNAT, a checker dials only addresses on the IP address the asker's own connection
comes from: the check cannot be used to make peers scan or connect to third parties. Checks are
serialized and each asker gets at most one per `MIN_CHECK_INTERVAL`.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import time
from functools import partial

from hivemind.p2p import P2P, P2PContext, PeerID, ServicerBase
from hivemind.proto import runtime_pb2
from hivemind.utils.multiaddr import Multiaddr
from pydantic import Field

from llm_swarm.swarm.server_info import Reachability
from llm_swarm.swarm.wire import Message, ProtocolError, encode, parse

logger = logging.getLogger(__name__)

WIRE_NAME = "SwarmDialBack"
MAX_ADDRESSES = 8
MAX_ADDRESS_CHARS = 256
DIAL_TIMEOUT = 5.0
MIN_CHECK_INTERVAL = 10.0  # per asker
REQUEST_TIMEOUT = 20.0  # the asker's wait: the checker may be busy with another check first


class DialBackRequest(Message):
    type: str = "dial_back"
    addresses: list[str] = Field(max_length=MAX_ADDRESSES)


class DialBackResult(Message):
    type: str = "dial_back_result"
    reachable: bool
    dialed: list[str] = Field(default_factory=list, max_length=MAX_ADDRESSES)
    reason: str = Field(default="", max_length=512)


def _tcp_address(text: str) -> tuple[str, Multiaddr] | None:
    """(IP, /ip4|ip6/.../tcp/PORT) of a plain TCP multiaddr (a trailing /p2p/ID dropped); None for
    anything else (circuits, DNS, QUIC, garbage)."""
    if len(text) > MAX_ADDRESS_CHARS:
        return None
    parts = text.strip("/").split("/")
    if len(parts) == 6 and parts[4] == "p2p":
        parts = parts[:4]
    if len(parts) != 4 or parts[0] not in ("ip4", "ip6") or parts[2] != "tcp":
        return None
    try:
        ip = ipaddress.ip_address(parts[1])
        port = int(parts[3])
    except ValueError:
        return None
    if not 0 < port < 65536 or ip.is_multicast or ip.is_unspecified:
        return None
    return str(ip), Multiaddr(f"/{parts[0]}/{ip}/tcp/{port}")


def dialable_addresses(requested: list[str], observed_ips: set[str]) -> list[Multiaddr]:
    """The requested TCP addresses on an IP the asker is seen from (the AutoNAT rule)."""
    chosen = []
    for text in requested:
        parsed = _tcp_address(text)
        if parsed is not None and parsed[0] in observed_ips and parsed[1] not in chosen:
            chosen.append(parsed[1])
    return chosen


def _ip_of(address: Multiaddr) -> str | None:
    parts = str(address).strip("/").split("/")
    if len(parts) >= 2 and parts[0] in ("ip4", "ip6") and "p2p-circuit" not in parts:
        return parts[1]
    return None


class DialBackRpc(ServicerBase):
    """The check's wire declaration: askers take stubs from it, checkers implement it."""

    @classmethod
    def _get_handle_name(cls, namespace: str | None, method_name: str) -> str:
        return f"{WIRE_NAME}.{method_name}"

    async def rpc_check(
        self, request: runtime_pb2.ExpertRequest, context: P2PContext
    ) -> runtime_pb2.ExpertResponse:
        raise NotImplementedError


class DialBackService(DialBackRpc):
    """Dials askers back, one at a time, with a fresh relay-free daemon per check."""

    def __init__(self, p2p: P2P):
        self._p2p = p2p
        self._one_at_a_time = asyncio.Lock()
        self._last_check: dict[PeerID, float] = {}

    async def rpc_check(
        self, request: runtime_pb2.ExpertRequest, context: P2PContext
    ) -> runtime_pb2.ExpertResponse:
        try:
            message = parse(request.metadata, DialBackRequest)
        except ProtocolError as error:
            return encode(DialBackResult(reachable=False, reason=str(error)), request=False)
        asker = context.remote_id
        now = time.monotonic()
        if now - self._last_check.get(asker, -MIN_CHECK_INTERVAL) < MIN_CHECK_INTERVAL:
            reason = f"at most one check per {MIN_CHECK_INTERVAL:.0f} s"
            return encode(DialBackResult(reachable=False, reason=reason), request=False)
        self._last_check = {p: t for p, t in self._last_check.items() if now - t < MIN_CHECK_INTERVAL}
        self._last_check[asker] = now
        observed = {ip for peer in await self._p2p.list_peers() if peer.peer_id == asker for a in peer.addrs
                    if (ip := _ip_of(a)) is not None}  # fmt: skip
        targets = dialable_addresses(message.addresses, observed)
        if not targets:
            reason = f"no announced TCP address on the IP you connect from ({', '.join(sorted(observed))})"
            return encode(DialBackResult(reachable=False, reason=reason), request=False)
        async with self._one_at_a_time:
            reachable, reason = await dial_directly(asker, targets)
        dialed = [str(a) for a in targets]
        logger.info("dial-back check for %s at %s: %s", asker, dialed, "reachable" if reachable else reason)
        return encode(DialBackResult(reachable=reachable, dialed=dialed, reason=reason), request=False)


async def dial_directly(peer: PeerID, addresses: list[Multiaddr]) -> tuple[bool, str]:
    """Connect to `peer` at `addresses` from a new daemon without relays: (connected, why not)."""
    probe = await P2P.create(
        host_maddrs=[], no_listen=True, use_relay=False, auto_nat=False, nat_port_map=False,
        dht_mode="client", startup_timeout=15,
    )  # fmt: skip
    try:
        # hivemind has no public connect-with-addresses; its own identity check uses the same call
        await asyncio.wait_for(probe._client.connect(peer, addresses), DIAL_TIMEOUT)
        return True, ""
    except TimeoutError:
        return False, f"no connection within {DIAL_TIMEOUT:.0f} s"
    except Exception as error:  # ControlFailure: refused, unreachable, wrong peer id
        return False, str(error)[:300]
    finally:
        await probe.shutdown()


async def ask_peers_to_dial_back(
    p2p: P2P, checkers: list[PeerID], addresses: list[str]
) -> tuple[Reachability | None, list[str]]:
    """Ask each checker to dial `addresses`; DIRECT when any connected, UNREACHABLE when those that
    answered all failed, None when nobody answered (no checker: assume what you were told)."""
    request = encode(DialBackRequest(addresses=addresses[:MAX_ADDRESSES]))
    answers: list[str] = []
    verdicts: list[bool] = []
    for checker in checkers:
        stub = DialBackRpc.get_stub(p2p, checker)
        try:
            reply = await asyncio.wait_for(stub.rpc_check(request), REQUEST_TIMEOUT)
            result = parse(reply.metadata, DialBackResult)
        except Exception as error:
            answers.append(f"{checker}: no answer ({type(error).__name__}: {str(error)[:200]})")
            continue
        assert isinstance(result, DialBackResult)
        verdicts.append(result.reachable)
        said = f"dialed {', '.join(result.dialed)}" if result.reachable else result.reason
        answers.append(f"{checker}: {said}")
        if result.reachable:
            break
    if not verdicts:
        return None, answers
    return (Reachability.DIRECT if any(verdicts) else Reachability.UNREACHABLE), answers


def peer_ids_of(maddrs: list[str]) -> list[PeerID]:
    """The peer ids in `/.../p2p/ID` multiaddrs (bootstrap peers), in order, without repeats."""
    found: list[PeerID] = []
    for text in maddrs:
        parts = text.strip("/").split("/")
        if "p2p" in parts[:-1]:
            with contextlib.suppress(Exception):
                peer = PeerID.from_base58(parts[parts.index("p2p") + 1])
                if peer not in found:
                    found.append(peer)
    return found


def has_circuit(maddrs: list[str]) -> bool:
    return any("/p2p-circuit" in text for text in maddrs)


async def _dial_back_from_dht(_dht, node, checkers: list[str], addresses: list[str]):
    return await ask_peers_to_dial_back(node.p2p, [PeerID.from_base58(c) for c in checkers], addresses)


def check_reachability(dht, initial_peers: list[str]) -> tuple[Reachability | None, list[str]]:
    """Ask the bootstrap peers in `initial_peers` to dial `dht`'s announced addresses back (runs in
    the DHT's process, whose daemon the checkers are already connected to)."""
    addresses = [str(m) for m in dht.get_visible_maddrs(latest=True)]
    checkers = [peer.to_base58() for peer in peer_ids_of(initial_peers)]
    if not checkers:
        return None, ["no bootstrap peer id in --initial-peers"]
    return dht.run_coroutine(partial(_dial_back_from_dht, checkers=checkers, addresses=addresses))
