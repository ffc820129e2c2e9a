"""Servers die mid-generation; clients replace them by replaying history, and outputs stay exact."""

from __future__ import annotations

import random
import signal
import threading
import time

import pytest
import torch
from transformers import AutoModelForCausalLM, LogitsProcessor, LogitsProcessorList

from llm_swarm.client import AutoDistributedModelForCausalLM, ClientOptions
from llm_swarm.swarm.dht_keys import default_prefix
from llm_swarm.swarm.models.span import load_span
from tests.conftest import NUM_BLOCKS

pytestmark = pytest.mark.swarm  # every test here starts processes

PROMPT = torch.tensor([[5, 17, 99, 200, 33, 41, 7]])
FAST_FAILOVER = ClientOptions(request_timeout=20.0, ban_base=2.0, wait_for_servers=30.0)


@pytest.fixture(scope="module")
def expected(llama_dir):
    model = AutoModelForCausalLM.from_pretrained(llama_dir).eval()
    return model.generate(PROMPT, max_new_tokens=40, do_sample=False)


@pytest.mark.parametrize(
    "replacements, killed",
    [
        ({"a2": "0:3", "b2": "3:6"}, ["a", "b"]),  # both servers of the chain die
        ({"a2": "0:3", "b2": "3:6"}, ["b"]),  # only one dies
        ({"a2-left": "0:1", "a2-right": "1:3"}, ["a"]),  # A's blocks need two servers together
    ],
    ids=["both-die", "one-dies", "two-replace-one"],
)
def test_generation_survives_killed_servers(swarm, llama_dir, expected, replacements, killed):
    prefix = default_prefix(str(llama_dir))
    swarm.start_server("a", llama_dir, "0:3")
    swarm.start_server("b", llama_dir, "3:6")
    swarm.wait_online(prefix, NUM_BLOCKS, ["a", "b"])
    model = AutoDistributedModelForCausalLM.from_pretrained(
        llama_dir, swarm.initial_peers, options=FAST_FAILOVER
    )
    try:
        with model.inference_session(max_length=64) as session:
            first = model.generate(PROMPT, max_new_tokens=10, do_sample=False, session=session)
            for name, blocks in replacements.items():
                swarm.start_server(name, llama_dir, blocks)
            swarm.wait_online(prefix, NUM_BLOCKS, list(replacements))
            for name in killed:
                swarm.stop(name, signal.SIGKILL)
            output = model.generate(first, max_new_tokens=30, do_sample=False, session=session)
            survivors = {stream.hop.peer_id for stream in session.blocks.streams}
    finally:
        model.shutdown()
    assert torch.equal(output, expected)
    assert len(survivors) >= 2


def test_chaos_many_clients_while_servers_die_and_return(swarm, llama_dir, expected, local_reference):
    """8 clients generate 48 tokens while servers are SIGKILLed and restarted; every block stays served."""
    prefix = default_prefix(str(llama_dir))
    spans = {"a1": "0:3", "a2": "0:3", "b1": "3:6", "b2": "3:6", "c": "0:6"}
    # a compute delay stretches generations so that kills land in the middle of them
    for name, blocks in spans.items():
        swarm.start_server(name, llama_dir, blocks, "1GB", "--compute-delay", "0.003")
    swarm.wait_online(prefix, NUM_BLOCKS, list(spans))
    reference = local_reference(llama_dir)[0]
    prompts = [torch.tensor([[5 + i, 17, 99, 200 - i, 33]]) for i in range(8)]
    expected_outputs = [reference.generate(p, max_new_tokens=48, do_sample=False) for p in prompts]

    stop_chaos = threading.Event()
    kills: list[str] = []

    def chaos() -> None:
        rng = random.Random(0)
        pairs = [("a1", "a2"), ("b1", "b2")]  # kill one of a pair at a time: c and the twin keep coverage
        while not stop_chaos.is_set():
            victim = rng.choice(rng.choice(pairs))
            swarm.stop(victim, signal.SIGKILL)
            kills.append(victim)
            swarm.start_server(victim, llama_dir, spans[victim], "1GB", "--compute-delay", "0.003")
            stop_chaos.wait(4.0)
            try:
                swarm.wait_online(prefix, NUM_BLOCKS, list(spans), timeout=60)
            except TimeoutError:
                pass

    models = [
        AutoDistributedModelForCausalLM.from_pretrained(llama_dir, swarm.initial_peers, options=FAST_FAILOVER)
        for _ in range(2)
    ]
    results: dict[int, list[torch.Tensor]] = {i: [] for i in range(8)}
    errors: list[BaseException] = []

    def client(index: int) -> None:
        try:
            for _ in range(2):
                results[index].append(
                    models[index % 2].generate(prompts[index], max_new_tokens=48, do_sample=False)
                )
        except BaseException as error:  # collected and reported with its index below
            errors.append(error)

    chaos_thread = threading.Thread(target=chaos)
    threads = [threading.Thread(target=client, args=(i,)) for i in range(8)]
    try:
        chaos_thread.start()
        time.sleep(0.5)
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=240)
    finally:
        stop_chaos.set()
        chaos_thread.join(timeout=120)
        for model in models:
            model.shutdown()
    assert not errors, errors
    assert kills, "the chaos loop never killed anything"
    for index in range(8):
        assert len(results[index]) == 2
        for output in results[index]:
            assert torch.equal(output, expected_outputs[index]), index


def test_clear_error_when_blocks_are_no_longer_served(swarm, llama_dir):
    prefix = default_prefix(str(llama_dir))
    swarm.start_server("whole", llama_dir, f"0:{NUM_BLOCKS}")
    swarm.wait_online(prefix, NUM_BLOCKS, ["whole"])
    options = ClientOptions(request_timeout=10.0, wait_for_servers=2.0, max_failovers=2)
    model = AutoDistributedModelForCausalLM.from_pretrained(llama_dir, swarm.initial_peers, options=options)
    try:
        with model.inference_session(max_length=32) as session:
            first = model.generate(PROMPT, max_new_tokens=4, do_sample=False, session=session)
            swarm.stop("whole", signal.SIGKILL)
            with pytest.raises(Exception, match="no online server holds blocks 0:6"):
                model.generate(first, max_new_tokens=4, do_sample=False, session=session)
    finally:
        model.shutdown()


def test_sigterm_drains_open_sessions_and_refuses_new_ones(swarm, llama_dir, expected):
    """On SIGTERM a server announces OFFLINE, refuses new sessions, and lets open ones finish."""
    prefix = default_prefix(str(llama_dir))
    swarm.start_server("leaving", llama_dir, f"0:{NUM_BLOCKS}", "1GB", "--drain-timeout", "30")
    swarm.wait_online(prefix, NUM_BLOCKS, ["leaving"])
    options = ClientOptions(wait_for_servers=1.0, wait_for_room=1.0)
    model = AutoDistributedModelForCausalLM.from_pretrained(llama_dir, swarm.initial_peers, options=options)
    try:
        with model.inference_session(max_length=64) as session:
            first = model.generate(PROMPT, max_new_tokens=10, do_sample=False, session=session)
            swarm.processes["leaving"].send_signal(signal.SIGTERM)
            swarm.wait_for(
                prefix,
                NUM_BLOCKS,
                lambda online: "leaving" not in online,
                timeout=30,
                what="OFFLINE announcement",
            )
            with pytest.raises(Exception, match="no online server holds blocks"):
                model.open_session(16)  # nobody accepts new sessions now
            output = model.generate(first, max_new_tokens=30, do_sample=False, session=session)
        assert torch.equal(output, expected)  # the open session finished on the draining server
        assert swarm.processes["leaving"].wait(timeout=30) == 0  # and it left as soon as the session closed
    finally:
        model.shutdown()


def test_beam_search_survives_a_killed_server(swarm, llama_dir, local_reference):
    """Five beams; the first server of the chain is SIGKILLed mid-generation: its replacement replays
    the kept inputs with their hypothesis indices, so its cache holds the same reordered beams."""
    prefix = default_prefix(str(llama_dir))
    for name, blocks in {"a": "0:3", "a2": "0:3", "b": "3:6"}.items():
        swarm.start_server(name, llama_dir, blocks)
    swarm.wait_online(prefix, NUM_BLOCKS, ["a", "a2", "b"])
    names = {peer: info.public_name for peer, info in swarm.servers(prefix, NUM_BLOCKS).items()}
    reference = local_reference(llama_dir)[0]
    expected = reference.generate(PROMPT, max_new_tokens=16, num_beams=5, do_sample=False)
    model = AutoDistributedModelForCausalLM.from_pretrained(
        llama_dir, swarm.initial_peers, options=FAST_FAILOVER
    )
    killed: list[str] = []

    class KillFirstServerAtStep6(LogitsProcessor):
        def __init__(self):
            self.calls = 0

        def __call__(self, input_ids, scores):
            self.calls += 1
            if self.calls == 6:
                peer = model._active_session.blocks.streams[0].hop.peer_id
                killed.append(names[peer])
                swarm.stop(names[peer], signal.SIGKILL)
            return scores

    try:
        output = model.generate(
            PROMPT,
            max_new_tokens=16,
            num_beams=5,
            do_sample=False,
            logits_processor=LogitsProcessorList([KillFirstServerAtStep6()]),
        )
    finally:
        model.shutdown()
    assert killed and killed[0] in ("a", "a2")
    assert torch.equal(output, expected)


def test_training_survives_a_server_killed_between_forward_and_backward(swarm, llama_dir):
    """The server that ran blocks 0:3 in the forward is SIGKILLed before the backward: its blocks are
    recomputed on the replica from the kept input and the gradients still equal local autograd."""
    prefix = default_prefix(str(llama_dir))
    for name, blocks in {"a": "0:3", "a2": "0:3", "b": "3:6"}.items():
        swarm.start_server(name, llama_dir, blocks)
    swarm.wait_online(prefix, NUM_BLOCKS, ["a", "a2", "b"])
    names = {peer: info.public_name for peer, info in swarm.servers(prefix, NUM_BLOCKS).items()}
    local = load_span(llama_dir, 0, NUM_BLOCKS)[0]
    hidden = torch.randn(2, 5, local.hidden_size)
    prompts = 0.1 * torch.randn(NUM_BLOCKS, 1, 2, local.hidden_size)
    model = AutoDistributedModelForCausalLM.from_pretrained(
        llama_dir, swarm.initial_peers, options=FAST_FAILOVER
    )
    try:
        leaves = hidden.clone().requires_grad_(), prompts.clone().requires_grad_()
        output = model.blocks(*leaves)
        first = output.grad_fn.hops[0].hop  # the autograd node keeps each hop's input
        assert (first.start, first.end) == (0, 3)
        swarm.stop(names[first.peer_id], signal.SIGKILL)
        output.sum().backward()
    finally:
        model.shutdown()
    expected_leaves = hidden.clone().requires_grad_(), prompts.clone().requires_grad_()
    local.forward_sequence(expected_leaves[0], 0, NUM_BLOCKS, None, expected_leaves[1]).sum().backward()
    for leaf, expected in zip(leaves, expected_leaves, strict=True):
        assert torch.allclose(leaf.grad, expected.grad, atol=1e-4)
