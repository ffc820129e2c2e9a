"""Closed swarms: only holders of the swarm secret join the DHT, announce, discover servers,
open sessions or ask the scheduler; holders work as before; the others get a clear refusal."""

from __future__ import annotations

import asyncio
import re
import time
import uuid

import grpc
import pytest
import torch
from hivemind.dht import DHTNode
from hivemind.p2p import P2P, PeerID
from hivemind.utils.timed_storage import get_dht_time
from transformers import AutoModelForCausalLM

from harness.local_swarm import PYTHON, LocalSwarm
from llm_swarm.client import AutoDistributedModelForCausalLM, ClientOptions
from llm_swarm.client.connection import run_sync
from llm_swarm.server.handler import BlockServicer
from llm_swarm.swarm.closed_swarm import SwarmSecret
from llm_swarm.swarm.dht_keys import block_key, default_prefix
from llm_swarm.swarm.dht_peer import start_dht
from llm_swarm.swarm.errors import SwarmUserError
from llm_swarm.swarm.identity import peer_id_of_subkey
from llm_swarm.swarm.scheduler_api import scheduler_pb2 as pb
from llm_swarm.swarm.scheduler_api import scheduler_pb2_grpc as pb_grpc
from llm_swarm.swarm.wire import InfoRequest, Open, decode_metadata, encode
from tests.conftest import NUM_BLOCKS

pytestmark = pytest.mark.swarm  # every test here starts processes

PROMPT = torch.tensor([[5, 17, 99, 200]])


@pytest.fixture(scope="module")
def closed_swarm(llama_dir, tmp_path_factory):
    directory = tmp_path_factory.mktemp("closed")
    secret_file = directory / "swarm.secret"
    swarm = LocalSwarm(directory)
    try:
        maddr_file = directory / "dht.maddrs"
        swarm.start(
            "dht",
            [PYTHON, "-m", "llm_swarm.swarm.cli.dht", "--maddr-file", str(maddr_file)]
            + ["--swarm-secret", str(secret_file), "--new-swarm-secret"],
        )
        swarm.initial_peers = wait_file(swarm, maddr_file).split()
        secret = ["--swarm-secret", str(secret_file)]
        address = swarm.start_scheduler("scheduler", llama_dir, *secret)
        swarm.start_server("only", llama_dir, f"0:{NUM_BLOCKS}", "1GB", *secret)
        yield swarm, SwarmSecret.from_file(secret_file), address
    finally:
        assert not swarm.close()


def wait_file(swarm: LocalSwarm, path, timeout: float = 60.0) -> str:
    deadline = time.monotonic() + timeout
    while not path.exists() or not path.read_text().strip():
        assert time.monotonic() < deadline and swarm.processes["dht"].poll() is None, swarm.log("dht")
        time.sleep(0.1)
    return path.read_text()


def test_holders_generate_and_outsiders_are_refused(closed_swarm, llama_dir):
    swarm, secret, address = closed_swarm
    prefix = default_prefix(str(llama_dir))
    expected = (
        AutoModelForCausalLM.from_pretrained(llama_dir)
        .eval()
        .generate(PROMPT, max_new_tokens=8, do_sample=False)
    )
    # a holder generates exactly, through the scheduler too (it needs the secret to be asked at all)
    proof = (("x-swarm-proof", secret.timed_proof("scheduler")),)
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.SchedulerStub(channel)
        deadline = time.monotonic() + 120
        while not [
            s
            for s in stub.GetStatus(pb.StatusRequest(), timeout=10, metadata=proof).servers
            if s.state == "online"
        ]:
            assert time.monotonic() < deadline, "the scheduler never saw the server"
            time.sleep(0.5)
    options = ClientOptions(swarm_secret=secret, scheduler_key=swarm.scheduler_key, wait_for_servers=120.0)
    holder = AutoDistributedModelForCausalLM.from_pretrained(llama_dir, swarm.initial_peers, options=options)
    try:
        with holder.inference_session(max_length=PROMPT.shape[1] + 8) as session:
            output = holder.generate(PROMPT, max_new_tokens=8, do_sample=False, session=session)
            assert session.blocks.admission is not None  # the scheduler routed it
        assert torch.equal(output, expected)
        ((server_peer, _info),) = run_sync(holder.backend.connection.roster.servers(refresh=True)).items()
    finally:
        holder.shutdown()

    # an outsider cannot join the DHT: our client says why
    with pytest.raises(SwarmUserError, match="could not join the swarm's DHT"):
        AutoDistributedModelForCausalLM.from_pretrained(llama_dir, swarm.initial_peers)

    # a plain hivemind node that skips the bootstrap check can neither announce nor discover
    async def announce_and_discover() -> tuple[bool, object]:
        node = await DHTNode.create(initial_peers=swarm.initial_peers, ensure_bootstrap_success=False)
        try:
            stored = await asyncio.wait_for(node.store(block_key(prefix, 0), "gone", get_dht_time() + 60), 60)
            found = await asyncio.wait_for(node.get(block_key(prefix, 1), latest=True), 60)  # the server's
            return stored, found
        finally:
            await node.shutdown()

    _stored_locally, found = asyncio.run(announce_and_discover())
    assert found is None
    member = start_dht(swarm.initial_peers, secret=secret)
    try:  # what it stored reached no member: the block's entries are still the server's record
        entries = member.get(block_key(prefix, 0), latest=True).value
        assert [peer_id_of_subkey(subkey) for subkey in entries] == [server_peer]
    finally:
        member.shutdown()

    # it cannot open a session or even ping the server, knowing its address: a clear refusal
    async def knock() -> tuple[dict, dict]:
        # the server's own addresses (from its log): the outsider knows where to knock
        server_maddrs = re.findall(r"'(/ip4/[^']+)'", swarm.log("only"))
        p2p = await P2P.create(initial_peers=server_maddrs)
        try:
            stub = BlockServicer.get_stub(p2p, PeerID.from_base58(server_peer), namespace=prefix)
            info_reply = await stub.rpc_info(encode(InfoRequest()), timeout=20)
            opening = Open(session_id=uuid.uuid4().hex, max_length=8, batch_size=1, start=0, end=NUM_BLOCKS)

            async def requests():
                yield encode(opening)

            responses = await stub.rpc_inference(requests())
            open_reply = await asyncio.wait_for(anext(responses), 20)
            return decode_metadata(info_reply.metadata), decode_metadata(open_reply.metadata)
        finally:
            await p2p.shutdown()

    info_reply, open_reply = asyncio.run(knock())
    for reply in (info_reply, open_reply):
        assert reply["type"] == "error" and reply["code"] == "unauthorized", reply
        assert "closed swarm" in reply["message"]

    # nor ask the scheduler for routes
    with grpc.insecure_channel(address) as channel, pytest.raises(grpc.RpcError) as refused:
        request = pb.RouteRequest(client_id="outsider", l_in=1, l_out=1, batch_size=1, max_length=8)
        pb_grpc.SchedulerStub(channel).Route(request, timeout=10)
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "closed swarm" in refused.value.details()
    assert swarm.processes["only"].poll() is None
