"""Step frames (swarm/step_frame.py): what is written reads back exactly, every field and dtype; what
cannot go as a frame says so; and a frame that is malformed in any way is refused with a clear
BAD_REQUEST, never an exception of another kind, a crash or a tensor built from someone's garbage."""

from __future__ import annotations

import struct

import pytest
import torch

from llm_swarm.swarm.chain_wire import PushedStep
from llm_swarm.swarm.step_frame import StepFrame, decode_frame, encode_frame, framable, pushed_answer_id
from llm_swarm.swarm.wire import ErrorCode, Opened, ProtocolError, Step, StepDone

pytestmark = pytest.mark.version_neutral

HIDDEN = torch.randn(2, 3, 8)
TENSORS = {
    "float32": torch.randn(2, 3, 4),
    "float16": torch.randn(3, 4).half(),
    "bfloat16": torch.randn(2, 3).to(torch.bfloat16),
    "float64": torch.randn(5).double(),
    "bool": torch.rand(2, 5) > 0.5,
    "int64": torch.arange(6).view(2, 3),
    "uint8": torch.arange(7, dtype=torch.uint8),
    "empty": torch.zeros(0, 4),
    "scalar": torch.tensor(3.5),
    "strided": torch.randn(4, 5)[:, 1:3],
    "requires grad": torch.randn(3, requires_grad=True),
}


def received(frame: StepFrame) -> StepFrame:
    """`frame` as a reader gets it: its bytes in one piece."""
    return StepFrame.received(b"".join(bytes(part) for part in frame.parts))


@pytest.mark.parametrize("name", TENSORS)
def test_every_dtype_reads_back_bit_for_bit(name):
    tensor = TENSORS[name]
    message = Step(step_id="s1", position=4)
    decoded, tensors = decode_frame(received(encode_frame(message, [tensor])), Step)
    assert decoded == message
    assert tensors[0].dtype == tensor.dtype and tensors[0].shape == tensor.shape
    assert torch.equal(tensors[0], tensor.detach())
    original = tensor.detach().clone()
    tensors[0].zero_()  # each decoded tensor owns writable memory: the sender's stays as it was
    assert torch.equal(tensor.detach(), original)


MESSAGES = {
    "step": (Step(step_id="7+1#3", position=7, last_only=True, push_hops=5), [HIDDEN, torch.ones(2, 10) > 0]),
    "plain step": (Step(step_id="s", position=0), [HIDDEN]),
    "answer": (StepDone(step_id="7+1#3", position=7, leaving=True), [HIDDEN]),
    "pushed answer": (
        StepDone(step_id="c", position=2, pushed=True, input_digest="0123456789abcdef" * 2),
        [HIDDEN],
    ),
    "pushed step": (
        PushedStep(step_id="c", position=2, masked=True, push_hops=1),
        [HIDDEN, torch.ones(2, 5)],
    ),
}


@pytest.mark.parametrize("name", MESSAGES)
def test_every_message_reads_back_with_all_its_fields(name):
    message, tensors = MESSAGES[name]
    frame = encode_frame(message, tensors)
    assert frame.nbytes == sum(len(part) for part in frame.parts)
    decoded, decoded_tensors = decode_frame(received(frame), type(message))
    assert decoded == message
    assert all(torch.equal(a, b) for a, b in zip(decoded_tensors, tensors, strict=True))


def test_what_has_no_frame_says_so():
    assert not framable(Step(step_id="b", position=0, hypo_ids=[1, 0]), [HIDDEN])  # beam reorderings
    assert not framable(Step(step_id="p", position=0, prompts=True), [HIDDEN, HIDDEN])  # deep prompts
    assert not framable(Step(step_id="t", position=0), [HIDDEN] * 3)
    assert not framable(Step(step_id="c", position=0), [torch.zeros(2, dtype=torch.complex64)])
    assert not framable(Opened(session_id="x" * 8, start=0, end=1, reserved_bytes=0), [])
    # what a peer chose and a protobuf message carries, but a frame cannot
    assert not framable(Step(step_id="schritt-ü", position=0), [HIDDEN])
    assert not framable(PushedStep(step_id="s", position=1 << 63), [HIDDEN])
    with pytest.raises(ValueError, match="has no frame"):
        encode_frame(Step(step_id="b", position=0, hypo_ids=[0]), [HIDDEN])


def test_an_answer_to_a_pushed_step_is_recognised_from_its_header():
    pushed = StepDone(step_id="chain#4", position=4, pushed=True, input_digest="ab" * 16)
    assert pushed_answer_id(received(encode_frame(pushed, [HIDDEN]))) == "chain#4"
    assert pushed_answer_id(received(encode_frame(StepDone(step_id="x", position=4), [HIDDEN]))) is None
    assert pushed_answer_id(received(encode_frame(Step(step_id="x", position=4), [HIDDEN]))) is None
    assert pushed_answer_id(StepFrame.received(b"\x02\x02")) is None


GOOD = b"".join(bytes(part) for part in encode_frame(Step(step_id="s1", position=3), [HIDDEN]).parts)
HEADER = struct.Struct("<BBBBBBxxq")


def header(kind=1, flags=0, hops=0, id_length=2, digest_length=0, tensors=1, position=3) -> bytes:
    return HEADER.pack(kind, flags, hops, id_length, digest_length, tensors, position)


TENSOR_AT = HEADER.size + 2  # where the good frame's tensor begins

# name -> (the frame's bytes, what the refusal says)
MALFORMED = {
    "empty": (b"", "shorter than a frame's header"),
    "a cut header": (GOOD[:10], "shorter than a frame's header"),
    "an unknown kind": (header(kind=9) + GOOD[HEADER.size :], "a frame of kind 9"),
    "an answer where a step belongs": (header(kind=2) + GOOD[HEADER.size :], "a frame of kind 2"),
    "unknown flags": (header(flags=0x80) + GOOD[HEADER.size :], "unknown flags"),
    "too many tensors": (header(tensors=3) + GOOD[HEADER.size :], "3 tensors"),
    "an id past the end": (header(id_length=255), "run past its end"),
    "an id not ASCII": (header() + b"\xff\xfe" + GOOD[TENSOR_AT:], "not ASCII"),
    "an empty id": (header(id_length=0) + GOOD[TENSOR_AT:], "step_id"),
    "a negative position": (header(position=-1) + GOOD[HEADER.size :], "position"),
    "too many hops": (header(hops=200) + GOOD[HEADER.size :], "push_hops"),
    "a digest on a step": (header(digest_length=2) + b"s1ab" + GOOD[TENSOR_AT:], "a digest on a Step"),
    "an unknown dtype": (GOOD[:TENSOR_AT] + b"\x63\x03" + GOOD[TENSOR_AT + 2 :], "unknown dtype code 99"),
    "too many dimensions": (GOOD[:TENSOR_AT] + b"\x01\x09" + GOOD[TENSOR_AT + 2 :], "9 dimensions"),
    "a shape past the end": (GOOD[: TENSOR_AT + 10], "shape runs past its end"),
    "a tensor header past the end": (GOOD[: TENSOR_AT + 1], "tensor's header runs past its end"),
    "a negative dimension": (
        GOOD[: TENSOR_AT + 2] + struct.pack("<3q", 2, -3, -8) + GOOD[TENSOR_AT + 26 :],
        "negative dimension",
    ),
    "a shape of more bytes than sent": (
        GOOD[: TENSOR_AT + 2] + struct.pack("<3q", 2, 3, 1 << 40) + GOOD[TENSOR_AT + 26 :],
        "left",
    ),
    "a cut tensor": (GOOD[:-4], "needs 192 bytes, 188 left"),
    "trailing bytes": (GOOD + b"\0" * 5, "5 bytes after its last tensor"),
}


@pytest.mark.parametrize("name", MALFORMED)
def test_a_malformed_frame_is_refused_clearly(name):
    data, match = MALFORMED[name]
    with pytest.raises(ProtocolError, match="malformed step frame") as refused:
        decode_frame(StepFrame.received(data), Step)
    assert refused.value.code == ErrorCode.BAD_REQUEST
    assert match in str(refused.value), str(refused.value)


def test_the_good_frame_the_malformed_ones_are_cut_from_decodes():
    message, tensors = decode_frame(StepFrame.received(GOOD), Step)
    assert message == Step(step_id="s1", position=3) and torch.equal(tensors[0], HIDDEN)
