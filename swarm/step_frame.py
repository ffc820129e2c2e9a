"""A step and its answer in a compact binary frame: a fixed header, the step's id, then each tensor
as its dtype, its shape and its raw bytes.

A session's steps are its most frequent messages, and most of what a small one costs is not its
bytes: as a hivemind `ExpertRequest` it goes through pydantic, msgpack and protobuf on each side, a
dozen Python calls and a copy of the tensor at each layer, about twice what this frame costs
(docs/architecture.md, "Step frames"). The frame travels in hivemind's stream framing under a
marker byte of its own (hivemind uses 0 for a message and 1 for an error), so a stream carries
frames and protobuf messages side by side and the length header is checked against the stream's
limit before a frame is read, as any message's is. The frame holds the fields of `Step`,
`StepDone` and `PushedStep` that decoding needs; a step that reorders a beam (`hypo_ids`) or
carries deep prompts goes as a protobuf message. What a frame decodes to is validated by the same
pydantic models as the protobuf messages, and its tensors by the same checks.

Layout, little-endian:
  header   kind u8, flags u8, push_hops u8, id length u8, digest length u8, tensors u8, 2 zero
           bytes, position i64
  then     the id (ASCII), the digest (ASCII hex)
  tensor   dtype code u8, dims u8, each dim i64, then its bytes in C order
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from enum import IntEnum

import numpy as np
import torch
from pydantic import ValidationError

from llm_swarm.swarm.chain_wire import PushedStep
from llm_swarm.swarm.tensor_wire import WIRE_DTYPES, host_bytes
from llm_swarm.swarm.wire import ErrorCode, Message, ProtocolError, Step, StepDone

MARKER = b"\x02"  # hivemind's stream framing: 0 a message, 1 an error; 2 a step frame
MAX_TENSORS = 2  # hidden states, then a padding mask
MAX_DIMS = 4
_HEADER = struct.Struct("<BBBBBBxxq")
_TENSOR = struct.Struct("<BB")
_SHAPES = tuple(struct.Struct(f"<{dims}q") for dims in range(MAX_DIMS + 1))  # a shape of 0..4 dims
_CODES = {dtype: code for code, dtype in enumerate(WIRE_DTYPES, start=1)}  # its place, from 1
# each dtype's numpy type, to build a received tensor through numpy (half the cost of
# `torch.frombuffer`); bfloat16, which numpy lacks, as its raw 16-bit words
_NUMPY = {
    dtype: torch.empty(0, dtype=torch.int16 if dtype == torch.bfloat16 else dtype).numpy().dtype
    for dtype in WIRE_DTYPES
}


class FrameKind(IntEnum):
    STEP = 1
    STEP_DONE = 2
    PUSHED_STEP = 3


_KINDS = {Step: FrameKind.STEP, StepDone: FrameKind.STEP_DONE, PushedStep: FrameKind.PUSHED_STEP}
# each kind's flags (a bit each, from the lowest): Step last_only; StepDone leaving, pushed;
# PushedStep masked. Higher bits are refused
_FLAG_BITS = {FrameKind.STEP: 1, FrameKind.STEP_DONE: 2, FrameKind.PUSHED_STEP: 1}
_MESSAGES = {kind: message for message, kind in _KINDS.items()}


@dataclass(frozen=True, slots=True)
class StepFrame:
    """A frame's bytes: in pieces as written (the header, then each tensor's own buffer, so that a
    tensor is copied only where the pieces are joined for the socket), in one piece as read."""

    parts: tuple[bytes | memoryview, ...]
    nbytes: int

    @classmethod
    def received(cls, body: bytes) -> StepFrame:
        return cls((body,), len(body))


def framable(message: Message, tensors: list[torch.Tensor]) -> bool:
    """Whether `message` with `tensors` can go as a frame (else it goes as a protobuf message): an id
    a peer may have chosen need not be ASCII, nor its position fit 64 bits."""
    return (
        type(message) in _KINDS
        and message.step_id.isascii()
        and getattr(message, "input_digest", "").isascii()
        and message.position < 1 << 63
        and getattr(message, "hypo_ids", None) is None
        and not getattr(message, "prompts", False)
        and len(tensors) <= MAX_TENSORS
        and all(tensor.dtype in _CODES and tensor.ndim <= MAX_DIMS for tensor in tensors)
    )


def encode_frame(message: Step | StepDone | PushedStep, tensors: list[torch.Tensor]) -> StepFrame:
    """`message` and its host or device `tensors` as a frame; ValueError if it is not `framable`."""
    if not framable(message, tensors):
        raise ValueError(f"a {type(message).__name__} with these fields or tensors has no frame")
    kind = _KINDS[type(message)]
    if kind == FrameKind.STEP:
        flags, hops, digest = int(message.last_only), message.push_hops, b""
    elif kind == FrameKind.STEP_DONE:
        flags, hops = int(message.leaving) | int(message.pushed) << 1, 0
        digest = message.input_digest.encode("ascii")
    else:
        flags, hops, digest = int(message.masked), message.push_hops, b""
    step_id = message.step_id.encode("ascii")
    parts = [_HEADER.pack(kind, flags, hops, len(step_id), len(digest), len(tensors), message.position)]
    parts += (step_id, digest)
    for tensor in tensors:
        shape = tensor.shape
        parts.append(_TENSOR.pack(_CODES[tensor.dtype], len(shape)))
        parts.append(_SHAPES[len(shape)].pack(*shape))
        parts.append(host_bytes(tensor))
    return StepFrame(tuple(parts), sum(map(len, parts)))


def decode_frame(frame: StepFrame, *allowed: type[Message]) -> tuple[Message, list[torch.Tensor]]:
    """The message (one of `allowed`) and tensors a received frame holds, each tensor in memory of
    its own; ProtocolError (BAD_REQUEST) naming what is wrong with a malformed one."""
    body = memoryview(frame.parts[0] if len(frame.parts) == 1 else b"".join(frame.parts))
    if len(body) < _HEADER.size:
        raise _malformed(f"{len(body)} bytes are shorter than a frame's header")
    kind, flags, hops, id_length, digest_length, count, position = _HEADER.unpack_from(body)
    message_type = _MESSAGES.get(kind)
    if message_type not in allowed:
        raise _malformed(f"a frame of kind {kind}, expected {sorted(m.__name__ for m in allowed)}")
    if flags >> _FLAG_BITS[kind]:
        raise _malformed(f"unknown flags {flags:#x} for a {message_type.__name__}")
    if count > MAX_TENSORS:
        raise _malformed(f"{count} tensors, at most {MAX_TENSORS}")
    id_end = _HEADER.size + id_length
    offset = id_end + digest_length
    if offset > len(body):
        raise _malformed("its id and digest run past its end")
    try:
        step_id = str(body[_HEADER.size : id_end], "ascii")
        digest = str(body[id_end:offset], "ascii") if digest_length else ""
    except UnicodeDecodeError:
        raise _malformed("its id or digest is not ASCII") from None
    tensors = []
    for _ in range(count):
        tensor, offset = _read_tensor(body, offset)
        tensors.append(tensor)
    if offset != len(body):
        raise _malformed(f"{len(body) - offset} bytes after its last tensor")
    if kind != FrameKind.STEP_DONE and digest:
        raise _malformed(f"a digest on a {message_type.__name__}")
    if kind == FrameKind.STEP_DONE and hops:
        raise _malformed("push hops on a StepDone")
    try:
        if kind == FrameKind.STEP:
            message = Step(step_id=step_id, position=position, last_only=flags == 1, push_hops=hops)
        elif kind == FrameKind.STEP_DONE:
            message = StepDone(
                step_id=step_id,
                position=position,
                leaving=bool(flags & 1),
                pushed=bool(flags & 2),
                input_digest=digest,
            )
        else:
            message = PushedStep(step_id=step_id, position=position, masked=flags == 1, push_hops=hops)
    except ValidationError as error:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in error.errors())
        raise _malformed(problems) from None
    return message, tensors


def pushed_answer_id(frame: StepFrame) -> str | None:
    """The step id of a `StepDone` frame that answers a pushed step (`StepDone.pushed`), read from its
    header alone; None for any other frame, malformed ones included (its decoder refuses those)."""
    body = frame.parts[0]
    if frame.nbytes < _HEADER.size or len(frame.parts) != 1:
        return None
    kind, flags, _, id_length, *_ = _HEADER.unpack_from(body)
    if kind != FrameKind.STEP_DONE or not flags & 2 or _HEADER.size + id_length > len(body):
        return None
    return bytes(body[_HEADER.size : _HEADER.size + id_length]).decode("ascii", "replace")


def _read_tensor(body: memoryview, offset: int) -> tuple[torch.Tensor, int]:
    """The tensor that starts at `offset`, and where the next part begins."""
    if offset + _TENSOR.size > len(body):
        raise _malformed("a tensor's header runs past its end")
    code, ndim = _TENSOR.unpack_from(body, offset)
    offset += _TENSOR.size
    if not 1 <= code <= len(WIRE_DTYPES):
        raise _malformed(f"unknown dtype code {code}")
    if ndim > MAX_DIMS:
        raise _malformed(f"a tensor of {ndim} dimensions, at most {MAX_DIMS}")
    shape_format = _SHAPES[ndim]
    if offset + shape_format.size > len(body):
        raise _malformed("a tensor's shape runs past its end")
    shape = shape_format.unpack_from(body, offset)
    offset += shape_format.size
    if any(size < 0 for size in shape):
        raise _malformed(f"a negative dimension in shape {shape}")
    dtype = WIRE_DTYPES[code - 1]
    size = math.prod(shape) * dtype.itemsize
    if size > len(body) - offset:
        left = len(body) - offset
        raise _malformed(f"a {dtype} tensor of shape {shape} needs {size:,} bytes, {left:,} left")
    if size == 0:
        return torch.empty(shape, dtype=dtype), offset
    # a writable copy: the frame's bytes are immutable, and a step's input may be worked on in place
    array = np.frombuffer(bytearray(body[offset : offset + size]), _NUMPY[dtype]).reshape(shape)
    tensor = torch.from_numpy(array)
    return (tensor.view(torch.bfloat16) if dtype == torch.bfloat16 else tensor), offset + size


def _malformed(problem: str) -> ProtocolError:
    return ProtocolError(ErrorCode.BAD_REQUEST, f"malformed step frame: {problem}")
