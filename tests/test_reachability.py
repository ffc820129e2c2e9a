"""Reachability: the dial-back check's rules, records that say how to reach a server, and
a real checker (`swarm-dht`) against an honest asker and a hostile one.

The end-to-end NAT case (a router namespace with masquerading, a relay, a client in a third site)
is in tests/test_netem.py.
"""

from __future__ import annotations

import asyncio
import socket
import threading

import pytest
from hivemind.dht import DHT
from hivemind.p2p import PeerID
from hivemind.proto import runtime_pb2

from harness.local_swarm import LocalSwarm
from llm_swarm.client.routing import Candidate, chain_problem, choose_chain
from llm_swarm.swarm.reachability import (
    DialBackRequest,
    DialBackResult,
    DialBackRpc,
    dialable_addresses,
    has_circuit,
    peer_ids_of,
)
from llm_swarm.swarm.route_request import RouteHop, SessionShape
from llm_swarm.swarm.server_info import Reachability, ServerInfo
from llm_swarm.swarm.wire import encode, parse
from tests.test_record_validation import server_record

# --- pure rules ---------------------------------------------------------------------------------------


def test_a_checker_dials_only_plain_tcp_addresses_on_the_askers_own_ip():
    requested = [
        "/ip4/203.0.113.7/tcp/4000/p2p/QmPeer",  # the asker's IP: dialed, without the /p2p part
        "/ip4/203.0.113.7/tcp/4000",  # the same again: once
        "/ip4/198.51.100.1/tcp/22",  # a third party: never
        "/ip4/203.0.113.7/udp/4000/quic",  # not TCP
        "/ip4/11.0.0.1/tcp/1/p2p/QmRelay/p2p-circuit/p2p/QmPeer",  # a circuit
        "/dns4/example.org/tcp/80",  # a name someone else resolves
        "/ip4/203.0.113.7/tcp/70000",  # no such port
        "/ip4/224.0.0.1/tcp/5",  # multicast
        "/ip4/203.0.113.7/tcp/" + "9" * 300,  # huge
        "garbage",
        "",
    ]
    chosen = dialable_addresses(requested, {"203.0.113.7"})
    assert [str(a) for a in chosen] == ["/ip4/203.0.113.7/tcp/4000"]
    assert dialable_addresses(requested, set()) == []
    with pytest.raises(ValueError):
        DialBackRequest(addresses=["/ip4/1.2.3.4/tcp/1"] * 9)  # at most 8 per request


def test_bootstrap_peer_ids_and_circuits_are_read_from_multiaddrs():
    a = "QmZsRPtJ4HY29wpD6pFHUWSmXy9pwGBc9UzgZP99sXBocG"
    b = "12D3KooWMdCsMRYKSnbEmcyiRo159K7ADdJM32f2eZXHW2D9bzpQ"
    found = peer_ids_of(
        [f"/ip4/1.2.3.4/tcp/5/p2p/{a}", f"/ip4/1.2.3.5/tcp/5/p2p/{a}", f"/ip4/9.9.9.9/tcp/1/p2p/{b}",
         "/ip4/1.1.1.1/tcp/1", "/ip4/1.1.1.1/tcp/1/p2p/not-a-peer-id"]
    )  # fmt: skip
    assert found == [PeerID.from_base58(a), PeerID.from_base58(b)]
    assert has_circuit([f"/ip4/1.2.3.4/tcp/5/p2p/{b}/p2p-circuit/p2p/{a}"])
    assert not has_circuit([f"/ip4/1.2.3.4/tcp/5/p2p/{a}"])


def test_records_say_how_to_reach_a_server_and_old_records_mean_direct():
    old = ServerInfo.from_wire(server_record())  # written by a server that predates the field
    assert old is not None and old.reachability == Reachability.DIRECT and old.routable
    relayed = ServerInfo.from_wire(server_record(reachability="relay"))
    assert relayed.routable
    dark = ServerInfo.from_wire(server_record(reachability="unreachable"))
    assert dark is not None and not dark.routable
    assert ServerInfo.from_wire(server_record(reachability="teleport")) is None


def test_routing_never_chooses_an_unreachable_server_even_the_fastest():
    shape = SessionShape(batch_size=1, max_length=64, l_in=4, l_out=4)
    fast_dark = Candidate(
        "dark", ServerInfo.from_wire(server_record(reachability="unreachable", tau=1e-5)), 0.001
    )
    slow = Candidate("slow", ServerInfo.from_wire(server_record(tau=1e-2)), 0.2)
    relayed = Candidate("relayed", ServerInfo.from_wire(server_record(reachability="relay", tau=1e-2)), 0.3)
    assert choose_chain([fast_dark, slow, relayed], 0, 6, shape) == [RouteHop("slow", 0, 6)]
    assert choose_chain([fast_dark], 0, 6, shape) is None
    # a scheduler's chain through it is refused like any other chain the records do not back
    servers = {"dark": fast_dark.info, "slow": slow.info}
    assert "clients can reach" in chain_problem([RouteHop("dark", 0, 6)], servers, 6)
    assert chain_problem([RouteHop("slow", 0, 6)], servers, 6) is None


# --- a real checker (swarm-dht) -------------------------------------------------------------------------


class _Listener:
    """A TCP port that counts connection attempts: a third party the checker must never dial."""

    def __init__(self, host: str):
        self.socket = socket.create_server((host, 0))
        self.socket.settimeout(0.2)
        self.address = f"/ip4/{host}/tcp/{self.socket.getsockname()[1]}"
        self.accepted = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.is_set():
            try:
                connection, _ = self.socket.accept()
            except OSError:
                continue
            self.accepted += 1
            connection.close()

    def close(self):
        self._stop.set()
        self._thread.join(5)
        self.socket.close()


@pytest.mark.swarm
def test_the_bootstrap_peer_dials_back_its_asker_and_nobody_else(tmp_path):
    """A plain hivemind peer asks the real `swarm-dht` to dial it back: its own address is dialed and
    the libp2p handshake proves it (reachable); a third party's port on another IP is never
    touched; a second check within 10 s, garbage, and a port on the asker's IP that is not the asker
    are refused or fail cleanly; the checker keeps serving an honest asker afterwards."""
    swarm = LocalSwarm(tmp_path)
    third_party, impostor = _Listener("127.0.0.2"), _Listener("127.0.0.1")
    askers: list[DHT] = []
    try:
        initial_peers = swarm.start_dht()
        checker = peer_ids_of(initial_peers)[0]

        async def ask(dht: DHT, request: runtime_pb2.ExpertRequest) -> DialBackResult:
            p2p = await dht.replicate_p2p()
            reply = await DialBackRpc.get_stub(p2p, checker).rpc_check(request, timeout=30)
            return parse(reply.metadata, DialBackResult)

        def asker() -> tuple[DHT, list[str]]:
            dht = DHT(initial_peers=initial_peers, host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
            askers.append(dht)
            return dht, [str(m) for m in dht.get_visible_maddrs()]

        def check(addresses: list[str]) -> runtime_pb2.ExpertRequest:
            return encode(DialBackRequest(addresses=addresses))

        async def scenario():
            honest, own = asker()
            result = await ask(honest, check(own))
            assert result.reachable, result
            assert result.dialed == [own[0].rsplit("/p2p/", 1)[0]]
            again = await ask(honest, check(own))
            assert not again.reachable and "at most one check per" in again.reason

            hostile, _ = asker()
            aimed = await ask(hostile, check([third_party.address]))
            assert (
                not aimed.reachable and "no announced TCP address on the IP you connect from" in aimed.reason
            )

            garbage = runtime_pb2.ExpertRequest(uid="", metadata=b"\xc1\xff not msgpack")
            refused = await ask(asker()[0], garbage)
            assert not refused.reachable and "msgpack" in refused.reason

            # a port on the asker's own IP that someone else listens on: dialed, but not the asker
            wrong = await ask(asker()[0], check([impostor.address]))
            assert not wrong.reachable and wrong.dialed == [impostor.address]

            later, own = asker()
            assert (await ask(later, check(own))).reachable

        asyncio.run(scenario())
        assert third_party.accepted == 0 and impostor.accepted >= 1
        assert "dial-back check" in swarm.log("dht")
    finally:
        for dht in askers:
            dht.shutdown()
        third_party.close()
        impostor.close()
        swarm.close()
