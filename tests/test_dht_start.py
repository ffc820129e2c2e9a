"""A DHT peer whose start gets stuck is reported with its threads' stacks and started afresh."""

from __future__ import annotations

import logging

from hivemind.dht import DHT
from hivemind.utils.mpfuture import MPFuture

from swarm import dht_peer


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
