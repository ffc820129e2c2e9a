"""A scheduler that lies (its answers set by the test), served over real gRPC, and the DHT record that
makes clients and managed servers trust it (tests/test_trust.py, tests/test_rogue_prefill_plan.py)."""

from __future__ import annotations

import contextlib
import threading
from concurrent import futures

import grpc

from harness.local_swarm import LocalSwarm
from llm_swarm.swarm.dht_records import publish_scheduler
from llm_swarm.swarm.identity import owner_subkey
from llm_swarm.swarm.scheduler_api import scheduler_pb2 as pb
from llm_swarm.swarm.scheduler_api import scheduler_pb2_grpc as pb_grpc


class RogueScheduler(pb_grpc.SchedulerServicer):
    """A scheduler that lies: its answers are set by the test; it counts the calls it gets."""

    def __init__(self):
        self.calls: list[str] = []
        self.chain: list[pb.Hop] = []
        self.prefill: list[pb.Hop] = []  # RouteReply.prefill: where each hop's prompt runs
        self.prefill_planned = False
        self.wait, self.lease = 0.0, 60.0
        self.assignment = pb.Assignment(assigned=True, start=0, end=100, epoch=7, policy="rogue")

    def Route(self, request, context):  # noqa: N802  (the proto's name)
        self.calls.append("Route")
        return pb.RouteReply(
            session_id="rogue-session",
            chain=self.chain,
            admitted=True,
            expected_wait=self.wait,
            lease=self.lease,
            prefill=self.prefill,
            prefill_planned=self.prefill_planned,
        )

    def EndSession(self, request, context):  # noqa: N802
        self.calls.append("EndSession")
        return pb.EndReply(known=True)

    def KeepAlive(self, request, context):  # noqa: N802
        return pb.LeaseReply(known=True, lease=60.0)

    def GetAssignment(self, request, context):  # noqa: N802
        self.calls.append("GetAssignment")
        return self.assignment


@contextlib.contextmanager
def serve_rogue():
    """(the servicer, its "host:port") while the block runs."""
    servicer = RogueScheduler()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    pb_grpc.add_SchedulerServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield servicer, f"127.0.0.1:{port}"
    finally:
        server.stop(0)


@contextlib.contextmanager
def published_as_trusted(swarm: LocalSwarm, prefix: str, address: str):
    """The swarm's trusted scheduler key announces `address` for the whole block (the record lives
    60 s: it is published again every 20 s)."""
    publisher = swarm.scheduler_dht()
    owner = owner_subkey(swarm.scheduler_key)
    stop = threading.Event()

    def keep_published() -> None:
        while not stop.is_set():
            publish_scheduler(publisher, prefix, owner, {"address": address, "epoch": 7}, ttl=60)
            stop.wait(20)

    keeper = threading.Thread(target=keep_published, daemon=True)
    keeper.start()
    try:
        yield
    finally:
        stop.set()
        keeper.join(timeout=30)
