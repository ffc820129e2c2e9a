"""A scheduler's prompt plan is checked like its route: `RouteReply.prefill` entries that
name no prefill server, a server for blocks it does not hold, ranges outside the chain or the model,
or thousands of duplicates are ignored (those hops prefill on their own servers); a good entry among
them is followed; and every generation stays exactly what local transformers generates.

The scheduler is a real gRPC server holding the swarm's trusted key (tests/rogue_scheduler.py); the
swarm is real: a DHT, two decode servers (0:3, 3:6) and a `--role prefill` server of 0:3.
"""

from __future__ import annotations

import logging

import pytest
import torch
from transformers import AutoModelForCausalLM

from harness.local_swarm import LocalSwarm
from llm_swarm.client import AutoDistributedModelForCausalLM, ClientOptions
from llm_swarm.swarm.dht_keys import default_prefix
from llm_swarm.swarm.scheduler_api import scheduler_pb2 as pb
from tests.conftest import NUM_BLOCKS
from tests.rogue_scheduler import published_as_trusted, serve_rogue

pytestmark = pytest.mark.swarm  # every test here starts processes

PROMPT = torch.tensor([[5, 17, 99, 200, 33, 41, 7, 12]])
NEW_TOKENS = 8


def generate(llama_dir, swarm: LocalSwarm) -> torch.Tensor:
    client = AutoDistributedModelForCausalLM.from_pretrained(
        llama_dir, swarm.initial_peers, options=ClientOptions(scheduler_key=swarm.scheduler_key)
    )
    try:
        return client.generate(PROMPT, max_new_tokens=NEW_TOKENS, do_sample=False)
    finally:
        client.shutdown()


@pytest.mark.swarm
def test_bogus_prefill_plans_are_ignored_and_a_good_entry_is_followed(llama_dir, tmp_path, caplog):
    expected = (
        AutoModelForCausalLM.from_pretrained(llama_dir)
        .eval()
        .generate(PROMPT, max_new_tokens=NEW_TOKENS, do_sample=False)
    )
    prefix = default_prefix(str(llama_dir))
    swarm = LocalSwarm(tmp_path)
    try:
        swarm.start_dht()
        with serve_rogue() as (rogue, address), published_as_trusted(swarm, prefix, address):
            swarm.start_server("front", llama_dir, "0:3")
            swarm.start_server("back", llama_dir, "3:6")
            swarm.start_server("pre", llama_dir, "0:3", "1GB", "--role", "prefill")
            swarm.wait_online(prefix, NUM_BLOCKS, ["front", "back", "pre"])
            peers = {info.public_name: peer for peer, info in swarm.servers(prefix, NUM_BLOCKS).items()}
            rogue.chain = [
                pb.Hop(peer_id=peers["front"], start=0, end=3),
                pb.Hop(peer_id=peers["back"], start=3, end=6),
            ]
            rogue.prefill_planned = True
            bogus = [
                pb.Hop(peer_id="QmNobody", start=0, end=3),  # no server at all
                pb.Hop(peer_id=peers["back"], start=0, end=3),  # a decode server, blocks it does not hold
                pb.Hop(peer_id=peers["front"], start=0, end=3),  # a decode server (not --role prefill)
                pb.Hop(peer_id=peers["pre"], start=3, end=6),  # the prefill server, blocks it does not hold
                pb.Hop(peer_id=peers["pre"], start=-5, end=10**9),  # outside the model
                pb.Hop(peer_id=peers["pre"], start=1, end=3),  # no hop of the chain
            ]
            rogue.prefill = bogus * 2000  # 12,000 entries, all to be ignored
            with caplog.at_level(logging.INFO, logger="llm_swarm.client"):
                assert torch.equal(generate(llama_dir, swarm), expected)
            assert "ignoring 12000 of the scheduler's 12000 prefill hops" in caplog.text
            assert caplog.text.count("prefill hops") == 1  # one line, not one per entry
            assert "its prompt goes to prefill servers" not in caplog.text
            assert "Route" in rogue.calls
            assert "handed" not in swarm.log("pre")
            caplog.clear()

            # a good entry among the bogus ones: the prompt of blocks 0:3 runs on the prefill server
            rogue.prefill = [*bogus, pb.Hop(peer_id=peers["pre"], start=0, end=3)]
            with caplog.at_level(logging.INFO, logger="llm_swarm.client"):
                assert torch.equal(generate(llama_dir, swarm), expected)
            assert "its prompt goes to prefill servers" in caplog.text
            assert "scheduler's plan: yes" in caplog.text
            assert "ignoring 6 of the scheduler's 7 prefill hops" in caplog.text
            assert "handed" in swarm.log("pre") and "received a cache" in swarm.log("front")
    finally:
        assert not swarm.close()
