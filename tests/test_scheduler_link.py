"""The line to the scheduler: one caller's failure never surfaces in another caller's call."""

from __future__ import annotations

import asyncio
import threading
from concurrent import futures

import grpc
import pytest

from harness.local_swarm import LocalSwarm
from llm_swarm.swarm.dht_records import publish_scheduler
from llm_swarm.swarm.identity import owner_subkey
from llm_swarm.swarm.scheduler_api import scheduler_pb2 as pb
from llm_swarm.swarm.scheduler_api import scheduler_pb2_grpc as pb_grpc
from llm_swarm.swarm.scheduler_link import SchedulerLink

pytestmark = pytest.mark.version_neutral


class SlowAdmission(pb_grpc.SchedulerServicer):
    """Holds every AwaitAdmission until the test releases it."""

    def __init__(self):
        self.waiting, self.release = threading.Event(), threading.Event()

    def AwaitAdmission(self, request, context):  # noqa: N802  (the proto's name)
        self.waiting.set()
        self.release.wait(30)
        return pb.RouteReply(session_id=request.session_id, admitted=True)


def test_a_call_in_flight_when_another_caller_drops_the_channel_gets_no_answer_not_a_cancellation(
    tmp_path,
):
    servicer = SlowAdmission()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    pb_grpc.add_SchedulerServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    swarm = LocalSwarm(tmp_path)  # starts no process: only the scheduler's key and a DHT peer with it
    try:
        dht = swarm.scheduler_dht()
        owner = owner_subkey(swarm.scheduler_key)
        publish_scheduler(dht, "model", owner, {"address": f"127.0.0.1:{port}"}, ttl=60)

        async def scenario() -> tuple[pb.RouteReply | None, str]:
            link = SchedulerLink(dht, "model", swarm.scheduler_key, timeout=10.0)
            waiting = asyncio.ensure_future(link.await_admission("session", timeout=20.0))
            await asyncio.get_running_loop().run_in_executor(None, servicer.waiting.wait, 20)
            link.distrust("a route through a server that does not exist")  # what another caller does
            try:
                return await waiting, link.last_error
            finally:
                await link.close()

        reply, why = asyncio.run(scenario())
        assert reply is None
        assert "distrusted" in why or "closed" in why
    finally:
        servicer.release.set()
        server.stop(0)
        swarm.close()
