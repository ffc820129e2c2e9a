"""Cache hand-offs between servers: a server that drains hands its sessions' caches to a
server holding the same blocks, and generation stays equal to local transformers; a hand-off that
cannot finish falls back to replay; hostile pushes are refused and leave nothing behind."""

from __future__ import annotations

import json
import math
import re
import signal
import threading
import time
import uuid

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from llm_swarm.client import AutoDistributedModelForCausalLM, ClientOptions
from llm_swarm.client.connection import run_sync
from llm_swarm.client.stream import ServerStream, StepInput
from llm_swarm.server.handler import PUSH_HANDLE
from llm_swarm.swarm.dht_keys import default_prefix
from llm_swarm.swarm.handoff_wire import CacheChunk, PushCache
from llm_swarm.swarm.route_request import RouteHop, SessionShape
from llm_swarm.swarm.wire import decode_tensors, encode
from tests.conftest import NUM_BLOCKS
from tests.raw_streams import exchange

PROMPT = torch.tensor([[5, 17, 99, 200, 33, 41, 7]])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a server's cache on a GPU")
def test_a_cache_chunk_on_a_gpu_is_sent_from_host_memory():
    """A server on a GPU pushes chunks of its CUDA cache; hivemind serializes host tensors only
    (every hand-off from a GPU server failed before the wire copied them; found on an H200)."""
    keys = torch.randn(1, 2, 3, 4, device="cuda")
    values = torch.randn(1, 2, 3, 4, device="cuda", dtype=torch.float16)
    sent = decode_tensors(encode(CacheChunk(block=0, position=0), [keys, values]))
    assert torch.equal(sent[0], keys.cpu()) and torch.equal(sent[1], values.cpu())


def _wait_for_log(swarm, name: str, text: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while text not in swarm.log(name):
        assert time.monotonic() < deadline, f"{name} never logged {text!r}:\n{swarm.log(name)[-2000:]}"
        time.sleep(0.1)


@pytest.mark.swarm
def test_a_draining_server_hands_its_sessions_off_exactly(swarm, llama_dir):
    model_dir = llama_dir
    prefix = default_prefix(str(model_dir))
    for name in ("a", "b", "c"):  # each round drains the one serving the session
        # roster rounds every second: each server learns the others' direct addresses soon after
        # their records appear, whatever order they came online in
        swarm.start_server(
            name, model_dir, f"0:{NUM_BLOCKS}", "1GB", "--drain-timeout", "60", "--next-ping-period", "1"
        )
    swarm.wait_online(prefix, NUM_BLOCKS, ["a", "b", "c"])
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
                victim = model.backend.connection.roster.known[stream.hop.peer_id].public_name
                swarm.processes[victim].send_signal(signal.SIGTERM)
                _wait_for_log(swarm, victim, "draining")
                rest = model.generate(None, max_new_tokens=8, do_sample=False)
                (moved,) = session.blocks.streams
                assert moved.hop.peer_id != stream.hop.peer_id
            assert torch.equal(torch.cat([first, rest], dim=1), expected)
            _wait_for_log(swarm, victim, "handed")
            assert swarm.processes[victim].wait(30) == 0  # its drain ended when the session left
        # by the second drain every server has read the others' direct addresses: the cache went
        # over a direct stream
        (handed,) = [line for line in swarm.log(victim).splitlines() if "handed" in line]
        assert handed.endswith(", direct)"), handed
    finally:
        model.shutdown()


@pytest.mark.swarm
def test_a_server_the_scheduler_moves_hands_its_session_off_exactly(swarm, llama_dir, local_reference):
    """A hand-off for a move: a managed server that the scheduler moves to another span while
    a session is open on it hands the session's cache to a server holding the session's blocks (the
    only one: `spare`, made slower so that the session starts on the mover), and generation stays
    equal to local transformers; the mover then serves its new span."""
    from tests.test_server_managed import (
        ScriptedScheduler,
        scripted_scheduler,
        start_managed,
        wait_announced,
        wait_spans,
    )

    prefix = default_prefix(str(llama_dir))
    scheduler = ScriptedScheduler()
    with scripted_scheduler(swarm, prefix, scheduler):
        options = ["--scheduler-timeout", "1", "--assignment-poll", "0.5", "--drain-timeout", "60"]
        start_managed(swarm, "mover", llama_dir, 10**9, *options)
        mover = wait_announced(swarm, prefix, {"mover"})[1]["mover"]
        scheduler.epoch, scheduler.spans = 1, {mover: (0, NUM_BLOCKS)}
        swarm.start_server("spare", llama_dir, f"0:{NUM_BLOCKS}", "1GB", "--compute-delay", "0.02")
        wait_spans(swarm, prefix, {"mover": (0, NUM_BLOCKS), "spare": (0, NUM_BLOCKS)})
        reference = local_reference(llama_dir)[0]
        expected = reference.generate(PROMPT, max_new_tokens=16, do_sample=False)
        model = AutoDistributedModelForCausalLM.from_pretrained(
            llama_dir, swarm.initial_peers, options=ClientOptions(request_timeout=20.0)
        )
        try:
            with model.inference_session(max_length=PROMPT.shape[1] + 16) as session:
                first = model.generate(PROMPT, max_new_tokens=8, do_sample=False, session=session)
                (stream,) = session.blocks.streams
                assert stream.hop.peer_id == mover
                scheduler.epoch, scheduler.spans = 2, {mover: (1, NUM_BLOCKS)}  # the move
                _wait_for_log(swarm, "mover", "draining 1 sessions")
                rest = model.generate(None, max_new_tokens=8, do_sample=False)
                (moved,) = session.blocks.streams
                assert moved.hop.peer_id != mover
                assert model.backend.connection.roster.known[moved.hop.peer_id].public_name == "spare"
            assert torch.equal(torch.cat([first, rest], dim=1), expected)
        finally:
            model.shutdown()
        _wait_for_log(swarm, "mover", "handed")
        _wait_for_log(swarm, "spare", "received a cache")
        wait_spans(swarm, prefix, {"mover": (1, NUM_BLOCKS)})


@pytest.mark.swarm
@pytest.mark.parametrize("fault", ["die-pushing", "die-receiving"])
def test_a_handoff_cut_half_way_falls_back_to_replay(swarm, fault, llama_dir, bloom_dir):
    """The leaving server dies after its first chunk (BLOOM), or the receiving one does (LLaMA): the
    client replays instead, onto a server that joins later, and the output stays exact."""
    model_dir = bloom_dir if fault == "die-pushing" else llama_dir
    prefix, blocks = default_prefix(str(model_dir)), f"0:{NUM_BLOCKS}"
    faulty = ("tests.faulty_handoff_server", fault)
    drain = ("--drain-timeout", "60")
    swarm.start_server(
        "leaving",
        model_dir,
        blocks,
        "1GB",
        *drain,
        module=faulty if fault == "die-pushing" else ("llm_swarm.server.cli",),
    )
    swarm.wait_online(prefix, NUM_BLOCKS, ["leaving"])
    reference = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    expected = reference.generate(PROMPT, max_new_tokens=16, do_sample=False)
    options = ClientOptions(request_timeout=20.0, wait_for_servers=90.0)
    model = AutoDistributedModelForCausalLM.from_pretrained(model_dir, swarm.initial_peers, options=options)
    try:
        with model.inference_session(max_length=PROMPT.shape[1] + 16) as session:
            first = model.generate(PROMPT, max_new_tokens=8, do_sample=False, session=session)
            receiver = faulty if fault == "die-receiving" else ("llm_swarm.server.cli",)
            swarm.start_server("target", model_dir, blocks, "1GB", module=receiver)
            swarm.wait_online(prefix, NUM_BLOCKS, ["leaving", "target"])
            swarm.processes["leaving"].send_signal(signal.SIGTERM)
            _wait_for_log(swarm, "leaving", "draining")
            result: dict = {}
            worker = threading.Thread(
                target=lambda: result.update(
                    rest=model.generate(None, max_new_tokens=8, do_sample=False, session=session)
                )
            )
            worker.start()
            dead = "leaving" if fault == "die-pushing" else "target"
            swarm.processes[dead].wait(60)  # it died in the middle of the push
            if fault == "die-receiving":  # the replay needs a server for the blocks: one joins now
                swarm.start_server("late", model_dir, blocks, "1GB")
            worker.join(120)
            assert not worker.is_alive() and "rest" in result
        assert torch.equal(torch.cat([first, result["rest"]], dim=1), expected)
    finally:
        model.shutdown()


async def _push(connection, peer_id: str, requests: list) -> list[str]:
    """Send `requests` on a push stream to `peer_id` as they are; the types of the replies until the
    server ends (an error, or the cache accepted)."""
    return await exchange(
        connection, peer_id, PUSH_HANDLE, requests, lambda kinds: not kinds or kinds[-1] == "chunk_ack"
    )


@pytest.mark.swarm
def test_hostile_pushes_are_refused_and_leave_nothing_behind(swarm, llama_dir, local_reference):
    """This test's own peer pushes caches it was not given, or malformed ones, into a real server:
    each is refused, the session stays empty and usable, and an honest session is exact after."""
    prefix = default_prefix(str(llama_dir))
    swarm.start_server("b", llama_dir, f"0:{NUM_BLOCKS}", "1GB", "--session-timeout", "3")
    (b_info,) = swarm.wait_online(prefix, NUM_BLOCKS, ["b"]).values()
    model = AutoDistributedModelForCausalLM.from_pretrained(
        llama_dir, swarm.initial_peers, options=ClientOptions(request_timeout=20.0)
    )
    connection = model.backend.connection
    try:
        (peer,) = [p for p, info in connection.roster.known.items() if info.public_name == "b"] or [
            p
            for p, info in run_sync(connection.roster.servers(refresh=True)).items()
            if info.public_name == "b"
        ]
        me = connection.p2p.peer_id.to_base58()
        hop, shape = RouteHop(peer, 0, NUM_BLOCKS), SessionShape(1, 16, l_in=4, l_out=12)
        kv = llama_kv_shape(llama_dir)

        def session(cache_from: str) -> tuple[ServerStream, str]:
            stream = ServerStream(hop, uuid.uuid4().hex, shape)
            token = run_sync(stream.open(connection, cache_from=cache_from))
            return stream, token

        def chunk(block: int, position: int, keys: torch.Tensor, values: torch.Tensor | None = None):
            return encode(
                CacheChunk(block=block, position=position), [keys, keys if values is None else values]
            )

        def header(stream: ServerStream, token: str, length: int = 2):
            return encode(PushCache(session_id=stream.session_id, token=token, length=length))

        good = torch.zeros(1, kv[0], 2, kv[1])

        def attack(what: str) -> list:
            """The requests of one hostile push, into a session opened for it."""
            if what == "another sender":  # the session's client named the server, not us
                stream, token = session(cache_from=peer)
                return [header(stream, token)]
            if what == "a session that expects nothing":  # someone else's ordinary session
                return [header(session(cache_from=None)[0], "1" * 32)]
            stream, token = session(cache_from=me)
            bad = {
                "a wrong token": [header(stream, "0" * 32)],
                "more tokens than the session": [header(stream, token, length=17)],
                "a wrong shape": [header(stream, token), chunk(0, 0, torch.zeros(1, kv[0] + 1, 2, kv[1]))],
                "NaN": [header(stream, token), chunk(0, 0, torch.full_like(good, math.nan))],
                "past the pushed length": [
                    header(stream, token),
                    chunk(0, 0, torch.zeros(1, kv[0], 3, kv[1])),
                ],
                "out of order": [header(stream, token), chunk(0, 1, torch.zeros(1, kv[0], 1, kv[1]))],
                "a block the session lacks": [header(stream, token), chunk(NUM_BLOCKS, 0, good)],
                "a sender that never finishes": [header(stream, token), chunk(0, 0, good)],
            }
            return bad[what]

        attacks = (
            "another sender",
            "a session that expects nothing",
            "a wrong token",
            "more tokens than the session",
            "a wrong shape",
            "NaN",
            "past the pushed length",
            "out of order",
            "a block the session lacks",
            "a sender that never finishes",
        )
        for what in attacks:
            kinds = run_sync(_push(connection, peer, attack(what)))
            assert kinds[-1].startswith("error"), (what, kinds)
        # every session above is still empty and usable: a step at position 0 runs on the real server
        stream, _ = session(cache_from=me)
        run_sync(_push(connection, peer, [header(stream, "f" * 32)]))
        hidden = torch.randn(1, 3, 64)
        output = run_sync(stream.step(StepInput(hidden, 0, None, None, None, 0), 20.0))
        assert output.shape == hidden.shape and torch.isfinite(output).all()
        run_sync(stream.close_and_wait(5.0))
        # an honest session afterwards is exact, and every reservation was released
        reference = local_reference(llama_dir)[0]
        expected = reference.generate(PROMPT, max_new_tokens=8, do_sample=False)
        assert torch.equal(model.generate(PROMPT, max_new_tokens=8, do_sample=False), expected)
    finally:
        model.shutdown()
    deadline = time.monotonic() + 30
    left = None
    while left != b_info.cache_bytes_left:  # sessions the attacks opened end at the 3 s idle timeout
        assert time.monotonic() < deadline, (left, b_info.cache_bytes_left)
        time.sleep(0.5)
        info = swarm.servers(prefix, NUM_BLOCKS).get(peer)
        left = info.cache_bytes_left if info is not None else None


def llama_kv_shape(model_dir) -> tuple[int, int]:
    config = json.loads((model_dir / "config.json").read_text())
    heads = config["num_attention_heads"]
    return config.get("num_key_value_heads", heads), config["hidden_size"] // heads


@pytest.mark.swarm
def test_prompts_run_on_prefill_servers_and_decode_servers_continue_exactly(swarm, model_dir):
    """`--role prefill` and `--role decode`, two hops (BLOOM, LLaMA-GQA): the decode servers prefill
    slowly (emulated 10 ms per block per token, far above what the prefill servers measure for their
    real prefill even on a busy host, so the choice never hangs on the timings each server measured
    at its start), so the client sends each prompt to the prefill servers, whose caches are handed
    to the decode servers of their hops (both hops at once), each streamed while its prompt runs (in
    chunks of 2 tokens here, so the push interleaves blocks and position ranges)."""
    prefix = default_prefix(str(model_dir))
    half = NUM_BLOCKS // 2
    spans = {"a": f"0:{half}", "b": f"{half}:{NUM_BLOCKS}"}
    for hop, blocks in spans.items():
        swarm.start_server(
            f"prefill-{hop}",
            model_dir,
            blocks,
            "1GB",
            "--role",
            "prefill",
            "--prefill-chunk",
            "2",
            "--metrics-port",
            "0",
        )
        swarm.start_server(
            f"decode-{hop}",
            model_dir,
            blocks,
            "1GB",
            "--role",
            "decode",
            "--compute-delay-per-token",
            "0.01",
        )
    names = [f"{role}-{hop}" for role in ("prefill", "decode") for hop in spans]
    online = swarm.wait_online(prefix, NUM_BLOCKS, names)
    assert [online[name].role for name in names] == ["prefill", "prefill", "decode", "decode"]
    reference = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    batch = tokenizer(
        ["A cat sat on a mat", "one two"], return_tensors="pt", padding=True, padding_side="left"
    )
    # the client's copy of a pushed step goes only after 20 s without an answer: on loopback it would
    # race the push
    model = AutoDistributedModelForCausalLM.from_pretrained(
        model_dir, swarm.initial_peers, options=ClientOptions(request_timeout=20.0, push_copy_after=20.0)
    )
    try:
        for inputs in ({"input_ids": PROMPT}, dict(batch)):
            expected = reference.generate(**inputs, max_new_tokens=10, do_sample=False)
            assert torch.equal(model.generate(**inputs, max_new_tokens=10, do_sample=False), expected)
        # the first token returns before the hand-offs end; a session that ends there waits for them
        # at its close, then frees every server
        expected = reference.generate(PROMPT, max_new_tokens=1, do_sample=False)
        assert torch.equal(model.generate(PROMPT, max_new_tokens=1, do_sample=False), expected)
        # a client that holds the first token until the hand-offs end: the prompt step returns with
        # the chain already on the decode servers
        holding = AutoDistributedModelForCausalLM.from_pretrained(
            model_dir,
            swarm.initial_peers,
            options=ClientOptions(request_timeout=20.0, first_token_before_handoff=False),
        )
        try:
            with holding.inference_session(max_length=PROMPT.shape[1] + 4) as session:
                first = holding.generate(PROMPT, max_new_tokens=1, do_sample=False, session=session)
                assert session.blocks._handing is None
                assert [s.hop.peer_id for s in session.blocks.streams] == [
                    _peer(swarm, prefix, f"decode-{hop}") for hop in spans
                ]
                rest = holding.generate(None, max_new_tokens=3, do_sample=False, session=session)
            expected = reference.generate(PROMPT, max_new_tokens=4, do_sample=False)
            assert torch.equal(torch.cat([first, rest], dim=1), expected)
        finally:
            holding.shutdown()
        swarm.wait_for(
            prefix, NUM_BLOCKS, lambda online: all(online[name].active_sessions == 0 for name in names), 30
        )
        for hop in spans:
            _wait_for_log(swarm, f"prefill-{hop}", "while computing them")
            _wait_for_log(swarm, f"decode-{hop}", "received a cache")
            assert "handed" not in swarm.log(f"decode-{hop}")  # decoding stayed on the decode servers
            # each prefill server announces the link it measured to its hop's decode server
            decode_peer = _peer(swarm, prefix, f"decode-{hop}")
            swarm.wait_for(
                prefix,
                NUM_BLOCKS,
                lambda online, hop=hop, peer=decode_peer: list(online[f"prefill-{hop}"].links) == [peer],
                30,
            )
        # a chain session: the first hop's prefill server pushed each prompt's output to the second's,
        # which ran it from the push while its cache followed to its decode server
        pushed = re.search(
            r'swarm_server_chained_steps_total\{how="pushed"\} ([0-9.]+)', swarm.metrics("prefill-b")
        )
        assert pushed is not None and float(pushed.group(1)) >= 1
    finally:
        model.shutdown()


@pytest.mark.swarm
def test_the_scheduler_plans_where_prompts_run_and_spreads_them(swarm, llama_dir, caplog, local_reference):
    """WS-RR routes both phases: decode chains only through servers that decode, and each
    session's prompt to the prefill server the scheduler chose (by queue, prefill and hand-off), whose
    cache then goes to the decode server. Two prefill servers, two sessions at once: one each."""
    prefix = default_prefix(str(llama_dir))
    whole = f"0:{NUM_BLOCKS}"
    swarm.start_scheduler("scheduler", llama_dir)
    # emulated prefill: 2.4 s for the prompt on a prefill server, 12 s on a decode server, so the
    # second session (routed well within 2.4 s of the first) finds the first prefill server busy
    for name in ("prefill-1", "prefill-2"):
        swarm.start_server(
            name, llama_dir, whole, "1GB", "--role", "prefill", "--link-probe-period", "1",
            "--compute-delay-per-token", "0.01",
        )  # fmt: skip
    for name in ("decode-1", "decode-2"):
        swarm.start_server(
            name, llama_dir, whole, "1GB", "--role", "decode", "--compute-delay-per-token", "0.05"
        )
    names = ["prefill-1", "prefill-2", "decode-1", "decode-2"]
    swarm.wait_online(prefix, NUM_BLOCKS, names)
    # both prefill servers measured their links to both decode servers (probes), so the plan has rates
    decoders = {_peer(swarm, prefix, name) for name in names[2:]}
    swarm.wait_for(
        prefix, NUM_BLOCKS, lambda online: all(decoders <= set(online[n].links) for n in names[:2]), 60
    )
    reference = local_reference(llama_dir)[0]
    prompt = torch.randint(4, 400, (1, 40), generator=torch.Generator().manual_seed(0))
    expected = reference.generate(prompt, max_new_tokens=8, do_sample=False)
    options = ClientOptions(request_timeout=20.0, scheduler_key=swarm.scheduler_key)
    models = [
        AutoDistributedModelForCausalLM.from_pretrained(llama_dir, swarm.initial_peers, options=options)
        for _ in range(2)
    ]
    outputs: list = [None, None]

    def generate(index: int) -> None:
        outputs[index] = models[index].generate(prompt, max_new_tokens=8, do_sample=False)

    caplog.set_level("INFO", logger="llm_swarm.client")
    try:
        threads = [threading.Thread(target=generate, args=(index,)) for index in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        assert all(torch.equal(output, expected) for output in outputs)
    finally:
        for model in models:
            model.shutdown()
    assert caplog.text.count("routed by the scheduler") >= 2
    assert caplog.text.count("scheduler's plan: yes") == 2
    for name in ("prefill-1", "prefill-2"):  # one prompt each: the scheduler spread them
        _wait_for_log(swarm, name, "handed")
    for name in ("decode-1", "decode-2"):
        assert "handed" not in swarm.log(name)


def _peer(swarm, prefix: str, name: str) -> str:
    (peer,) = [peer for peer, info in swarm.servers(prefix, NUM_BLOCKS).items() if info.public_name == name]
    return peer


@pytest.mark.swarm
def test_a_following_hand_off_its_step_does_not_complete_is_refused_and_the_target_stays_usable(
    swarm, llama_dir
):
    """`HandOff.follow` asks a server to push the cache its next step computes. A follow order for more
    positions than that step computes, or than the session holds, is answered with an error after the
    step (whose own answer is unchanged); the target session stays empty and usable."""
    prefix = default_prefix(str(llama_dir))
    swarm.start_server("a", llama_dir, f"0:{NUM_BLOCKS}", "1GB", "--prefill-chunk", "2")
    swarm.start_server("b", llama_dir, f"0:{NUM_BLOCKS}", "1GB")
    swarm.wait_online(prefix, NUM_BLOCKS, ["a", "b"])
    model = AutoDistributedModelForCausalLM.from_pretrained(
        llama_dir, swarm.initial_peers, options=ClientOptions(request_timeout=20.0)
    )
    connection = model.backend.connection
    try:
        a, b = _peer(swarm, prefix, "a"), _peer(swarm, prefix, "b")
        shape = SessionShape(1, 16, l_in=4, l_out=12)
        hidden = torch.randn(1, 5, 64)
        for length, refusal in ((7, "did not compute"), (17, "is not in")):
            source = ServerStream(RouteHop(a, 0, NUM_BLOCKS), uuid.uuid4().hex, shape)
            target = ServerStream(RouteHop(b, 0, NUM_BLOCKS), uuid.uuid4().hex, shape)
            run_sync(source.open(connection))
            token = run_sync(target.open(connection, cache_from=a))
            order = run_sync(source.follow(target, token, 5.0, length, 20.0))
            output = run_sync(source.step(StepInput(hidden, 0, None, None, None, 0), 20.0))
            assert output.shape == hidden.shape and torch.isfinite(output).all()
            with pytest.raises(Exception, match=refusal):
                run_sync(source.handed_off(order, target, 20.0))
            # the target holds nothing: its own first step at position 0 runs (once B saw the push
            # stream end: until then it answers "receiving", as it would a client's early replay)
            assert torch.isfinite(_first_step_when_released(target, hidden)).all()
            for stream in (source, target):
                run_sync(stream.close_and_wait(5.0))
        # a client that leaves while a push follows its prompt: the push stops, the target is usable
        source = ServerStream(RouteHop(a, 0, NUM_BLOCKS), uuid.uuid4().hex, shape)
        target = ServerStream(RouteHop(b, 0, NUM_BLOCKS), uuid.uuid4().hex, shape)
        run_sync(source.open(connection))
        token = run_sync(target.open(connection, cache_from=a))
        run_sync(source.follow(target, token, 5.0, 5, 20.0))
        run_sync(source.close_and_wait(5.0))
        assert torch.isfinite(_first_step_when_released(target, hidden)).all()
        run_sync(target.close_and_wait(5.0))
        # an honest streamed hand-off of the same prompt: the target continues as the source would
        source = ServerStream(RouteHop(a, 0, NUM_BLOCKS), uuid.uuid4().hex, shape)
        target = ServerStream(RouteHop(b, 0, NUM_BLOCKS), uuid.uuid4().hex, shape)
        twin = ServerStream(RouteHop(a, 0, NUM_BLOCKS), uuid.uuid4().hex, shape)
        run_sync(source.open(connection))
        run_sync(twin.open(connection))
        token = run_sync(target.open(connection, cache_from=a))
        order = run_sync(source.follow(target, token, 5.0, 5, 20.0))
        run_sync(source.step(StepInput(hidden, 0, None, None, None, 0), 20.0))
        run_sync(source.handed_off(order, target, 20.0))
        run_sync(twin.step(StepInput(hidden, 0, None, None, None, 0), 20.0))
        nxt = torch.randn(1, 1, 64)
        continued = run_sync(target.step(StepInput(nxt, 5, None, None, None, 0), 20.0))
        expected = run_sync(twin.step(StepInput(nxt, 5, None, None, None, 0), 20.0))
        assert torch.allclose(continued, expected, atol=1e-5)
        for stream in (source, target, twin):
            run_sync(stream.close_and_wait(5.0))
        assert "never retrieved" not in swarm.log("a")  # every stopped push was collected
    finally:
        model.shutdown()


def _first_step_when_released(stream: ServerStream, hidden: torch.Tensor) -> torch.Tensor:
    deadline = time.monotonic() + 30
    while True:
        try:
            return run_sync(stream.step(StepInput(hidden, 0, None, None, None, 0), 20.0))
        except Exception as error:
            if "receiving" not in str(error) or time.monotonic() > deadline:
                raise
            time.sleep(0.1)
