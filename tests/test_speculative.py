"""Speculative decoding through real servers equals local transformers token for token.

One swarm per family (BLOOM, LLaMA with grouped-query attention): two servers for blocks 0:3 and
two for 3:6, so that replicas can verify and a killed server has a replacement. The kill runs last.
"""

from __future__ import annotations

import copy
import signal
import time

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.generation.streamers import BaseStreamer

from harness.local_swarm import LocalSwarm
from llm_swarm.client import AutoDistributedModelForCausalLM, ClientOptions
from llm_swarm.client.speculation import DraftLengthOptions
from llm_swarm.swarm.dht_keys import default_prefix
from llm_swarm.swarm.models.tiny import TinyModelSpec, build_tiny_model
from tests.conftest import NUM_BLOCKS

pytestmark = pytest.mark.swarm  # every test here starts processes

PROMPT = torch.tensor([[5, 17, 99, 200, 33, 41, 7, 5, 17, 99]])
BATCH = torch.tensor([[0, 0, 0, 5, 17, 99, 200], [3, 9, 27, 81, 243, 11, 3], [0, 8, 8, 8, 8, 8, 8]])
BATCH_MASK = (BATCH != 0).long()
OPTIONS = ClientOptions(request_timeout=20.0, ban_base=2.0, wait_for_servers=30.0)


class Family:
    def __init__(self, swarm: LocalSwarm, model_dir, draft_dir, prefix: str):
        self.swarm, self.model_dir, self.prefix = swarm, model_dir, prefix
        self.reference = AutoModelForCausalLM.from_pretrained(model_dir).eval()
        self._draft = AutoModelForCausalLM.from_pretrained(draft_dir).eval()  # 2 blocks, same tokenizer

    @property
    def draft(self):
        """A fresh copy at each use: with scikit-learn installed, transformers' assisted generation tunes
        the assistant's confidence threshold (in its generation_config) as it goes, so a shared draft
        would start each generation, the local reference's and the swarm's, from another threshold."""
        return copy.deepcopy(self._draft)

    def client(self, **options) -> AutoDistributedModelForCausalLM:
        settings = {**OPTIONS.__dict__, **options}
        return AutoDistributedModelForCausalLM.from_pretrained(
            self.model_dir, self.swarm.initial_peers, options=ClientOptions(**settings)
        )


@pytest.fixture(scope="module", params=["bloom", "llama"])
def family(request, bloom_dir, llama_dir, tmp_path_factory):
    model_dir = bloom_dir if request.param == "bloom" else llama_dir
    spec = TinyModelSpec(
        family=request.param, num_layers=2, num_kv_heads=2 if request.param == "llama" else None
    )
    draft_dir = build_tiny_model(tmp_path_factory.mktemp(f"draft-{request.param}"), spec)
    swarm = LocalSwarm(tmp_path_factory.mktemp(f"speculative-{request.param}"))
    try:
        swarm.start_dht()
        spans = {"a": "0:3", "a2": "0:3", "b": "3:6", "b2": "3:6"}
        for name, blocks in spans.items():
            swarm.start_server(name, model_dir, blocks)
        prefix = default_prefix(str(model_dir))
        swarm.wait_online(prefix, NUM_BLOCKS, list(spans))
        yield Family(swarm, model_dir, draft_dir, prefix)
    finally:
        assert not swarm.close(), "process groups left running"


@pytest.mark.compat
def test_greedy_with_an_assistant_and_with_prompt_lookup_equals_local_greedy(family):
    expected = family.reference.generate(PROMPT, max_new_tokens=30, do_sample=False)
    model = family.client()
    try:
        with model.inference_session(max_length=64) as session:
            assisted = model.generate(
                PROMPT, max_new_tokens=30, do_sample=False, assistant_model=family.draft
            )
            drafts = session.draft_stats
        perfect = model.generate(PROMPT, max_new_tokens=30, do_sample=False, assistant_model=family.reference)
        lookup = model.generate(PROMPT, max_new_tokens=30, do_sample=False, prompt_lookup_num_tokens=4)
    finally:
        model.shutdown()
    assert torch.equal(assisted, expected)
    assert torch.equal(perfect, expected)
    assert torch.equal(lookup, expected)
    assert drafts.rounds > 0  # it did speculate


def test_batched_speculation_equals_local_batched_greedy(family):
    expected = family.reference.generate(
        BATCH, attention_mask=BATCH_MASK, max_new_tokens=24, do_sample=False, pad_token_id=0
    )
    model = family.client()
    try:
        outputs = {
            name: model.generate(
                BATCH, attention_mask=BATCH_MASK, max_new_tokens=24, do_sample=False, pad_token_id=0, **extra
            )
            for name, extra in {
                "draft": {"assistant_model": family.draft},
                "perfect": {"assistant_model": family.reference},
                "lookup": {"prompt_lookup_num_tokens": 3},
            }.items()
        }
    finally:
        model.shutdown()
    for name, output in outputs.items():
        assert torch.equal(output, expected), name


def test_assisted_sampling_with_a_seed_equals_local_assisted_sampling(family):
    # transformers' own draft schedule on both sides, so both consume the same random numbers
    torch.manual_seed(1234)
    expected = family.reference.generate(
        PROMPT, max_new_tokens=24, do_sample=True, top_k=0, assistant_model=family.draft
    )
    model = family.client()
    model.speculation = DraftLengthOptions(adaptive=False)
    try:
        torch.manual_seed(1234)
        output = model.generate(
            PROMPT, max_new_tokens=24, do_sample=True, top_k=0, assistant_model=family.draft
        )
    finally:
        model.shutdown()
    assert torch.equal(output, expected)


def test_with_every_step_verified_by_a_replica_assisted_decoding_stays_exact(family):
    expected = family.reference.generate(PROMPT, max_new_tokens=20, do_sample=False)
    torch.manual_seed(99)
    sampled = family.reference.generate(
        PROMPT, max_new_tokens=20, do_sample=True, top_k=0, assistant_model=family.draft
    )
    model = family.client(verify_fraction=1.0)
    model.speculation = DraftLengthOptions(adaptive=False)  # transformers' schedule: the same draws
    try:
        output = model.generate(PROMPT, max_new_tokens=20, do_sample=False, assistant_model=family.draft)
        torch.manual_seed(99)
        output_sampled = model.generate(
            PROMPT, max_new_tokens=20, do_sample=True, top_k=0, assistant_model=family.draft
        )
        verified = model.backend.connection.verified_steps
    finally:
        model.shutdown()
    assert torch.equal(output, expected)
    assert torch.equal(output_sampled, sampled)
    assert verified > 0


def _hop_outputs(session) -> list[torch.Tensor]:
    """What every server of the chain returned for the session's last step (the next hop's input)."""
    streams = session.blocks.streams
    return [stream.history[-1].hidden for stream in streams[1:]]


def _server_room(family: Family) -> dict[str, int]:
    return {
        peer: info.cache_bytes_left for peer, info in family.swarm.servers(family.prefix, NUM_BLOCKS).items()
    }


def _settled_room(family: Family, timeout: float = 15.0) -> dict[str, int]:
    """The servers' announced free cache once two reads 1 s apart agree: servers announce session
    opens and closes asynchronously, so one read may predate the last of them."""
    deadline = time.monotonic() + timeout
    room = _server_room(family)
    while time.monotonic() < deadline:
        time.sleep(1.0)
        again = _server_room(family)
        if again == room:
            return room
        room = again
    return room


def test_a_rewound_session_continues_as_one_that_never_went_past_the_rewind(family):
    model = family.client()
    parts = model.client_parts
    tokens = torch.tensor([[5, 17, 99, 200, 33, 41, 7, 8, 9, 10]])
    other = torch.tensor([[77, 78]])
    try:
        with (
            model.inference_session(max_length=32) as rewound,
            model.inference_session(max_length=32) as straight,
        ):
            rewound.step(tokens, parts.embed_tokens(tokens), None)
            room_before = _settled_room(family)  # both sessions' reservations announced
            rewound.rewind(6)  # positions 6..9 rejected: the next step overwrites them
            assert rewound.position == 6 and torch.equal(rewound.token_ids, tokens[:, :6])
            out_rewound = rewound.step(other, parts.embed_tokens(other), None)
            straight.step(tokens[:, :6], parts.embed_tokens(tokens[:, :6]), None)
            out_straight = straight.step(other, parts.embed_tokens(other), None)
            hops = list(zip(_hop_outputs(rewound), _hop_outputs(straight), strict=True)) + [
                (out_rewound, out_straight)
            ]
            assert _settled_room(family) == room_before  # the DHT records: a rewind reserves nothing
            with pytest.raises(Exception, match="cannot rewind"):
                rewound.rewind(9)  # past what the session holds now (8)
            with pytest.raises(Exception, match="cannot rewind"):
                rewound.rewind(-1)
    finally:
        model.shutdown()
    for got, want in hops:
        assert torch.allclose(got, want, atol=1e-5, rtol=0), (got - want).abs().max()


class _KillAfter(BaseStreamer):
    """Kills a server of the chain once `rounds` verification rounds have put their tokens."""

    def __init__(self, swarm: LocalSwarm, name: str, rounds: int):
        self.swarm, self.name, self.rounds, self.puts = swarm, name, rounds, 0

    def put(self, value) -> None:
        self.puts += 1
        if self.puts == self.rounds + 1:  # the first put is the prompt
            self.swarm.stop(self.name, signal.SIGKILL)

    def end(self) -> None:
        pass


def _chain_member(family: Family, session, hop: int) -> str:
    """The name of the server at `hop` of the session's chain."""
    peer = session.blocks.streams[hop].hop.peer_id
    names = {
        info.public_name: peer_id for peer_id, info in family.swarm.servers(family.prefix, NUM_BLOCKS).items()
    }
    return next(name for name, peer_id in names.items() if peer_id == peer and name in family.swarm.processes)


def test_a_server_killed_between_two_verification_rounds_is_replaced_and_output_stays_exact(family):
    """Runs last for each family: it kills one server of each span (their twins take over)."""
    expected = family.reference.generate(PROMPT, max_new_tokens=30, do_sample=False)
    torch.manual_seed(5)
    sampled = family.reference.generate(
        PROMPT, max_new_tokens=30, do_sample=True, top_k=0, assistant_model=family.draft
    )
    model = family.client()
    try:
        with model.inference_session(max_length=64) as session:
            first = session.blocks.streams[0].hop.peer_id
            killer = _KillAfter(family.swarm, _chain_member(family, session, 0), rounds=2)
            output = model.generate(
                PROMPT,
                max_new_tokens=30,
                do_sample=False,
                assistant_model=family.draft,
                streamer=killer,
                session=session,
            )
            assert first not in [stream.hop.peer_id for stream in session.blocks.streams]
        model.speculation = DraftLengthOptions(adaptive=False)
        with model.inference_session(max_length=64) as session:
            last = session.blocks.streams[-1].hop.peer_id
            sampling_killer = _KillAfter(family.swarm, _chain_member(family, session, -1), rounds=2)
            torch.manual_seed(5)
            output_sampled = model.generate(
                PROMPT,
                max_new_tokens=30,
                do_sample=True,
                top_k=0,
                assistant_model=family.draft,
                streamer=sampling_killer,
                session=session,
            )
            assert last not in [stream.hop.peer_id for stream in session.blocks.streams]
    finally:
        model.shutdown()
    assert killer.puts > 3 and sampling_killer.puts > 3, "a generation ended before its kill"
    assert torch.equal(output, expected)
    assert torch.equal(output_sampled, sampled)
