"""Server-to-server link probes: servers holding the same blocks measure the links between
them and announce the rates (`ServerInfo.links`) before any hand-off; hostile probes are refused and
cannot hold the probe handler."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from hivemind.moe.client.remote_expert_worker import RemoteExpertWorker
from transformers import AutoModelForCausalLM

from harness.local_swarm import prometheus_sample
from llm_swarm.client import AutoDistributedModelForCausalLM
from llm_swarm.client.connection import run_sync
from llm_swarm.server.link_probes import PROBE_HANDLE
from llm_swarm.swarm.dht_keys import default_prefix
from llm_swarm.swarm.handoff_wire import CHUNK_BYTES, ProbeChunk, ProbeLink
from llm_swarm.swarm.wire import decode_metadata, encode
from tests.conftest import NUM_BLOCKS
from tests.raw_streams import exchange

pytestmark = pytest.mark.swarm  # every test here starts processes

HALF = NUM_BLOCKS // 2


async def _probe(
    connection, peer_id: str, requests: list, keep_open: threading.Event | None = None
) -> list[str]:
    """Send `requests` on a probe stream as they are; the types of the replies until an error or the
    last acknowledgement. `keep_open`: after sending, hold the stream until it is set (a stalled sender)."""
    acks = sum(1 for request in requests if decode_metadata(request.metadata)["type"] == "probe_chunk")

    def read_more(kinds: list[str]) -> bool:
        return len(kinds) < acks and not (kinds and kinds[-1].startswith("error"))

    return await exchange(connection, peer_id, PROBE_HANDLE, requests, read_more, hold=keep_open)


def test_servers_measure_and_announce_their_links_and_refuse_hostile_probes(swarm, llama_dir):
    prefix = default_prefix(str(llama_dir))
    for name in ("a", "b"):  # the same blocks: each could take the other's sessions, so each probes
        swarm.start_server(
            name, llama_dir, f"0:{HALF}", "1GB", "--link-probe-period", "1", "--metrics-port", "0",
            "--next-ping-period", "1",  # roster rounds every second: the other's address soon known
        )  # fmt: skip
    swarm.start_server("c", llama_dir, f"{HALF}:{NUM_BLOCKS}", "1GB", "--link-probe-period", "0")
    swarm.wait_online(prefix, NUM_BLOCKS, ["a", "b", "c"])
    peers = {info.public_name: peer for peer, info in swarm.servers(prefix, NUM_BLOCKS).items()}

    deadline = time.monotonic() + 60
    while True:  # announced within a few probe periods and announcements
        servers = swarm.servers(prefix, NUM_BLOCKS)
        links = {name: servers[peers[name]].links for name in ("a", "b", "c")}
        if links["a"].get(peers["b"], 0) > 0 and links["b"].get(peers["a"], 0) > 0:
            break
        assert time.monotonic() < deadline, f"no link rates announced: {links}"
        time.sleep(0.5)
    assert set(links["a"]) == {peers["b"]} and set(links["b"]) == {peers["a"]}  # c holds other blocks
    assert links["c"] == {}
    # once a server has read the other's address (a roster round), its probes take direct streams,
    # the path its hand-offs would take
    while prometheus_sample(swarm.metrics("a"), "swarm_server_streams_opened", 'path="direct"') < 1:
        assert time.monotonic() < deadline, swarm.metrics("a")
        time.sleep(0.5)

    model = AutoDistributedModelForCausalLM.from_pretrained(llama_dir, swarm.initial_peers)
    connection = model.backend.connection
    target = peers["c"]  # probes nobody, so only this test's probes reach its handler
    filler = torch.zeros(1000, dtype=torch.uint8)
    try:
        header = encode(ProbeLink(chunks=2))
        honest = [header, encode(ProbeChunk(), [filler]), encode(ProbeChunk(), [filler])]
        assert run_sync(_probe(connection, target, honest)) == ["probe_ack", "probe_ack"]
        hostile = {
            "too many chunks": [{"type": "probe_link", "chunks": 10_000}],
            "a float chunk": [header, encode(ProbeChunk(), [torch.zeros(10)])],
            "two tensors": [header, encode(ProbeChunk(), [filler, filler])],
            "an oversized chunk": [
                header,
                encode(ProbeChunk(), [torch.zeros(2 * CHUNK_BYTES, dtype=torch.uint8)]),
            ],
            "not a probe": [encode(ProbeChunk(), [filler])],
        }
        for what, requests in hostile.items():
            requests = [
                encode(ProbeLink.model_construct(**r)) if isinstance(r, dict) else r for r in requests
            ]
            kinds = run_sync(_probe(connection, target, requests + [encode(ProbeChunk(), [filler])]))
            assert kinds and (kinds[-1].startswith("error") or kinds[-1] == "closed"), (what, kinds)
        # a sender that stalls holds the handler; another probe meanwhile is refused at once, not queued
        release = threading.Event()
        stalled = RemoteExpertWorker.run_coroutine(
            _probe(connection, target, [header], keep_open=release), return_future=True
        )
        time.sleep(0.5)
        kinds = run_sync(_probe(connection, target, [header, encode(ProbeChunk(), [filler])]))
        assert kinds[-1].startswith("error: another link probe"), kinds
        release.set()
        stalled.result(10)
        deadline = time.monotonic() + 20  # the stalled stream closed: the handler is free again
        while (kinds := run_sync(_probe(connection, target, honest)))[-1].startswith("error"):
            assert time.monotonic() < deadline, kinds
            time.sleep(0.5)
        assert kinds == ["probe_ack", "probe_ack"]
        # the server still serves exactly
        prompt = torch.tensor([[5, 17, 99, 200]])
        expected = (
            AutoModelForCausalLM.from_pretrained(llama_dir)
            .eval()
            .generate(prompt, max_new_tokens=6, do_sample=False)
        )
        assert torch.equal(model.generate(prompt, max_new_tokens=6, do_sample=False), expected)
    finally:
        model.shutdown()
