"""A real swarm on loopback: DHT + server processes, clients in this process."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest
import torch

from examples import prompt_tuning
from harness.local_swarm import CHILD_ENV, LocalSwarm, child_pids
from llm_swarm.client import AutoDistributedModelForCausalLM, ClientOptions
from llm_swarm.client.backend import LocalSpans
from llm_swarm.client.connection import run_sync
from llm_swarm.client.remote import RemoteBlockSession
from llm_swarm.client.stream import ServerStream
from llm_swarm.swarm.dht_keys import default_prefix
from llm_swarm.swarm.models.span import load_span
from llm_swarm.swarm.route_request import RouteHop, SessionShape
from llm_swarm.swarm.wire import ErrorCode, RemoteError
from tests.conftest import NUM_BLOCKS
from tests.swarm_processes import dht_started

pytestmark = pytest.mark.swarm  # every test here starts processes

# uneven spans plus a replica that overlaps two of them
SERVERS = {"s1": "0:2", "s2": "2:5", "s3": "5:6", "replica": "1:4"}
PROMPTS = [
    "The quick brown fox",
    "Once upon a time",
    "Paris London",
    "one two three four",
    "A swarm",
    "It learned",
]


@pytest.fixture(scope="module")
def swarm(model_dir, tmp_path_factory):
    with dht_started(LocalSwarm(tmp_path_factory.mktemp("swarm-logs"))) as swarm:
        for name, blocks in SERVERS.items():
            swarm.start_server(name, model_dir, blocks)
        swarm.wait_online(default_prefix(str(model_dir)), NUM_BLOCKS, list(SERVERS))
        yield swarm


@pytest.fixture(scope="module")
def reference(model_dir, local_reference):
    return local_reference(model_dir)


@pytest.fixture(scope="module")
def client(swarm, model_dir):
    before = child_pids()
    model = AutoDistributedModelForCausalLM.from_pretrained(model_dir, initial_peers=swarm.initial_peers)
    yield model
    model.shutdown()
    deadline = time.monotonic() + 10
    while child_pids() - before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not child_pids() - before, "the client left processes behind"


@pytest.mark.compat
def test_greedy_generation_matches_local_transformers(client, reference):
    model, tokenizer = reference
    prompt = tokenizer("The quick brown fox", return_tensors="pt").input_ids
    expected = model.generate(prompt, max_new_tokens=32, do_sample=False)
    assert torch.equal(client.generate(prompt, max_new_tokens=32, do_sample=False), expected)


def test_batch_of_three_with_padding(client, reference):
    model, tokenizer = reference
    batch = tokenizer(PROMPTS[:3], return_tensors="pt", padding=True, padding_side="left")
    expected = model.generate(**batch, max_new_tokens=32, do_sample=False)
    assert torch.equal(client.generate(**batch, max_new_tokens=32, do_sample=False), expected)


def test_inference_session_reused_over_three_generate_calls(client, reference):
    model, tokenizer = reference
    sequence = tokenizer("Once upon a time", return_tensors="pt").input_ids
    with client.inference_session(max_length=96) as session:
        for follow_up in [" one", " two three", " Paris"]:
            sequence = torch.cat([sequence, tokenizer(follow_up, return_tensors="pt").input_ids], dim=1)
            output = client.generate(sequence, max_new_tokens=10, do_sample=False, session=session)
            assert torch.equal(output, model.generate(sequence, max_new_tokens=10, do_sample=False))
            sequence = output


def test_six_concurrent_clients(swarm, model_dir, client, reference):
    """Two more client peers join; six threads over three clients generate at once."""
    model, tokenizer = reference
    others = [
        AutoDistributedModelForCausalLM.from_pretrained(model_dir, initial_peers=swarm.initial_peers)
        for _ in range(2)
    ]
    clients = [client, *others]
    results: dict[int, torch.Tensor] = {}
    errors: list[BaseException] = []

    def generate(index: int) -> None:
        try:
            prompt = tokenizer(PROMPTS[index], return_tensors="pt").input_ids
            results[index] = clients[index % 3].generate(prompt, max_new_tokens=24, do_sample=False)
        except BaseException as error:  # reported below, with the thread's index
            errors.append(error)

    threads = [threading.Thread(target=generate, args=(index,)) for index in range(6)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=180)
    finally:
        for other in others:
            other.shutdown()
    assert not errors, errors
    for index in range(6):
        prompt = tokenizer(PROMPTS[index], return_tensors="pt").input_ids
        assert torch.equal(results[index], model.generate(prompt, max_new_tokens=24, do_sample=False)), index


def test_sessions_are_routed_through_several_servers(client):
    with client.inference_session(max_length=16) as session:
        chain = [(stream.hop.start, stream.hop.end) for stream in session.blocks.streams]
    assert chain[0][0] == 0 and chain[-1][1] == NUM_BLOCKS
    assert all(a[1] == b[0] for a, b in zip(chain, chain[1:], strict=False))


class TestCacheRoom:
    """A server whose memory fits exactly two sessions refuses a third, then serves it when one ends."""

    MAX_LENGTH = 64

    @pytest.fixture
    def tight_swarm(self, llama_dir, tmp_path_factory):
        from llm_swarm.swarm.models import load_span

        span, _ = load_span(llama_dir, 0, NUM_BLOCKS)
        session_bytes = span.cache_bytes(self.MAX_LENGTH) * NUM_BLOCKS
        memory = span.block_bytes * NUM_BLOCKS + 2 * session_bytes + session_bytes // 2
        swarm = LocalSwarm(tmp_path_factory.mktemp("tight-swarm"))
        try:
            swarm.start_dht()
            swarm.start_server(
                "tight",
                llama_dir,
                f"0:{NUM_BLOCKS}",
                str(memory),
                "--slot-tokens",
                str(self.MAX_LENGTH),
                "--max-peer-cache-fraction",
                "1",  # this one client may fill the server: the point is what happens next
            )
            swarm.wait_online(default_prefix(str(llama_dir)), NUM_BLOCKS, ["tight"])
            yield swarm, session_bytes
        finally:
            assert not swarm.close()

    def test_third_session_waits_for_room(self, tight_swarm, llama_dir):
        swarm, session_bytes = tight_swarm
        prefix = default_prefix(str(llama_dir))
        full = swarm.servers(prefix, NUM_BLOCKS)
        ((peer_id, info),) = full.items()
        full_slots = info.cache_slots_left
        assert full_slots == 2 * NUM_BLOCKS + NUM_BLOCKS // 2

        options = ClientOptions(wait_for_room=1.0)
        model = AutoDistributedModelForCausalLM.from_pretrained(
            llama_dir, swarm.initial_peers, options=options
        )
        try:
            first = model.open_session(self.MAX_LENGTH)
            second = model.open_session(self.MAX_LENGTH)
            # asked directly, the server answers the third with the clear error
            shape = SessionShape(batch_size=1, max_length=self.MAX_LENGTH, l_in=8, l_out=8)
            stream = ServerStream(RouteHop(peer_id, 0, NUM_BLOCKS), "third-session-0001", shape)
            with pytest.raises(RemoteError, match="no cache room") as refused:
                run_sync(stream.open(model.backend.connection))
            assert refused.value.code == ErrorCode.NO_CACHE_ROOM
            run_sync(_close_stream(stream))
            # through the client, the third session waits; when one ends it gets the room
            opener = threading.Thread(target=lambda: holder.append(model.open_session(self.MAX_LENGTH)))
            holder: list = []
            model.backend.connection.options.wait_for_room = 60.0
            opener.start()
            time.sleep(1.5)
            assert not holder, "the third session must wait while two are open"
            first.close()
            opener.join(timeout=60)
            assert holder and isinstance(holder[0].blocks, RemoteBlockSession)
            second.close()
            holder[0].close()
        finally:
            model.shutdown()
        swarm.wait_for(
            prefix,
            NUM_BLOCKS,
            lambda online: online["tight"].cache_slots_left == full_slots,
            timeout=30,
            what="cache slots back to full",
        )


async def _close_stream(stream: ServerStream) -> None:
    stream.close()


def test_a_chain_opened_at_once_reports_the_full_hop_and_leaves_no_session_behind(llama_dir, tmp_path):
    """Every server of a chain (and a prefill server) is opened at once (`_open_with_prefill`): when
    the second hop has no room, the error is that hop's, the prefill session is closed by the opener,
    the others by the caller, and every server ends with only the sessions that were open before."""
    max_length, half = 64, NUM_BLOCKS // 2
    span, _ = load_span(llama_dir, half, NUM_BLOCKS)
    session_bytes = span.cache_bytes(max_length) * (NUM_BLOCKS - half)
    tight = span.block_bytes * (NUM_BLOCKS - half) + session_bytes + session_bytes // 2  # one session
    swarm = LocalSwarm(tmp_path)
    prefix = default_prefix(str(llama_dir))
    try:
        swarm.start_dht()
        swarm.start_server("roomy", llama_dir, f"0:{half}", "1GB")
        swarm.start_server("tight", llama_dir, f"{half}:{NUM_BLOCKS}", str(tight))
        swarm.wait_online(prefix, NUM_BLOCKS, ["roomy", "tight"])
        peers = {info.public_name: peer for peer, info in swarm.servers(prefix, NUM_BLOCKS).items()}
        model = AutoDistributedModelForCausalLM.from_pretrained(llama_dir, swarm.initial_peers)
        try:
            first = model.open_session(max_length)  # the tight server's only session
            shape = SessionShape(batch_size=1, max_length=max_length, l_in=8, l_out=8)
            chain = [RouteHop(peers["roomy"], 0, half), RouteHop(peers["tight"], half, NUM_BLOCKS)]
            streams = [ServerStream(hop, f"at-once-{index}", shape) for index, hop in enumerate(chain)]
            with pytest.raises(RemoteError, match="no cache room") as refused:
                run_sync(first.blocks._open_with_prefill(chain, streams, {0: peers["roomy"]}))
            assert refused.value.peer == peers["tight"]
            for stream in streams:
                run_sync(_close_stream(stream))
            swarm.wait_for(
                prefix,
                NUM_BLOCKS,
                lambda online: online["roomy"].active_sessions == 1 and online["tight"].active_sessions == 1,
                30,
            )
            first.close()
        finally:
            model.shutdown()
        swarm.wait_for(
            prefix,
            NUM_BLOCKS,
            lambda online: online["roomy"].active_sessions == 0 and online["tight"].active_sessions == 0,
            30,
        )
    finally:
        assert not swarm.close()


def test_generate_none_and_inputs_embeds_through_the_swarm(client, reference):
    """PETALS' `generate(None)` continues the active session; a prompt as `inputs_embeds` generates
    what the same prompt as ids generates."""
    model, tokenizer = reference
    prompt = tokenizer("Once upon a time", return_tensors="pt").input_ids
    with client.inference_session(max_length=prompt.shape[1] + 16):
        first = client.generate(prompt, max_new_tokens=6, do_sample=False)
        continued = client.generate(None, max_new_tokens=10, do_sample=False)  # only the new tokens
    whole = torch.cat([first, continued], dim=1)
    assert torch.equal(whole, model.generate(prompt, max_new_tokens=16, do_sample=False))
    embeds = client.get_input_embeddings()(prompt)
    expected = model.generate(inputs_embeds=embeds, max_new_tokens=8, do_sample=False)
    assert torch.equal(client.generate(inputs_embeds=embeds, max_new_tokens=8, do_sample=False), expected)


def test_a_script_without_shutdown_exits_cleanly(swarm, model_dir):
    """No `model.shutdown()`: the client still leaves at exit, with nothing on stderr. A new interpreter
    for one family: how a client leaves at exit does not depend on the model."""
    if "bloom" in model_dir.name:
        pytest.skip("exiting is the same for every family: checked with the LLaMA")
    script = (
        "import torch\n"
        "from llm_swarm import AutoDistributedModelForCausalLM\n"
        f"peers = {swarm.initial_peers!r}\n"
        f"model = AutoDistributedModelForCausalLM.from_pretrained({str(model_dir)!r}, peers)\n"
        "print(model.generate(torch.tensor([[5, 17, 99]]), max_new_tokens=4, do_sample=False).tolist())\n"
    )
    completed = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=180, env=CHILD_ENV
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert completed.stdout.strip().startswith("[[5, 17, 99,")
    assert completed.stderr.strip() == "", completed.stderr[-3000:]


def test_beam_search_through_the_swarm(client, reference):
    """Five beams: the servers reorder their caches by the hypothesis indices sent with each step."""
    model, tokenizer = reference
    prompt = tokenizer("The quick brown fox", return_tensors="pt").input_ids
    expected = model.generate(prompt, max_new_tokens=12, num_beams=5, do_sample=False)
    assert torch.equal(client.generate(prompt, max_new_tokens=12, num_beams=5, do_sample=False), expected)


# --- training through the swarm and the block-level API -----------------------------------
@pytest.fixture(scope="module")
def local_blocks(model_dir):
    """The same blocks in this process: the reference for outputs and gradients."""
    return load_span(model_dir, 0, NUM_BLOCKS)[0]


def test_block_level_forward_slices_and_steps_match_local_blocks(client, local_blocks):
    """`model.blocks` (PETALS' `model.transformer.h`): whole, sliced and single blocks give the local
    blocks' output within 1e-4; a session's single, multi-token and empty steps give the forward's."""
    hidden = torch.randn(2, 7, local_blocks.hidden_size)
    assert len(client.blocks) == NUM_BLOCKS
    for blocks, (first, last) in (
        (client.blocks, (0, NUM_BLOCKS)),
        (client.blocks[2:5], (2, 5)),
        (client.blocks[-1], (NUM_BLOCKS - 1, NUM_BLOCKS)),
    ):
        expected = local_blocks.forward_sequence(hidden, first, last)
        assert torch.allclose(blocks(hidden), expected, atol=1e-4), (first, last)
    middle = client.blocks[1:4]
    with middle.inference_session(max_length=10, batch_size=2) as session:
        outputs = [
            session.step(hidden[:, :1]),
            session.step(hidden[:, 1:4]),
            session.step(hidden[:, 4:4]),
            session.step(hidden[:, 4:]),
        ]
    assert outputs[2].shape == (2, 0, local_blocks.hidden_size)
    assert torch.allclose(torch.cat(outputs, dim=1), middle(hidden), atol=1e-3)


def test_gradients_through_the_swarm_match_local_autograd(client, local_blocks):
    """`backward()` through two servers' backward RPCs: gradients with respect to the inputs and to
    deep prompts equal local autograd within 1e-4 (float32), and a padded batch too."""
    hidden = torch.randn(2, 6, local_blocks.hidden_size)
    prompts = 0.1 * torch.randn(NUM_BLOCKS, 1, 3, local_blocks.hidden_size)
    weights = torch.randn(2, 6, local_blocks.hidden_size)
    padding = torch.tensor([[0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    for mask in (None, padding):
        # a padding position's output means nothing: its query sees no key, and attention kernels
        # differ on such rows (on CUDA, transformers lets them attend everywhere), so it is neither
        # compared nor part of the loss
        real = torch.ones(2, 6, 1) if mask is None else mask[..., None].float()
        grads = []
        for run in (client.blocks, _local_run(local_blocks)):
            leaf_hidden, leaf_prompts = hidden.clone().requires_grad_(), prompts.clone().requires_grad_()
            output = run(leaf_hidden, leaf_prompts, mask)
            (output * weights * real).sum().backward()
            grads.append((output.detach() * real, leaf_hidden.grad, leaf_prompts.grad))
        (remote_out, remote_hidden, remote_prompts), (local_out, local_hidden, local_prompts) = grads
        assert torch.allclose(remote_out, local_out, atol=1e-4)
        assert torch.allclose(remote_hidden, local_hidden, atol=1e-4)
        assert torch.allclose(remote_prompts, local_prompts, atol=1e-4)
        assert remote_prompts.abs().sum() > 0


def test_prompt_tuned_model_trains_and_generates_like_the_local_one(swarm, model_dir):
    """`tuning_mode="deep_ptune"`: the loss and its gradients for the trainable prompts equal the same
    model run on local blocks, and generate() (with the prompts on the servers) gives the same tokens."""
    remote = AutoDistributedModelForCausalLM.from_pretrained(
        model_dir, swarm.initial_peers, tuning_mode="deep_ptune", pre_seq_len=3
    )
    try:
        local = AutoDistributedModelForCausalLM.from_local_parts(
            model_dir,
            LocalSpans([load_span(model_dir, 0, NUM_BLOCKS)[0]]),
            tuning_mode="deep_ptune",
            pre_seq_len=3,
        )
        torch.nn.init.normal_(remote.prompts.intermediate_prompt_embeddings.weight, std=0.1)
        local.prompts.load_state_dict(remote.prompts.state_dict())
        ids = torch.tensor([[5, 17, 99, 200, 31, 7], [8, 9, 10, 11, 12, 13]])
        losses = []
        for model in (remote, local):
            loss = model(ids, labels=ids).loss
            loss.backward()
            losses.append(loss.item())
        assert abs(losses[0] - losses[1]) < 1e-4
        for name, parameter in remote.prompts.named_parameters():
            reference = local.prompts.get_parameter(name).grad
            assert torch.allclose(parameter.grad, reference, atol=1e-4), name
        prompt = ids[:1, :4]
        expected = local.generate(prompt, max_new_tokens=6, do_sample=False)
        assert torch.equal(remote.generate(prompt, max_new_tokens=6, do_sample=False), expected)
    finally:
        remote.shutdown()


def _local_run(span):
    def run(hidden, prompts, padding_mask):
        return span.forward_sequence(hidden, 0, NUM_BLOCKS, padding_mask, prompts)

    return run


def test_the_prompt_tuning_example_lowers_the_loss(swarm, model_dir, capsys):
    """docs/fine-tuning.md's example, a few steps against this swarm: it exits 0 only if the loss fell.
    Its entry point runs in this process, which has paid for its imports already."""
    argv = ["--model-dir", str(model_dir), "--steps", "6", "--initial-peers", *swarm.initial_peers]
    assert prompt_tuning.main(argv) == 0, capsys.readouterr().out[-2000:]
    assert "loss fell from" in capsys.readouterr().out


def test_a_first_prompt_larger_than_the_open_limit_is_served(client, reference):
    """A session's first step may be far larger than its open message (300 tokens of hidden states
    here, 77 KB): the server checks it against the session's limit, not the open message's."""
    model, _tokenizer = reference
    prompt = torch.randint(5, 500, (1, 300), generator=torch.Generator().manual_seed(1))
    expected = model.generate(prompt, max_new_tokens=4, do_sample=False)
    assert torch.equal(client.generate(prompt, max_new_tokens=4, do_sample=False), expected)
