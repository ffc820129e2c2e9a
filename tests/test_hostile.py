"""A hostile client throws malformed and abusive requests at a live server (issue 4).

Each gets a clear error naming what was wrong (or is handled), the server stays up, a normal client
keeps generating correctly, and the announced free cache returns to its full value.
"""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest
import torch
from hivemind.compression import serialize_torch_tensor
from hivemind.p2p import P2P, PeerID
from hivemind.proto import runtime_pb2
from hivemind.utils.serializer import MSGPackSerializer
from transformers import AutoModelForCausalLM

from client import AutoDistributedModelForCausalLM
from client.connection import SwarmConnection, run_sync
from server.handler import BlockServicer
from swarm.dht_keys import default_prefix
from swarm.local_swarm import LocalSwarm
from swarm.wire import (
    PEER_LIMIT_PREFIX,
    Backward,
    Computed,
    Error,
    Forward,
    Report,
    Step,
    decode_tensors,
    encode,
    parse,
)
from tests.conftest import NUM_BLOCKS

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

    async def ask(self, request) -> tuple[dict, list[torch.Tensor]]:
        from swarm.wire import decode_tensors

        self.queue.put_nowait(request)
        try:
            response = await asyncio.wait_for(anext(self.responses), timeout=60)  # slow CI hosts
        except StopAsyncIteration:
            return {"type": "closed"}, []
        return MSGPackSerializer.loads(response.metadata), decode_tensors(response)

    def close(self) -> None:
        self.queue.put_nowait(None)


@pytest.fixture(scope="module")
def hostile_swarm(llama_dir, tmp_path_factory):
    from swarm.models import load_span

    span, _ = load_span(llama_dir, 0, NUM_BLOCKS)
    session_bytes = span.cache_bytes(MAX_LENGTH) * NUM_BLOCKS
    memory = span.block_bytes * NUM_BLOCKS + 300 * session_bytes  # ~300 short sessions fit
    swarm = LocalSwarm(tmp_path_factory.mktemp("hostile"))
    try:
        swarm.start_dht()
        swarm.start_server(
            "target",
            llama_dir,
            f"0:{NUM_BLOCKS}",
            str(memory),
            "--max-length",
            "64",
            "--session-timeout",
            str(SESSION_TIMEOUT),
            "--max-batch-size",
            "4",
            "--max-peer-cache-fraction",
            "0.5",  # the default (LocalSwarm lifts it for single-client tests)
            "--max-session-lifetime",
            str(SESSION_LIFETIME),
        )
        swarm.wait_online(default_prefix(str(llama_dir)), NUM_BLOCKS, ["target"])
        yield swarm
    finally:
        assert not swarm.close()


def test_hostile_requests_get_clear_errors_and_nothing_leaks(hostile_swarm, llama_dir):
    swarm = hostile_swarm
    prefix = default_prefix(str(llama_dir))
    ((peer_id, full_info),) = swarm.servers(prefix, NUM_BLOCKS).items()
    full_bytes = full_info.cache_bytes_left
    reference = AutoModelForCausalLM.from_pretrained(llama_dir).eval()
    prompt = torch.tensor([[5, 17, 99, 200]])
    expected = reference.generate(prompt, max_new_tokens=12, do_sample=False)
    normal = AutoDistributedModelForCausalLM.from_pretrained(llama_dir, swarm.initial_peers)
    connection = normal.backend.connection
    good = torch.randn(1, 1, HIDDEN)
    covered: list[str] = []

    async def expect_error(name: str, requests: list, match: str, open_first: bool = True) -> None:
        if not requests:  # raw bytes: a message header announcing 1 GiB, then a trickle of data
            reply = await announce_a_gigabyte()
            assert reply["type"] == "error" and match in reply["message"], (name, reply)
            covered.append(name)
            return
        stream = RawStream(connection, peer_id)
        await stream.start()
        try:
            if open_first:
                reply, _ = await stream.ask(open_message())
                assert reply["type"] == "opened", (name, reply)
            for request in requests[:-1]:
                await stream.ask(request)
            reply, _ = await stream.ask(requests[-1])
            assert reply["type"] == "error" and match in reply["message"], (name, reply)
        finally:
            stream.close()
        covered.append(name)

    async def announce_a_gigabyte() -> dict:
        """The server must refuse from the length header alone, not buffer what follows."""
        name = BlockServicer._get_handle_name(prefix, "rpc_inference")
        _, reader, writer = await connection.p2p.call_binary_stream_handler(PeerID.from_base58(peer_id), name)
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

    async def training_rpc(message, tensors):
        stub = connection.stub(peer_id)
        rpc = stub.rpc_backward if isinstance(message, Backward) else stub.rpc_forward
        return await rpc(encode(message, tensors), timeout=20)

    async def scenario() -> None:
        await expect_error("wrong hidden size", [step(0, torch.randn(1, 1, 32))], "hidden size 32 differs")
        await expect_error(
            "wrong dtype", [step(0, torch.ones(1, 1, HIDDEN, dtype=torch.int64))], "must be float32"
        )
        await expect_error("NaN", [step(0, torch.full((1, 1, HIDDEN), float("nan")))], "NaN or infinity")
        await expect_error("infinity", [step(0, torch.full((1, 1, HIDDEN), float("inf")))], "NaN or infinity")
        await expect_error("empty tensor", [step(0, torch.zeros(1, 0, HIDDEN))], "at least one token")
        await expect_error(
            "huge max_length",
            [open_message(max_length=10**9)],
            "exceeds the server's limit",
            open_first=False,
        )
        await expect_error(
            "oversized message", [step(0, torch.randn(1, 400, HIDDEN))], "exceeds this session's limit"
        )
        await expect_error("a gigabyte announced", [], "exceeds this session's limit", open_first=False)
        await expect_error(
            "step before open", [step(0, good)], "expected a message of type ['open']", open_first=False
        )
        await expect_error("position skips ahead", [step(0, good), step(5, good)], "skips past")
        await expect_error("past max_length", [step(0, torch.randn(1, MAX_LENGTH + 1, HIDDEN))], "exceed")
        await expect_error(
            "garbage metadata", [raw(b"\xc1\xff\x00garbage")], "not valid msgpack", open_first=False
        )
        await expect_error("metadata not a map", [raw([1, 2, 3])], "must be a map", open_first=False)
        await expect_error(
            "unknown field", [open_message(evil=True)], "invalid open message", open_first=False
        )
        await expect_error("batch mismatch", [step(0, torch.randn(2, 1, HIDDEN))], "batch size 2 differs")
        await expect_error("three tensors", [step(0, good, good, good)], "1 or 2 tensors")
        await expect_error(
            "hypo_ids out of range",
            [raw({"type": "step", "step_id": "h", "position": 0, "hypo_ids": [3]}, [good])],
            "hypo_ids must hold 1 sequence indices",
        )
        # deep prompts on a session step: the last tensor, checked like the training RPCs' prompts
        prompted = {"type": "step", "step_id": "p", "position": 0, "prompts": True}
        for name, tensors, match in (
            ("step prompts for the wrong blocks", [good, torch.randn(2, 1, 1, HIDDEN)], "do not fit"),
            ("step prompts of NaN", [good, torch.full((NUM_BLOCKS, 1, 1, HIDDEN), float("nan"))], "NaN"),
            ("step prompts flag without prompts", [good], "1 or 2 tensors, got 0"),
            (
                "step prompts of integers",
                [good, torch.ones(NUM_BLOCKS, 1, 1, HIDDEN, dtype=torch.long)],
                "float",
            ),
        ):
            await expect_error(name, [raw(prompted, tensors)], match)
        await expect_error(
            "hypo_ids too many",
            [raw({"type": "step", "step_id": "h", "position": 0, "hypo_ids": [0, 0]}, [good])],
            "hypo_ids must hold",
        )
        await expect_error(
            "bad padding mask", [step(0, good, torch.ones(1, 7))], "padding mask must have shape"
        )
        await expect_error(
            "blocks outside the span",
            [open_message(start=0, end=NUM_BLOCKS + 3)],
            "not inside this server's span",
            open_first=False,
        )
        await expect_error(
            "negative position",
            [raw({"type": "step", "step_id": "x", "position": -1}, [good])],
            "invalid step message",
        )
        await expect_error(
            "zero max_length", [open_message(max_length=0)], "invalid open message", open_first=False
        )
        await expect_error(
            "batch over the limit", [open_message(batch_size=50)], "exceeds the limit", open_first=False
        )

        # someone else's session id is refused while its owner holds it
        owner = RawStream(connection, peer_id)
        await owner.start()
        taken = uuid.uuid4().hex
        assert (await owner.ask(open_message(taken)))[0]["type"] == "opened"
        await expect_error(
            "someone else's session", [open_message(taken)], "already in use", open_first=False
        )

        # a replayed step id is answered from the last result, identically
        first, outputs = await owner.ask(step(0, good, step_id="same"))
        again, replayed = await owner.ask(step(0, good, step_id="same"))
        assert first["type"] == again["type"] == "step_done" and torch.equal(outputs[0], replayed[0])
        covered.append("replayed step id")
        owner.close()  # disconnect mid-session: the server frees it
        covered.append("disconnect mid-stream")

        # training RPCs: every malformed forward or backward gets a clear error (the server holds
        # nothing between calls, so there is nothing to leak), and a well-formed pair works
        hidden, grads = torch.randn(2, 5, HIDDEN), torch.randn(2, 5, HIDDEN)
        prompts = torch.randn(NUM_BLOCKS, 1, 2, HIDDEN)
        nan = torch.full((2, 5, HIDDEN), float("nan"))
        forward, backward = Forward(start=0, end=NUM_BLOCKS), Backward(start=0, end=NUM_BLOCKS)
        prompted = Backward(start=0, end=NUM_BLOCKS, prompts=True)
        for name, message, tensors, match in (
            ("forward of a 2-D tensor", forward, [torch.randn(3, HIDDEN)], "must be [batch, tokens, hidden]"),
            ("forward of NaN", forward, [nan], "NaN or infinity"),
            ("forward of integers", forward, [hidden.long()], "must be float32"),
            ("forward of too many tokens", forward, [torch.randn(1, 65, HIDDEN)], "tokens are outside 1..64"),
            (
                "forward of too many sequences",
                forward,
                [torch.randn(5, 1, HIDDEN)],
                "batch size 5 is outside",
            ),
            (
                "forward outside the span",
                Forward(start=0, end=NUM_BLOCKS + 1),
                [hidden],
                "not inside this server",
            ),
            ("backward without gradients", backward, [hidden], "carries 2 or 3 tensors"),
            ("backward of mismatched gradients", backward, [hidden, grads[:, :3]], "do not match"),
            ("backward of NaN gradients", backward, [hidden, nan], "output gradients contain NaN"),
            ("prompts for the wrong blocks", prompted, [hidden, grads, prompts[:2]], "do not fit"),
            ("prompts of NaN", prompted, [hidden, grads, prompts * float("nan")], "prompts contain NaN"),
            (
                "prompts longer than the input",
                prompted,
                [hidden, grads, prompts.repeat(1, 1, 4, 1)],
                "a prompt of",
            ),
            (
                "a padding mask of the wrong shape",
                backward,
                [hidden, grads, torch.ones(2, 4)],
                "padding mask",
            ),
        ):
            reply = parse((await training_rpc(message, tensors)).metadata, Computed, Error)
            assert isinstance(reply, Error) and match in reply.message, (name, reply)
            covered.append(name)
        reply = await training_rpc(prompted, [hidden, grads, prompts])
        assert parse(reply.metadata, Computed, Error).type == "computed"
        assert [tuple(t.shape) for t in decode_tensors(reply)] == [tuple(hidden.shape), tuple(prompts.shape)]
        report = await connection.stub(peer_id).rpc_report(
            encode(Report(start=0, end=NUM_BLOCKS + 5, reason="outvoted")), timeout=20
        )
        assert b"not inside this server" in report.metadata
        covered.append("a report about blocks the server does not hold")

        # an idle session is reclaimed
        idle = RawStream(connection, peer_id)
        await idle.start()
        assert (await idle.ask(open_message()))[0]["type"] == "opened"
        await asyncio.sleep(SESSION_TIMEOUT + 1)
        idle.queue.put_nowait(step(0, good))
        reply = await asyncio.wait_for(anext(idle.responses), timeout=20)
        assert b"idle" in reply.metadata
        idle.close()
        covered.append("idle session timeout")

        # a busy session is closed at its lifetime limit all the same
        busy = RawStream(connection, peer_id)
        await busy.start()
        assert (await busy.ask(open_message(max_length=64)))[0]["type"] == "opened"
        opened_at, position, reply = time.monotonic(), 0, {}
        while time.monotonic() - opened_at < SESSION_LIFETIME + 10:
            reply, _ = await busy.ask(step(position, good))
            if reply["type"] != "step_done":
                break
            position += 1
            await asyncio.sleep(1.0)  # never idle for SESSION_TIMEOUT
        assert reply.get("code") == "session_expired" and "lifetime" in reply["message"], reply
        assert time.monotonic() - opened_at >= SESSION_LIFETIME - 1
        busy.close()
        covered.append("session lifetime")

    async def open_many() -> list[RawStream]:
        """One peer opens 200 sessions and keeps them: it gets its per-peer share (64 sessions by
        default), the rest are refused as over that share, not as a full server."""
        streams = [RawStream(connection, peer_id) for _ in range(200)]
        outcomes: list[str] = []
        for batch in range(0, len(streams), 25):
            chunk = streams[batch : batch + 25]
            await asyncio.gather(*(s.start() for s in chunk))
            replies = await asyncio.gather(*(s.ask(open_message()) for s in chunk))
            outcomes += [
                reply["type"] if reply["type"] == "opened" else reply["message"] for reply, _ in replies
            ]
        assert 1 <= outcomes.count("opened") <= 64, outcomes.count("opened")
        refusals = [outcome for outcome in outcomes if outcome != "opened"]
        assert refusals and all(refusal.startswith(PEER_LIMIT_PREFIX) for refusal in refusals), refusals[:3]
        return streams

    try:
        assert torch.equal(normal.generate(prompt, max_new_tokens=12, do_sample=False), expected)
        run_sync(scenario())
        assert torch.equal(normal.generate(prompt, max_new_tokens=12, do_sample=False), expected)
        held = run_sync(open_many())
        # while that peer holds everything it could get, another client still has room
        honest = AutoDistributedModelForCausalLM.from_pretrained(llama_dir, swarm.initial_peers)
        try:
            assert torch.equal(honest.generate(prompt, max_new_tokens=12, do_sample=False), expected)
        finally:
            honest.shutdown()
            for stream in held:
                stream.close()
        covered.append("one peer holding 200 sessions")
    finally:
        normal.shutdown()
    assert len(covered) >= 30, covered
    assert swarm.processes["target"].poll() is None, "the server died"
    deadline = time.monotonic() + 30
    swarm.wait_for(
        prefix,
        NUM_BLOCKS,
        lambda online: online["target"].cache_bytes_left == full_bytes,
        timeout=max(deadline - time.monotonic(), 1),
        what="free cache back to full",
    )
