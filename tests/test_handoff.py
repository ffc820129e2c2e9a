"""Cache hand-offs between servers (issue 37): a server that drains hands its sessions' caches to a
server holding the same blocks, and generation stays equal to local transformers; a hand-off that
cannot finish falls back to replay; hostile pushes are refused and leave nothing behind."""

from __future__ import annotations

import signal
import time

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from client import AutoDistributedModelForCausalLM, ClientOptions
from swarm.dht_keys import default_prefix
from tests.conftest import NUM_BLOCKS

PROMPT = torch.tensor([[5, 17, 99, 200, 33, 41, 7]])


def _wait_for_log(swarm, name: str, text: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while text not in swarm.log(name):
        assert time.monotonic() < deadline, f"{name} never logged {text!r}:\n{swarm.log(name)[-2000:]}"
        time.sleep(0.1)


@pytest.mark.parametrize("family", ["llama", "bloom"])
def test_a_draining_server_hands_its_sessions_off_exactly(swarm, family, llama_dir, bloom_dir):
    model_dir = llama_dir if family == "llama" else bloom_dir
    prefix = default_prefix(str(model_dir))
    for name in ("a", "b"):
        swarm.start_server(name, model_dir, f"0:{NUM_BLOCKS}", "1GB", "--drain-timeout", "60")
    swarm.wait_online(prefix, NUM_BLOCKS, ["a", "b"])
    reference = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    batch = tokenizer(
        ["A cat sat on a mat", "one two"], return_tensors="pt", padding=True, padding_side="left"
    )
    options = ClientOptions(request_timeout=20.0)
    model = AutoDistributedModelForCausalLM.from_pretrained(model_dir, swarm.initial_peers, options=options)
    try:
        for inputs in ({"input_ids": PROMPT}, dict(batch)):
            expected = reference.generate(**inputs, max_new_tokens=16, do_sample=False)
            rows, width = inputs["input_ids"].shape
            with model.inference_session(max_length=width + 16, batch_size=rows) as session:
                first = model.generate(**inputs, max_new_tokens=8, do_sample=False, session=session)
                (stream,) = session.blocks.streams
                victim = model.backend.connection.known_servers[stream.hop.peer_id].public_name
                swarm.processes[victim].send_signal(signal.SIGTERM)
                _wait_for_log(swarm, victim, "draining")
                rest = model.generate(None, max_new_tokens=8, do_sample=False)
                (moved,) = session.blocks.streams
                assert moved.hop.peer_id != stream.hop.peer_id
            assert torch.equal(torch.cat([first, rest], dim=1), expected)
            _wait_for_log(swarm, victim, "handed")
            assert swarm.processes[victim].wait(30) == 0  # its drain ended when the session left
            survivor = "b" if victim == "a" else "a"
            swarm.start_server(victim, model_dir, f"0:{NUM_BLOCKS}", "1GB", "--drain-timeout", "60")
            swarm.wait_online(prefix, NUM_BLOCKS, [victim, survivor])
    finally:
        model.shutdown()
