"""Chain sessions: each server pushes its output for a step straight to the next server of the
client's chain (swarm/chain_wire.py), which runs the step from whichever copy comes first and answers
the client at once. Through three real servers: greedy, beam search, a left-padded batch and
speculative decoding equal local transformers, with the later hops answering from pushes; hub-spoke
(`ClientOptions.chain_push=False`) gives the same tokens with no push; a middle server killed
mid-generation is replaced and the pushes go on through its replacement, exactly. Hostile pushes (a
wrong token, a peer the client did not name, a session that takes none, oversized, NaN, wrong shapes,
a sender that never finishes) are refused and leave the session as it was; a replayed push is not
run twice; a client's malformed links are refused; servers that push one thing and answer another,
or lie about what they ran, are caught by the digests and unlinked."""

from __future__ import annotations

import asyncio
import math
import signal
import time
import uuid

import pytest
import torch
from hivemind.proto import runtime_pb2
from hivemind.utils.serializer import MSGPackSerializer

from llm_swarm.client import AutoDistributedModelForCausalLM, ClientOptions
from llm_swarm.client.connection import run_sync
from llm_swarm.client.push_copies import COPY_FACTOR, MIN_WAIT, PushCopies
from llm_swarm.client.stream import ServerStream, StepInput
from llm_swarm.swarm.chain_wire import ChainLink, PushedStep, PushSteps, step_digest
from llm_swarm.swarm.dht_keys import default_prefix
from llm_swarm.swarm.errors import SwarmUserError
from llm_swarm.swarm.route_request import RouteHop, SessionShape
from llm_swarm.swarm.step_frame import StepFrame, encode_frame
from llm_swarm.swarm.wire import Open, Step, decode_metadata, encode
from tests.conftest import NUM_BLOCKS
from tests.family_checks import PADDED_TEXTS, PROMPT, REPEATING_PROMPT
from tests.raw_streams import exchange


def info_peer(swarm, prefix: str, name: str) -> str:
    return next(peer for peer, info in swarm.servers(prefix, NUM_BLOCKS).items() if info.public_name == name)


def metric(text: str, name: str) -> float:
    """The value of metric `name` (with its labels, as Prometheus writes them) in a scrape."""
    line = next(line for line in text.splitlines() if line.startswith(name + " "))
    return float(line.split()[-1])


def pushed_answers(streams: list[ServerStream]) -> list[int]:
    return [stream.pushed_answers for stream in streams]


@pytest.mark.swarm
def test_three_servers_push_to_each_other_and_generate_exactly(swarm, llama_dir, local_reference):
    prefix = default_prefix(str(llama_dir))
    for name, blocks in (("a", "0:2"), ("b", "2:4"), ("c", "4:6"), ("b2", "2:4")):
        # every peer counts as near (a loaded machine's loopback pings can take tens of ms)
        near = ("--direct-max-rtt", "10")
        swarm.start_server(
            name, llama_dir, blocks, "1GB", "--next-ping-period", "1", "--metrics-port", "0", *near
        )
    online = swarm.wait_online(prefix, NUM_BLOCKS, ["a", "b", "c", "b2"])
    peers = {name: info_peer(swarm, prefix, name) for name in online}
    # each server measures and announces its round trips to the servers holding the block after its
    # span, which routing prices chain sessions with
    successors = {"a": {"b", "b2"}, "b": {"c"}, "b2": {"c"}, "c": set()}
    swarm.wait_for(
        prefix,
        NUM_BLOCKS,
        lambda online: all(
            set(online[name].next_rtts) == {peers[after] for after in successors[name]} for name in successors
        ),
        60,
        "announced round trips to the next servers",
    )
    reference, tokenizer = local_reference(llama_dir)
    # the client sends its copy of a pushed step only if no answer came within 20 s: every step after
    # the first hop runs from a push (on loopback the copy would otherwise race the push)
    options = ClientOptions(request_timeout=20.0, ban_base=60.0, push_copy_after=20.0, direct_max_rtt=10.0)
    model = AutoDistributedModelForCausalLM.from_pretrained(llama_dir, swarm.initial_peers, options=options)
    hub = AutoDistributedModelForCausalLM.from_pretrained(
        llama_dir, swarm.initial_peers, options=ClientOptions(request_timeout=20.0, chain_push=False)
    )
    # steps, answers and pushes as protobuf messages, as with servers that predate step frames
    unframed = ClientOptions(request_timeout=20.0, direct_max_rtt=10.0, step_frames=False)
    auto = AutoDistributedModelForCausalLM.from_pretrained(llama_dir, swarm.initial_peers, options=unframed)
    try:
        # every step of a session through three hops: the second and third answer from pushes
        expected = reference.generate(PROMPT, max_new_tokens=12, do_sample=False)
        with model.inference_session(max_length=PROMPT.shape[1] + 12) as session:
            assert torch.equal(
                model.generate(PROMPT, max_new_tokens=12, do_sample=False, session=session), expected
            )
            streams = session.blocks.streams
            assert len(streams) == 3 and pushed_answers(streams)[0] == 0
            assert pushed_answers(streams) == [0, 12, 12]  # the prompt's step and 11 decode steps
            # steps, answers and pushes went as step frames: every server announces them
            assert all(stream.step_frames and stream.linked.next_frames for stream in streams[:2])
        # near servers that announce direct streams get the client's streams and their predecessors'
        # pushes over them
        assert model.backend.connection.streams.opened["direct"] >= 3
        counts = {
            (name, kind): metric(swarm.metrics(name), kind)
            for name in online
            for kind in (
                'swarm_server_streams_opened{path="direct"}',
                'swarm_server_streams_opened{path="libp2p"}',
            )
        }
        assert sum(v for (_, kind), v in counts.items() if "direct" in kind) >= 2, counts  # a -> b, b -> c
        assert sum(v for (_, kind), v in counts.items() if "libp2p" in kind) == 0, counts

        # the default client waits a few times a pushed answer's usual delay before sending its own
        # copy: after the first steps, pushes answer and no copy is sent (each dropped copy is one
        # the server parsed for nothing)
        def dropped_copies() -> float:
            name = 'swarm_server_chained_steps{how="copy_dropped"}'
            scrapes = [swarm.metrics(server) for server in ("b", "c")]
            return sum(metric(text, name) for text in scrapes if name + " " in text)  # none yet: absent

        dropped_before = dropped_copies()
        with auto.inference_session(max_length=PROMPT.shape[1] + 12) as session:
            assert torch.equal(
                auto.generate(PROMPT, max_new_tokens=12, do_sample=False, session=session), expected
            )
            streams = session.blocks.streams
            assert all(stream.push_copies.answer_seconds is not None for stream in streams[1:])
            assert not any(stream.step_frames or stream.linked.next_frames for stream in streams)
        assert dropped_copies() - dropped_before < 12
        with hub.inference_session(max_length=PROMPT.shape[1] + 12) as session:
            assert torch.equal(
                hub.generate(PROMPT, max_new_tokens=12, do_sample=False, session=session), expected
            )
            assert pushed_answers(session.blocks.streams) == [0, 0, 0]
        # beam search (the pushes carry its reorderings), a left-padded batch, speculation's rewinds
        beams = reference.generate(PROMPT, max_new_tokens=8, num_beams=3, do_sample=False)
        assert torch.equal(model.generate(PROMPT, max_new_tokens=8, num_beams=3, do_sample=False), beams)
        batch = tokenizer(PADDED_TEXTS, return_tensors="pt", padding=True, padding_side="left")
        padded = reference.generate(**batch, max_new_tokens=8, do_sample=False)
        assert torch.equal(model.generate(**batch, max_new_tokens=8, do_sample=False), padded)
        greedy = reference.generate(REPEATING_PROMPT, max_new_tokens=12, do_sample=False)
        for speculation in ({"prompt_lookup_num_tokens": 3}, {"assistant_model": reference}):
            output = model.generate(REPEATING_PROMPT, max_new_tokens=12, do_sample=False, **speculation)
            assert torch.equal(output, greedy), speculation
        # the middle server killed mid-generation: its replacement is linked in, and pushes go on
        expected = reference.generate(PROMPT, max_new_tokens=16, do_sample=False)
        with model.inference_session(max_length=PROMPT.shape[1] + 16) as session:
            first = model.generate(PROMPT, max_new_tokens=8, do_sample=False, session=session)
            victim = session.blocks.streams[1]
            swarm.stop(model.backend.connection.roster.known[victim.hop.peer_id].public_name, signal.SIGKILL)
            rest = model.generate(None, max_new_tokens=8, do_sample=False)
            streams = session.blocks.streams
            assert victim.hop.peer_id not in [stream.hop.peer_id for stream in streams]
            assert streams[1].pushed_answers == 7  # every step after the one that replaced it
            # the step that failed rode on the replacement's catch-up, which pushed it on to the last
            # server: its answer's digest matched the client's copy, as every later one did
            assert streams[2].pushed_answers == 16 and not session.blocks.unpushed  # 8 steps before, 8 after
        assert torch.equal(torch.cat([first, rest], dim=1), expected)
    finally:
        model.shutdown()
        hub.shutdown()
        auto.shutdown()


@pytest.mark.swarm
def test_hostile_pushes_are_refused_and_a_replayed_push_runs_once(swarm, llama_dir, local_reference):
    """This test's own peer pushes steps into sessions on a real server: only the session that named it
    as predecessor, with its token, takes them; every other push is refused with the reason, and the
    session is exact afterwards."""
    prefix = default_prefix(str(llama_dir))
    swarm.start_server("b", llama_dir, f"0:{NUM_BLOCKS}", "1GB", "--session-timeout", "3")
    swarm.wait_online(prefix, NUM_BLOCKS, ["b"])
    model = AutoDistributedModelForCausalLM.from_pretrained(
        llama_dir, swarm.initial_peers, options=ClientOptions(request_timeout=20.0)
    )
    connection = model.backend.connection
    try:
        servers = run_sync(connection.roster.servers(refresh=True))
        (peer,) = [p for p, info in servers.items() if info.public_name == "b"]
        me = connection.p2p.peer_id.to_base58()
        hop, shape = RouteHop(peer, 0, NUM_BLOCKS), SessionShape(1, 16, l_in=4, l_out=12)
        reference = local_reference(llama_dir)[0]
        width = reference.config.hidden_size

        def session(predecessor: str | None) -> ServerStream:
            """A session of ours on the server, taking pushes from `predecessor` (None: linked, then
            unlinked by its client, as after a push that lied: from nobody)."""
            stream = ServerStream(hop, uuid.uuid4().hex, shape)
            run_sync(stream.open(connection))
            named = ServerStream(RouteHop(predecessor or me, 0, 1), uuid.uuid4().hex, shape)
            run_sync(stream.link(stream.chain_link(named, None), 20.0))
            if predecessor is None:
                run_sync(stream.link(stream.chain_link(None, None), 20.0))
            return stream

        def push(stream: ServerStream, token: str, *steps) -> list[str]:
            header = encode(PushSteps(session_id=stream.session_id, token=token))
            return run_sync(
                exchange(connection, peer, "push_steps", [header, *steps], lambda kinds: not kinds)
            )

        def step(position: int = 0, hidden: torch.Tensor | None = None, framed: bool = False, **fields):
            hidden = torch.randn(1, 2, width) if hidden is None else hidden
            message = PushedStep(step_id=f"x{position}", position=position, **fields)
            return encode_frame(message, [hidden]) if framed else encode(message, [hidden])

        attacks = {  # each on a session of its own, opened right before (sessions expire after 3 s idle)
            "a wrong token": (me, "0" * 32, [step()]),
            "a session that takes no pushes": (None, "1" * 32, [step()]),
            "another predecessor": ("12D3KooWSomeOtherPeerThatIsNotTheTestsOwnPeer", None, [step()]),
            "NaN": (me, None, [step(hidden=torch.full((1, 2, width), math.nan))]),
            "a wrong width": (me, None, [step(hidden=torch.zeros(1, 2, width + 1))]),
            "a wrong batch": (me, None, [step(hidden=torch.zeros(2, 2, width))]),
            "past max_length": (me, None, [step(position=15)]),
            "a mask it does not carry": (me, None, [step(masked=True)]),
            "an oversized message": (me, None, [step(hidden=torch.zeros(1, 4096, width))]),
            "a malformed frame": (me, None, [StepFrame.received(b"\x03" + b"\0" * 7)]),
            "a client's step as a frame": (
                me,
                None,
                [encode_frame(Step(step_id="s", position=0), [torch.zeros(1, 1, width)])],
            ),
            "NaN in a frame": (me, None, [step(hidden=torch.full((1, 2, width), math.nan), framed=True)]),
            "an oversized frame": (me, None, [step(hidden=torch.zeros(1, 4096, width), framed=True)]),
        }
        reasons = {
            "a wrong token": "the token does not match",
            "a session that takes no pushes": "no session here accepts pushed steps",
            "another predecessor": "not the one the session's client named as its predecessor",
            "NaN": "NaN",
            "a wrong width": "hidden size",
            "a wrong batch": "does not fit the session",
            "past max_length": "does not fit the session",
            "a mask it does not carry": "carries 2 tensors",
            "an oversized message": "exceeds this session's limit",
            "a malformed frame": "malformed step frame: 8 bytes are shorter than a frame's header",
            "a client's step as a frame": "a frame of kind 1, expected ['PushedStep']",
            "NaN in a frame": "NaN",
            "an oversized frame": "exceeds this session's limit",
        }
        for what, (predecessor, token, steps) in attacks.items():
            stream = session(predecessor)
            kinds = push(stream, token or stream.push_token, *steps)
            assert len(kinds) == 1 and reasons[what] in kinds[0], (what, kinds)
            run_sync(stream.close_and_wait(5.0))
        # a sender that never finishes: the server ends the stream after its idle timeout (3 s)
        stalled = session(me)
        header = encode(PushSteps(session_id=stalled.session_id, token=stalled.push_token))
        kinds = run_sync(
            asyncio.wait_for(exchange(connection, peer, "push_steps", [header], lambda k: not k), 30)
        )
        assert kinds and kinds[-1].startswith(("error", "closed")), kinds
        run_sync(stalled.close_and_wait(5.0))
        # a push into the session that named us runs (a step frame), answered unasked; the same push
        # again (as a protobuf message) does not run twice; the session goes on from the client at the
        # next position
        ours = session(me)
        hidden = torch.randn(1, 3, width)
        header = encode(PushSteps(session_id=ours.session_id, token=ours.push_token))
        sent = [header, step(0, hidden, framed=True), step(0, hidden)]
        assert run_sync(exchange(connection, peer, "push_steps", sent, lambda kinds: False)) == []
        deadline = time.monotonic() + 20
        while ours.replies_waiting < 1:  # the server's answer to the push, unasked
            assert time.monotonic() < deadline, "the pushed step was not answered"
            time.sleep(0.05)
        time.sleep(0.5)
        assert ours.replies_waiting == 1  # the same push again did not run again
        output = run_sync(ours.step(StepInput(hidden, 0, None, None, None, 0), 20.0, step_id="x0"))
        assert ours.pushed_answers == 1 and output.shape == hidden.shape
        later = run_sync(ours.step(StepInput(torch.randn(1, 1, width), 3, None, None, None, 0), 20.0))
        assert later.shape == (1, 1, width) and ours.pushed_answers == 1
        run_sync(ours.close_and_wait(5.0))

        # a client's malformed links are refused one by one, and the session goes on: a step that asks
        # to be pushed to a peer that is no peer at all is still answered (the push is dropped)
        def raw(**fields) -> runtime_pb2.ExpertRequest:
            return runtime_pb2.ExpertRequest(
                metadata=MSGPackSerializer.dumps({"type": "chain_link", **fields})
            )

        opening = Open(session_id=uuid.uuid4().hex, max_length=16, batch_size=1, start=0, end=NUM_BLOCKS)
        requests = [
            encode(opening),
            raw(accept_token="a" * 32),
            raw(next_peer=peer, next_session="s" * 32),
            raw(accept_token="not hex", accept_from=me),
            raw(next_peer="x" * 10_000, next_session="s" * 32, next_token="b" * 32),
            raw(accept_token="c" * 32, accept_from=me, surprise=1),
            encode(ChainLink(next_peer="not-a-peer-id", next_session="s" * 32, next_token="b" * 32)),
            encode(Step(step_id="s0", position=0, push_hops=1), [torch.randn(1, 2, width)]),
        ]
        kinds = run_sync(exchange(connection, peer, "rpc_inference", requests, lambda kinds: len(kinds) < 7))
        assert kinds[0] == "opened" and kinds[-1] == "step_done", kinds
        assert "accept_token and accept_from come together" in kinds[1], kinds
        assert "next_peer, next_session and next_token come together" in kinds[2], kinds
        assert all(kind.startswith("error: invalid chain_link message") for kind in kinds[3:6]), kinds
        # an honest session afterwards is exact
        output, expected = (m.generate(PROMPT, max_new_tokens=6, do_sample=False) for m in (model, reference))
        assert torch.equal(output, expected)
    finally:
        model.shutdown()


@pytest.mark.swarm
def test_a_server_that_pushes_one_thing_and_answers_another_and_one_that_lies_about_its_input_are_caught(
    swarm, llama_dir, local_reference
):
    """Through x -> y -> z: x answers its client honestly but pushes noise to y; z runs y's pushes
    honestly but answers with a false digest of its input. The client compares each pushed answer's
    digest with its own copy of that input (the previous server's answer), so both pairs are caught at
    the first step and unlinked, the step runs again from the client's copies, and the tokens equal
    local transformers."""
    prefix = default_prefix(str(llama_dir))
    swarm.start_server("x", llama_dir, "0:2", "1GB", module=("tests.lying_server", "push-noise"))
    swarm.start_server("y", llama_dir, "2:4", "1GB")
    swarm.start_server("z", llama_dir, "4:6", "1GB", module=("tests.lying_server", "digest"))
    swarm.wait_online(prefix, NUM_BLOCKS, ["x", "y", "z"])
    peers = {name: info_peer(swarm, prefix, name) for name in ("x", "y", "z")}
    reference = local_reference(llama_dir)[0]
    options = ClientOptions(request_timeout=20.0, push_copy_after=20.0)
    model = AutoDistributedModelForCausalLM.from_pretrained(llama_dir, swarm.initial_peers, options=options)
    try:
        expected = reference.generate(PROMPT, max_new_tokens=6, do_sample=False)
        with model.inference_session(max_length=PROMPT.shape[1] + 6) as session:
            output = model.generate(PROMPT, max_new_tokens=6, do_sample=False, session=session)
            assert torch.equal(output, expected)
            assert session.blocks.unpushed == {(peers["x"], peers["y"]), (peers["y"], peers["z"])}
            assert pushed_answers(session.blocks.streams) == [0, 0, 0]
    finally:
        model.shutdown()


@pytest.mark.version_neutral
def test_the_client_s_copy_of_a_pushed_step_waits_while_pushes_answer_and_goes_at_once_after_one_did_not():
    copies = PushCopies()
    assert copies.copy_after() is None  # nothing timed yet: at once
    copies.answered(0.001, pushed=True)
    assert copies.copy_after() == pytest.approx(max(MIN_WAIT, COPY_FACTOR * 0.001))
    copies.answered(0.011, pushed=True)  # a moving average: one slow answer moves it a fifth of the way
    assert copies.answer_seconds == pytest.approx(0.003)
    assert copies.copy_after() == pytest.approx(COPY_FACTOR * 0.003)
    copies.answered(0.5, pushed=False)  # the push failed (the copy answered): the next copy goes at once
    assert copies.copy_after() is None and copies.answer_seconds == pytest.approx(0.003)
    copies.answered(0.002, pushed=True)  # pushes answer again
    assert copies.copy_after() == pytest.approx(COPY_FACTOR * (0.8 * 0.003 + 0.2 * 0.002))
    with pytest.raises(SwarmUserError):
        ClientOptions(push_copy_after="soon")
    with pytest.raises(SwarmUserError):
        ClientOptions(push_copy_after=-1.0)
    assert ClientOptions(push_copy_after=None).push_copy_after is None


@pytest.mark.version_neutral
def test_a_step_that_pushes_nothing_is_the_message_older_servers_know_and_digests_tell_inputs_apart():
    """`push_hops=0` is left out of a step (servers that predate chain sessions refuse unknown
    fields), and the digest a pushed answer carries changes with the hidden states, the padding mask
    and the reordering alike."""
    plain = decode_metadata(encode(Step(step_id="s", position=0)).metadata)
    assert (
        "push_hops" not in plain
        and decode_metadata(encode(Step(step_id="s", position=0, push_hops=2)).metadata)["push_hops"] == 2
    )
    hidden, mask = torch.randn(1, 2, 8), torch.ones(1, 2, dtype=torch.long)
    digest = step_digest(hidden, None, None)
    assert digest == step_digest(hidden.clone(), None, None)
    changed = hidden.clone()
    changed[0, 1, 3] += 1e-6
    others = {
        step_digest(changed, None, None),
        step_digest(hidden, mask, None),
        step_digest(hidden, None, (0,)),
    }
    assert digest not in others and len(others) == 3
