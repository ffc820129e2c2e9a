"""A hostile client throws malformed and abusive requests at a live server.

Each gets a clear error naming what was wrong (or is handled), one case per test against one server
for the module; the last test checks that the server stayed up, a normal client still generates
exactly, and the announced free cache returned to its full value.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass

import pytest
import torch
from hivemind.compression import serialize_torch_tensor
from hivemind.p2p import P2P, PeerID
from hivemind.proto import runtime_pb2
from hivemind.utils.serializer import MSGPackSerializer

from harness.local_swarm import LocalSwarm
from llm_swarm.client import AutoDistributedModelForCausalLM
from llm_swarm.client.connection import SwarmConnection, run_sync
from llm_swarm.server.handler import BlockServicer
from llm_swarm.swarm.dht_keys import default_prefix
from llm_swarm.swarm.step_frame import StepFrame, encode_frame
from llm_swarm.swarm.wire import (
    PEER_LIMIT_PREFIX,
    Backward,
    Computed,
    Error,
    Forward,
    Replay,
    Report,
    Step,
    StepDone,
    decode_tensors,
    encode,
    parse,
)
from tests.conftest import NUM_BLOCKS
from tests.raw_streams import exchange

pytestmark = pytest.mark.swarm  # every test here starts processes

HIDDEN = 64
MAX_LENGTH = 16
SESSION_TIMEOUT = 3.0
SESSION_LIFETIME = 8.0  # longer than any session of this test but the one that checks it


def raw(metadata: object, tensors: list[torch.Tensor] = ()) -> runtime_pb2.ExpertRequest:
    payload = metadata if isinstance(metadata, bytes) else MSGPackSerializer.dumps(metadata)
    return runtime_pb2.ExpertRequest(tensors=[serialize_torch_tensor(t) for t in tensors], metadata=payload)


def open_message(session_id: str | None = None, **overrides) -> runtime_pb2.ExpertRequest:
    fields = dict(
        session_id=session_id or uuid.uuid4().hex,
        max_length=MAX_LENGTH,
        batch_size=1,
        start=0,
        end=NUM_BLOCKS,
    )
    fields.update(overrides)
    return raw({"type": "open", "protocol": 1, **fields})


def step(position: int, *tensors: torch.Tensor, step_id: str | None = None) -> runtime_pb2.ExpertRequest:
    return encode(Step(step_id=step_id or f"s{position}", position=position), list(tensors))


class RawStream:
    """A bidirectional stream we drive by hand: send one message, read one reply."""

    def __init__(self, connection: SwarmConnection, peer_id: str):
        self.connection, self.peer_id = connection, peer_id
        self.queue: asyncio.Queue = asyncio.Queue()
        self.responses = None

    async def start(self) -> None:
        async def requests():
            while (item := await self.queue.get()) is not None:
                yield item

        self.responses = await self.connection.stub(self.peer_id).rpc_inference(requests())

    async def ask(self, request, timeout: float = 60.0) -> tuple[dict, list[torch.Tensor]]:
        self.queue.put_nowait(request)
        try:
            response = await asyncio.wait_for(anext(self.responses), timeout=timeout)  # slow CI hosts
        except StopAsyncIteration:
            return {"type": "closed"}, []
        return MSGPackSerializer.loads(response.metadata), decode_tensors(response)

    def close(self) -> None:
        self.queue.put_nowait(None)


GOOD = torch.randn(1, 1, HIDDEN)
TWO = torch.randn(1, 2, HIDDEN)


def replay(
    layout: list[list[int]], hidden: torch.Tensor, *extra: torch.Tensor, **flags
) -> runtime_pb2.ExpertRequest:
    """A `Replay` of recorded steps: layout rows are (position, tokens, reorders, masked)."""
    message = Replay(replay_id="r", **flags)
    return encode(message, [torch.tensor(layout, dtype=torch.int64), hidden, *extra])


PROMPTED_STEP = {"type": "step", "step_id": "p", "position": 0, "prompts": True}

# name -> (requests after an `open` (or instead of one), what the error says, whether to open first)
SESSION_CASES: dict[str, tuple[list, str, bool]] = {
    "wrong hidden size": ([step(0, torch.randn(1, 1, 32))], "hidden size 32 differs", True),
    "wrong dtype": ([step(0, torch.ones(1, 1, HIDDEN, dtype=torch.int64))], "must be float32", True),
    "NaN": ([step(0, torch.full((1, 1, HIDDEN), float("nan")))], "NaN or infinity", True),
    "infinity": ([step(0, torch.full((1, 1, HIDDEN), float("inf")))], "NaN or infinity", True),
    "empty tensor": ([step(0, torch.zeros(1, 0, HIDDEN))], "at least one token", True),
    "huge max_length": ([open_message(max_length=10**9)], "exceeds the server's limit", False),
    "oversized message": ([step(0, torch.randn(1, 400, HIDDEN))], "exceeds this session's limit", True),
    "step before open": ([step(0, GOOD)], "expected a message of type ['open']", False),
    "position skips ahead": ([step(0, GOOD), step(5, GOOD)], "skips past", True),
    # rewinds (a step at an earlier position) are validated like every step
    "rewind to a negative position": (
        [step(0, GOOD), raw({"type": "step", "step_id": "r", "position": -1}, [GOOD])],
        "position: Input should be greater than or equal to 0",
        True,
    ),
    "rewind past what was processed": (
        [step(0, torch.randn(1, 3, HIDDEN)), step(4, GOOD)],
        "skips past the 3 positions processed",
        True,
    ),
    # a failover's replay of recorded steps: checked like every step, and a failed one ends the session
    "replay out of order": (
        [replay([[0, 1, 0, 0], [3, 1, 0, 0]], torch.randn(1, 2, HIDDEN))],
        "replayed step 1 at position 3 is out of order",
        True,
    ),
    "replay too long": (
        [replay([[0, 2 * MAX_LENGTH + 1, 0, 0]], torch.randn(1, 2 * MAX_LENGTH + 1, HIDDEN))],
        "exceeds",
        True,
    ),
    "replay past max_length": (
        [replay([[0, 10, 0, 0], [8, 10, 0, 0]], torch.randn(1, 20, HIDDEN))],
        "past the session's max_length",
        True,
    ),
    "replay with NaN": (
        [replay([[0, 2, 0, 0]], torch.full((1, 2, HIDDEN), float("nan")))],
        "NaN or infinity",
        True,
    ),
    "replay whose layout disagrees with its tensors": (
        [replay([[0, 3, 0, 0]], torch.randn(1, 2, HIDDEN))],
        "at least one token each and 2 in all",
        True,
    ),
    "replay for another model's width": (
        [replay([[0, 2, 0, 0]], torch.randn(1, 2, 32))],
        "hidden size 32 differs",
        True,
    ),
    "replay with bad masks": (
        [replay([[0, 2, 0, 1]], TWO, torch.full((1, 2), 3), torch.ones(1, 2), masked=True)],
        "mask values must be 0 or 1",
        True,
    ),
    "replay with reorderings out of range": (
        [replay([[0, 1, 1, 0]], GOOD, torch.tensor([[5]]), reordered=True)],
        "hypo_ids must be sequence indices",
        True,
    ),
    "replay before open": ([replay([[0, 1, 0, 0]], GOOD)], "expected a message of type ['open']", False),
    "draft candidates past max_length": (
        [step(0, torch.randn(1, 4, HIDDEN)), step(2, torch.randn(1, MAX_LENGTH - 1, HIDDEN))],
        f"positions up to {MAX_LENGTH + 1} exceed the session's max_length",
        True,
    ),
    "past max_length": ([step(0, torch.randn(1, MAX_LENGTH + 1, HIDDEN))], "exceed", True),
    "garbage metadata": ([raw(b"\xc1\xff\x00garbage")], "not valid msgpack", False),
    "metadata not a map": ([raw([1, 2, 3])], "must be a map", False),
    "unknown field": ([open_message(evil=True)], "invalid open message", False),
    "batch mismatch": ([step(0, torch.randn(2, 1, HIDDEN))], "batch size 2 differs", True),
    "three tensors": ([step(0, GOOD, GOOD, GOOD)], "1 or 2 tensors", True),
    "hypo_ids out of range": (
        [raw({"type": "step", "step_id": "h", "position": 0, "hypo_ids": [3]}, [GOOD])],
        "hypo_ids must hold 1 sequence indices",
        True,
    ),
    "hypo_ids too many": (
        [raw({"type": "step", "step_id": "h", "position": 0, "hypo_ids": [0, 0]}, [GOOD])],
        "hypo_ids must hold",
        True,
    ),
    # deep prompts on a session step: the last tensor, checked like the training RPCs' prompts
    "step prompts for the wrong blocks": (
        [raw(PROMPTED_STEP, [GOOD, torch.randn(2, 1, 1, HIDDEN)])],
        "do not fit",
        True,
    ),
    "step prompts of NaN": (
        [raw(PROMPTED_STEP, [GOOD, torch.full((NUM_BLOCKS, 1, 1, HIDDEN), float("nan"))])],
        "NaN",
        True,
    ),
    "step prompts flag without prompts": ([raw(PROMPTED_STEP, [GOOD])], "1 or 2 tensors, got 0", True),
    "step prompts of integers": (
        [raw(PROMPTED_STEP, [GOOD, torch.ones(NUM_BLOCKS, 1, 1, HIDDEN, dtype=torch.long)])],
        "float",
        True,
    ),
    "bad padding mask": ([step(0, GOOD, torch.ones(1, 7))], "padding mask must have shape", True),
    "blocks outside the span": (
        [open_message(start=0, end=NUM_BLOCKS + 3)],
        "not inside this server's span",
        False,
    ),
    "negative position": (
        [raw({"type": "step", "step_id": "x", "position": -1}, [GOOD])],
        "invalid step message",
        True,
    ),
    "zero max_length": ([open_message(max_length=0)], "invalid open message", False),
    "batch over the limit": ([open_message(batch_size=50)], "exceeds the limit", False),
}

TRAIN_HIDDEN, TRAIN_GRADS = torch.randn(2, 5, HIDDEN), torch.randn(2, 5, HIDDEN)
TRAIN_PROMPTS = torch.randn(NUM_BLOCKS, 1, 2, HIDDEN)
TRAIN_NAN = torch.full((2, 5, HIDDEN), float("nan"))
FORWARD, BACKWARD = Forward(start=0, end=NUM_BLOCKS), Backward(start=0, end=NUM_BLOCKS)
PROMPTED_BACKWARD = Backward(start=0, end=NUM_BLOCKS, prompts=True)

# name -> (message, tensors, what the error says); the server holds nothing between training calls
TRAINING_CASES: dict[str, tuple[Forward | Backward, list[torch.Tensor], str]] = {
    "forward of a 2-D tensor": (FORWARD, [torch.randn(3, HIDDEN)], "must be [batch, tokens, hidden]"),
    "forward of NaN": (FORWARD, [TRAIN_NAN], "NaN or infinity"),
    "forward of integers": (FORWARD, [TRAIN_HIDDEN.long()], "must be float32"),
    "forward of too many tokens": (FORWARD, [torch.randn(1, 65, HIDDEN)], "tokens are outside 1..64"),
    "forward of too many sequences": (FORWARD, [torch.randn(5, 1, HIDDEN)], "batch size 5 is outside"),
    "forward outside the span": (
        Forward(start=0, end=NUM_BLOCKS + 1),
        [TRAIN_HIDDEN],
        "not inside this server",
    ),
    "backward without gradients": (BACKWARD, [TRAIN_HIDDEN], "carries 2 or 3 tensors"),
    "backward of mismatched gradients": (BACKWARD, [TRAIN_HIDDEN, TRAIN_GRADS[:, :3]], "do not match"),
    "backward of NaN gradients": (BACKWARD, [TRAIN_HIDDEN, TRAIN_NAN], "output gradients contain NaN"),
    "prompts for the wrong blocks": (
        PROMPTED_BACKWARD,
        [TRAIN_HIDDEN, TRAIN_GRADS, TRAIN_PROMPTS[:2]],
        "do not fit",
    ),
    "prompts of NaN": (
        PROMPTED_BACKWARD,
        [TRAIN_HIDDEN, TRAIN_GRADS, TRAIN_PROMPTS * float("nan")],
        "prompts contain NaN",
    ),
    "prompts longer than the input": (
        PROMPTED_BACKWARD,
        [TRAIN_HIDDEN, TRAIN_GRADS, TRAIN_PROMPTS.repeat(1, 1, 4, 1)],
        "a prompt of",
    ),
    "a padding mask of the wrong shape": (
        BACKWARD,
        [TRAIN_HIDDEN, TRAIN_GRADS, torch.ones(2, 4)],
        "padding mask",
    ),
}


@dataclass
class Target:
    """The server under attack, and a normal client whose connection the attacks go through."""

    swarm: LocalSwarm
    prefix: str
    peer_id: str
    full_cache_bytes: int
    model: object  # the distributed model of a normal client
    prompt: torch.Tensor
    expected: torch.Tensor  # what local transformers generates from `prompt`

    @property
    def connection(self) -> SwarmConnection:
        return self.model.backend.connection

    async def raw_stream(self) -> RawStream:
        stream = RawStream(self.connection, self.peer_id)
        await stream.start()
        return stream

    def generates_exactly(self, model=None) -> bool:
        output = (model or self.model).generate(self.prompt, max_new_tokens=12, do_sample=False)
        return torch.equal(output, self.expected)


@pytest.fixture(scope="module")
def target(llama_dir, tmp_path_factory, local_reference):
    from llm_swarm.swarm.models import load_span

    span, _ = load_span(llama_dir, 0, NUM_BLOCKS)
    session_bytes = span.cache_bytes(MAX_LENGTH) * NUM_BLOCKS
    memory = span.block_bytes * NUM_BLOCKS + 300 * session_bytes  # ~300 short sessions fit
    swarm = LocalSwarm(tmp_path_factory.mktemp("hostile"))
    model = None
    try:
        swarm.start_dht()
        swarm.start_server(
            "target",
            llama_dir,
            f"0:{NUM_BLOCKS}",
            str(memory),
            *("--max-length", "64", "--session-timeout", str(SESSION_TIMEOUT), "--max-batch-size", "4"),
            *("--max-peer-cache-fraction", "0.5"),  # the default (LocalSwarm lifts it for single clients)
            *("--max-session-lifetime", str(SESSION_LIFETIME)),
        )
        prefix = default_prefix(str(llama_dir))
        swarm.wait_online(prefix, NUM_BLOCKS, ["target"])
        ((peer_id, info),) = swarm.servers(prefix, NUM_BLOCKS).items()
        prompt = torch.tensor([[5, 17, 99, 200]])
        reference = local_reference(llama_dir)[0]
        expected = reference.generate(prompt, max_new_tokens=12, do_sample=False)
        model = AutoDistributedModelForCausalLM.from_pretrained(llama_dir, swarm.initial_peers)
        target = Target(swarm, prefix, peer_id, info.cache_bytes_left, model, prompt, expected)
        assert target.generates_exactly()
        yield target
    finally:
        if model is not None:
            model.shutdown()
        assert not swarm.close()


@pytest.mark.parametrize("name", list(SESSION_CASES))
def test_a_malformed_session_message_gets_a_clear_error(target, name):
    requests, match, open_first = SESSION_CASES[name]

    async def attack() -> dict:
        stream = await target.raw_stream()
        try:
            if open_first:
                reply, _ = await stream.ask(open_message())
                assert reply["type"] == "opened", reply
            for request in requests[:-1]:
                await stream.ask(request)
            return (await stream.ask(requests[-1]))[0]
        finally:
            stream.close()

    reply = run_sync(attack())
    assert reply["type"] == "error" and match in reply["message"], reply


def test_malformed_step_frames_get_clear_errors_and_the_session_goes_on(target):
    """Steps as compact frames (swarm/step_frame.py) are checked like protobuf steps: each malformed one
    gets a clear error on the open session, and a good frame after them is answered (as a frame)."""

    def frame(*tensors: torch.Tensor, message=None) -> StepFrame:
        return encode_frame(message or Step(step_id="f0", position=0), list(tensors))

    good = b"".join(bytes(part) for part in frame(GOOD).parts)
    attacks = {
        "a cut header": (StepFrame.received(good[:5]), "shorter than a frame's header"),
        "a cut tensor": (StepFrame.received(good[:-4]), f"needs {HIDDEN * 4} bytes"),
        "trailing bytes": (StepFrame.received(good + b"junk"), "4 bytes after its last tensor"),
        "NaN": (frame(torch.full((1, 1, HIDDEN), float("nan"))), "NaN or infinity"),
        "a wrong width": (frame(torch.randn(1, 1, 32)), "hidden size 32 differs"),
        "integers": (frame(torch.ones(1, 1, HIDDEN, dtype=torch.int64)), "must be float32"),
        "a skipped position": (frame(GOOD, message=Step(step_id="f5", position=5)), "skips past"),
        "an answer for a request": (
            frame(GOOD, message=StepDone(step_id="d", position=0)),
            "a frame of kind 2, expected ['Step']",
        ),
    }
    requests = [open_message(), *(attack for attack, _ in attacks.values()), frame(GOOD)]
    kinds = run_sync(
        exchange(
            target.connection, target.peer_id, "rpc_inference", requests, lambda k: len(k) < len(requests)
        )
    )
    assert kinds[0] == "opened" and kinds[-1] == "step_done", kinds
    for (name, (_, match)), kind in zip(attacks.items(), kinds[1:-1], strict=True):
        assert kind.startswith("error:") and match in kind, (name, kind)
    # a frame before the session is open, and one over the session's limit: refused, the stream ends
    before = run_sync(
        exchange(target.connection, target.peer_id, "rpc_inference", [frame(GOOD)], lambda k: not k)
    )
    assert before == ["error: expected an open message, got a step frame"], before
    oversized = [open_message(), frame(torch.randn(1, 400, HIDDEN))]
    kinds = run_sync(
        exchange(target.connection, target.peer_id, "rpc_inference", oversized, lambda k: len(k) < 2)
    )
    assert "exceeds this session's limit" in kinds[1], kinds


def test_a_gigabyte_announced_is_refused_from_the_length_header(target):
    """The server must refuse from the length header alone, not buffer what follows."""

    async def announce_a_gigabyte() -> dict:
        name = BlockServicer._get_handle_name(target.prefix, "rpc_inference")
        peer = PeerID.from_base58(target.peer_id)
        _, reader, writer = await target.connection.p2p.call_binary_stream_handler(peer, name)
        try:
            writer.write(P2P.MESSAGE_MARKER + (1 << 30).to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER))
            writer.write(b"\0" * 65536)
            await writer.drain()
            response, _error = await asyncio.wait_for(
                P2P.receive_protobuf(runtime_pb2.ExpertResponse, reader), 20
            )
            return MSGPackSerializer.loads(response.metadata)
        finally:
            writer.close()

    reply = run_sync(announce_a_gigabyte())
    assert reply["type"] == "error" and "exceeds this session's limit" in reply["message"], reply


def test_someone_elses_session_is_refused_and_a_replayed_step_is_answered_identically(target):
    async def scenario() -> None:
        owner = await target.raw_stream()
        taken = uuid.uuid4().hex
        assert (await owner.ask(open_message(taken)))[0]["type"] == "opened"
        thief = await target.raw_stream()
        try:
            reply, _ = await thief.ask(open_message(taken))
            assert reply["type"] == "error" and "already in use" in reply["message"], reply
        finally:
            thief.close()
        first, outputs = await owner.ask(step(0, GOOD, step_id="same"))
        again, replayed = await owner.ask(step(0, GOOD, step_id="same"))
        assert first["type"] == again["type"] == "step_done" and torch.equal(outputs[0], replayed[0])
        owner.close()  # disconnect mid-session: the server frees it (checked by the last test)

    run_sync(scenario())


def test_a_rewind_racing_a_step_is_applied_in_order_and_exact(target):
    """A step and a rewind sent together, without waiting: the server takes them in order, so the
    rewind overwrites what the step wrote, exactly as a session that never went past the rewind."""
    tokens = torch.randn(1, 5, HIDDEN)
    other = torch.randn(1, 1, HIDDEN)

    async def scenario() -> tuple[list, torch.Tensor, torch.Tensor]:
        racer, straight = await target.raw_stream(), await target.raw_stream()
        try:
            assert (await racer.ask(open_message()))[0]["type"] == "opened"
            racer.queue.put_nowait(step(0, tokens, step_id="all"))
            racer.queue.put_nowait(step(2, other, step_id="rewind"))
            first = await asyncio.wait_for(anext(racer.responses), 60)
            second = await asyncio.wait_for(anext(racer.responses), 60)
            replies = [MSGPackSerializer.loads(reply.metadata) for reply in (first, second)]
            assert (await straight.ask(open_message()))[0]["type"] == "opened"
            await straight.ask(step(0, tokens[:, :2], step_id="prefix"))
            _, expected = await straight.ask(step(2, other, step_id="next"))
            return replies, decode_tensors(second)[0], expected[0]
        finally:
            racer.close()
            straight.close()

    replies, rewound, expected = run_sync(scenario())
    assert [reply["type"] for reply in replies] == ["step_done", "step_done"], replies
    assert [reply["step_id"] for reply in replies] == ["all", "rewind"]
    assert torch.allclose(rewound, expected, atol=1e-5, rtol=0)


async def _training_call(target: Target, message: Forward | Backward, tensors: list[torch.Tensor]):
    stub = target.connection.stub(target.peer_id)
    rpc = stub.rpc_backward if isinstance(message, Backward) else stub.rpc_forward
    return await rpc(encode(message, tensors), timeout=20)


@pytest.mark.parametrize("name", list(TRAINING_CASES))
def test_a_malformed_training_call_gets_a_clear_error(target, name):
    message, tensors, match = TRAINING_CASES[name]
    reply = parse(run_sync(_training_call(target, message, tensors)).metadata, Computed, Error)
    assert isinstance(reply, Error) and match in reply.message, reply


def test_a_well_formed_training_call_works_and_a_report_outside_the_span_is_refused(target):
    tensors = [TRAIN_HIDDEN, TRAIN_GRADS, TRAIN_PROMPTS]
    reply = run_sync(_training_call(target, PROMPTED_BACKWARD, tensors))
    assert parse(reply.metadata, Computed, Error).type == "computed"
    assert [tuple(t.shape) for t in decode_tensors(reply)] == [
        tuple(TRAIN_HIDDEN.shape),
        tuple(TRAIN_PROMPTS.shape),
    ]
    report = run_sync(
        target.connection.stub(target.peer_id).rpc_report(
            encode(Report(start=0, end=NUM_BLOCKS + 5, reason="outvoted")), timeout=20
        )
    )
    assert b"not inside this server" in report.metadata


def test_an_idle_session_is_reclaimed(target):
    async def scenario() -> bytes:
        idle = await target.raw_stream()
        try:
            assert (await idle.ask(open_message()))[0]["type"] == "opened"
            await asyncio.sleep(SESSION_TIMEOUT + 1)
            idle.queue.put_nowait(step(0, GOOD))
            return (await asyncio.wait_for(anext(idle.responses), timeout=20)).metadata
        finally:
            idle.close()

    assert b"idle" in run_sync(scenario())


def test_a_busy_session_is_closed_at_its_lifetime_limit(target):
    async def scenario() -> tuple[dict, float]:
        busy = await target.raw_stream()
        try:
            assert (await busy.ask(open_message(max_length=64)))[0]["type"] == "opened"
            opened_at, position, reply = time.monotonic(), 0, {}
            while time.monotonic() - opened_at < SESSION_LIFETIME + 10:
                reply, _ = await busy.ask(step(position, GOOD))
                if reply["type"] != "step_done":
                    break
                position += 1
                await asyncio.sleep(1.0)  # never idle for SESSION_TIMEOUT
            return reply, time.monotonic() - opened_at
        finally:
            busy.close()

    reply, lived = run_sync(scenario())
    assert reply.get("code") == "session_expired" and "lifetime" in reply["message"], reply
    assert lived >= SESSION_LIFETIME - 1


def test_one_peer_holding_200_sessions_gets_its_share_and_others_still_have_room(target, llama_dir):
    streams = [RawStream(target.connection, target.peer_id) for _ in range(200)]

    async def open_many() -> list[str]:
        """One peer opens 200 sessions and keeps them: it gets its per-peer share (64 sessions by
        default), the rest are refused as over that share, not as a full server."""
        outcomes: list[str] = []

        async def open_one(index: int) -> tuple[dict, list]:
            """The open's reply. A stream whose open gets no reply (reproduced about once in eight
            runs under CPU load, exactly while the server closes dozens of idled-out sessions at
            once; in the case captured, the server logged nothing after those closings, so the
            stream was lost between the p2p daemons and hivemind's stub, which has no timeout of
            its own) is replaced once by a new stream, as our client's request timeout and retry
            do; what this test checks is the server's per-peer share, not the transport."""
            try:
                return await streams[index].ask(open_message(), timeout=20)
            except TimeoutError:
                streams[index].close()
                streams[index] = RawStream(target.connection, target.peer_id)
                await streams[index].start()
                return await streams[index].ask(open_message())

        for batch in range(0, len(streams), 16):
            chunk = range(batch, min(batch + 16, len(streams)))
            await asyncio.gather(*(streams[index].start() for index in chunk))
            replies = await asyncio.gather(*(open_one(index) for index in chunk))
            for stream, (reply, _) in zip([streams[index] for index in chunk], replies, strict=True):
                outcomes.append(reply["type"] if reply["type"] == "opened" else reply["message"])
                if reply["type"] != "opened":
                    # end our side of a refused stream at once: the server has ended its own, and
                    # a stream left half-open still counts against the p2p daemons' per-peer stream
                    # limits, where one more open is reset and hivemind's stub then waits forever
                    # (the 60 s "no reply" this test once hit in a full run)
                    stream.close()
        return outcomes

    honest = None
    try:
        try:
            outcomes = run_sync(open_many())
        except TimeoutError:  # say what the server was doing, not only that a reply never came
            pytest.fail(
                f"an open got no reply in 60 s; the server's log ends:\n{target.swarm.log('target')[-4000:]}"
            )
        assert outcomes.count("opened") >= 1
        refusals = [outcome for outcome in outcomes if outcome != "opened"]
        # the server's own count at each refusal: sessions that idled out on a slow host (3 s here)
        # may let a later batch open a few more, but never past the share at any moment
        share_full = f"{PEER_LIMIT_PREFIX}: it already holds 64 sessions"
        assert refusals and all(refusal.startswith(share_full) for refusal in refusals), refusals[:3]
        # while that peer holds everything it could get, another client still has room
        honest = AutoDistributedModelForCausalLM.from_pretrained(llama_dir, target.swarm.initial_peers)
        assert target.generates_exactly(honest)
    finally:
        if honest is not None:
            honest.shutdown()
        for stream in streams:  # ends our side of each started stream (the server then closes its own)
            stream.close()


def test_after_every_attack_the_server_is_up_exact_and_its_cache_is_free_again(target):
    # runs last in this module (pytest keeps file order): everything above has hit the server by now
    assert target.swarm.processes["target"].poll() is None, "the server died"
    assert target.generates_exactly()
    target.swarm.wait_for(
        target.prefix,
        NUM_BLOCKS,
        lambda online: online["target"].cache_bytes_left == target.full_cache_bytes,
        timeout=30,
        what="free cache back to full",
    )
