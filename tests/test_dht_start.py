"""How our DHT peers start: a start that gets stuck is reported with its threads' stacks and started
afresh; a reader writes nothing."""

from __future__ import annotations

import logging
import time
from functools import partial

import pytest
from hivemind.dht import DHT
from hivemind.dht.routing import DHTID
from hivemind.utils.mpfuture import MPFuture

from harness.standin_records import new_keys, publish_standins, standin_info, start_standin_dht
from llm_swarm.swarm import dht_peer
from llm_swarm.swarm.dht_keys import roster_shard_key, roster_shard_of
from llm_swarm.swarm.dht_records import fetch_servers
from llm_swarm.swarm.identity import owner_subkey, public_key_text

pytestmark = [pytest.mark.version_neutral, pytest.mark.swarm]  # no transformers code: one leg runs it


def test_a_stuck_start_is_reported_with_its_stacks_and_the_next_try_starts_afresh(monkeypatch, caplog):
    bootstrap = DHT(start=True)
    initial_peers = [str(address) for address in bootstrap.get_visible_maddrs()]
    # what CI once saw: a DHT process that can never hand its "ready" back. Here the shared lock its
    # result goes through is held, as if by a process that died holding it.
    held_lock = MPFuture._update_lock
    held_lock.acquire()
    monkeypatch.setattr(dht_peer, "DHT_START_TIMEOUT", 5.0)
    reader = None
    try:
        with caplog.at_level(logging.WARNING, logger=dht_peer.__name__):
            reader = dht_peer.start_dht(initial_peers)
        assert reader.is_alive()
        assert reader.get("nothing-here", latest=True) is None  # it works: lookups come back
        (warning,) = [record.getMessage() for record in caplog.records if "not ready" in record.getMessage()]
        assert "try 1 of 3" in warning
        assert "_send_update" in warning  # the stack says where it was stuck
    finally:
        held_lock.release()
        if reader is not None:
            reader.shutdown()
        bootstrap.shutdown()


def test_dht_peers_start_beside_live_grpc_calls(caplog):
    """grpcio's fork handlers (on by default since 1.74) made forked DHT processes of a process with
    live gRPC channels crash now and then; `swarm` turns them off before grpc loads."""
    import os
    import threading
    from concurrent import futures

    import grpc

    assert os.environ["GRPC_ENABLE_FORK_SUPPORT"] == "0"
    server = grpc.server(futures.ThreadPoolExecutor(2))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    stop = threading.Event()

    def call_all_the_time() -> None:  # like a client's scheduler link, busy while DHT peers fork
        while not stop.is_set():
            try:
                channel.unary_unary("/nothing/Here")(b"", timeout=0.05)
            except grpc.RpcError:
                pass

    caller = threading.Thread(target=call_all_the_time, daemon=True)
    caller.start()
    bootstrap = DHT(start=True)
    initial_peers = [str(address) for address in bootstrap.get_visible_maddrs()]
    try:
        with caplog.at_level(logging.WARNING, logger=dht_peer.__name__):
            for _ in range(8):
                dht_peer.start_dht(initial_peers).shutdown()
        assert not [record for record in caplog.records if "not ready" in record.getMessage()]
    finally:
        stop.set()
        caller.join()
        channel.close()
        server.stop(None)
        bootstrap.shutdown()


async def _holds(_dht, node, key: str) -> bool:
    key_id = DHTID.generate(source=key)
    return node.protocol.storage.get(key_id) is not None or node.protocol.cache.get(key_id) is not None


async def _forget(_dht, node) -> None:
    node.protocol.storage.clear()
    node.protocol.cache.clear()


def test_a_reader_stores_nothing_where_it_reads(tmp_path):
    """hivemind caches every value a read finds at the nearest node that lacked it; our readers (clients,
    monitors) write nothing. Shown with a plain hivemind reader as the control: the value it read reached
    the node that lacked it."""
    holder = dht_peer.start_dht([], client_mode=False, identity=dht_peer.open_identity(str(tmp_path / "a")))
    initial_peers = [str(address) for address in holder.get_visible_maddrs()]
    publisher, late, readers = None, None, []
    try:
        key = new_keys(1)[0]
        publisher = start_standin_dht(initial_peers, [key])
        assert publish_standins(publisher, "m", [(key, standin_info(0, 8, 0.01))]) >= 1
        shard = roster_shard_key("m", roster_shard_of(owner_subkey(public_key_text(key))))
        assert holder.run_coroutine(partial(_holds, key=shard))
        # a node that lacks the value (hivemind hands it to a node that joins: it is dropped there), so a
        # read visits that node and finds the value at the holder
        late_identity = dht_peer.open_identity(str(tmp_path / "late"))
        late = dht_peer.start_dht(initial_peers, client_mode=False, identity=late_identity)
        deadline = time.monotonic() + 10
        while not late.run_coroutine(partial(_holds, key=shard)) and time.monotonic() < deadline:
            time.sleep(0.2)
        late.run_coroutine(_forget)
        assert not late.run_coroutine(partial(_holds, key=shard))
        ours = dht_peer.start_dht(initial_peers)
        readers.append(ours)
        assert len(fetch_servers(ours, "m", 24)) == 1
        time.sleep(1.0)  # a cache store would be on its way by now
        assert not late.run_coroutine(partial(_holds, key=shard))
        plain = DHT(
            initial_peers=initial_peers, client_mode=True, start=True, **dht_peer.dht_options(None, None)
        )
        readers.append(plain)
        assert plain.get(shard, latest=True) is not None
        deadline = time.monotonic() + 10
        while not late.run_coroutine(partial(_holds, key=shard)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert late.run_coroutine(partial(_holds, key=shard))  # what ours would have done
    finally:
        for dht in (*readers, late, publisher, holder):
            if dht is not None:
                dht.shutdown()
