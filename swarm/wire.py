"""The session protocol between clients and servers, over hivemind P2P (docs/reference.md section 5).

Every message is a hivemind `ExpertRequest`/`ExpertResponse`: tensors plus msgpack metadata. The
metadata is validated with pydantic models here, so a server never trusts a field it did not check.

An inference stream:
  client -> server  Open(session_id, max_length, batch_size, start, end)
  server -> client  Opened(...) or Error(code, message) and the stream ends
  client -> server  Step(step_id, position) + tensors [hidden] (+ [padding_mask] for padded batches)
  server -> client  StepDone(step_id, position) + tensors [hidden]   or Error(code, message)
  client -> server  Replay(replay_id) + tensors [layout, hidden, ...]: recorded steps, run in order
  server -> client  Replayed(replay_id, steps) + tensors [outputs]   or Error, and the stream ends
A step names its absolute position, so a replayed or retried step recomputes the same positions and
overwrites the cache: the same step id at the same position is answered from the last result.
"""

from __future__ import annotations

import functools
from enum import StrEnum
from typing import Annotated, Literal

import torch
from hivemind.proto import runtime_pb2
from hivemind.utils.serializer import MSGPackSerializer
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from llm_swarm.swarm.tensor_wire import tensor_from_proto, write_tensor

PROTOCOL_VERSION = 1
OPTIONAL_ADAPTER_NAME = r"^([A-Za-z0-9][A-Za-z0-9._-]{0,63})?$"  # "" or an adapter's name
MAX_METADATA_BYTES = 16 * 1024

# fields several messages carry, checked alike wherever they come
SessionId = Annotated[str, Field(min_length=8, max_length=64)]
RequestId = Annotated[str, Field(min_length=1, max_length=64)]  # a step's, a replay's, a hand-off's
SwarmProof = Annotated[str, Field(max_length=128)]  # closed swarms only (swarm.closed_swarm); "" none


class ErrorCode(StrEnum):
    BAD_REQUEST = "bad_request"  # malformed or invalid: fix the request
    NO_CACHE_ROOM = "no_cache_room"  # valid but does not fit now: wait or route elsewhere
    NOT_SERVING = "not_serving"  # the server is leaving or does not hold those blocks: route elsewhere
    # idle too long, or rewound past what its sliding-window blocks keep: open a new session and replay
    SESSION_EXPIRED = "session_expired"
    UNAUTHORIZED = "unauthorized"  # a closed swarm, and the request does not prove its secret
    INTERNAL = "internal"


# how a NO_CACHE_ROOM reply begins when the server has room, only not for this client peer (its
# per-peer share is used up): the client goes elsewhere without holding it against the server
PEER_LIMIT_PREFIX = "no cache room for this peer"


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Open(Message):
    type: str = "open"
    protocol: int = PROTOCOL_VERSION
    session_id: SessionId
    max_length: int = Field(gt=0)
    batch_size: int = Field(gt=0)
    start: int = Field(ge=0)  # blocks to process for this session: [start, end) inside the server's span
    end: int = Field(gt=0)
    swarm_proof: SwarmProof = ""
    # the LoRA adapter (by the name servers announce) every step of the session uses; "" none
    adapter: str = Field(default="", max_length=64, pattern=OPTIONAL_ADAPTER_NAME)
    # a session that will receive its cache from another server (a hand-off, swarm.handoff_wire): the
    # client's secret for it and the peer id of the only server that may push it
    cache_token: str = Field(default="", pattern=r"^([0-9a-f]{32,64})?$")
    cache_from: str = Field(default="", max_length=128)


class Opened(Message):
    type: str = "opened"
    session_id: str
    start: int
    end: int
    reserved_bytes: int


class Step(Message):
    type: str = "step"
    step_id: RequestId
    position: int = Field(ge=0)
    # beam search: before this step, sequence i of the session continues sequence hypo_ids[i]
    hypo_ids: list[int] | None = Field(default=None, max_length=4096)
    # deep prompt tuning: the last tensor holds a prompt per block of the session, added to the
    # block's input at positions below its length
    prompts: bool = False
    # reply with the last position's output only: a failover's catch-up prefill into the last server
    # of a replacement chain, whose outputs nobody reads (half the bytes on the wire)
    last_only: bool = False
    # chain sessions (swarm.chain_wire): push the output to the session's successor, which pushes it
    # on, `push_hops` hops in all; the same step id names the step on every server of the chain
    push_hops: int = Field(default=0, ge=0, le=64)


class StepDone(Message):
    type: str = "step_done"
    step_id: str
    position: int
    # the server is leaving (draining or moving): the client should move the session now (a hand-off)
    leaving: bool = False
    # the step ran from the predecessor's push (swarm.chain_wire), not the client's copy: the digest
    # of the input it ran (`chain_wire.step_digest`), which the client compares with its own copy
    pushed: bool = False
    input_digest: str = Field(default="", max_length=64)


class Replay(Message):
    """Recorded steps of a session in one message, run by the server in their order: a failover's
    exact replay, in one round trip instead of one per step (docs/architecture.md, "Replay").
    Tensors: the layout `int64 [steps, 4]` (each step's position, token count, 1 if it reorders the
    batch first, 1 if it has a padding mask), the steps' hidden states concatenated `[batch, tokens,
    hidden]`, then if `masked` the steps' own new mask columns concatenated `bool [batch, tokens]`
    and the session's mask `bool [batch, length]` (a masked step attends to the session's mask below
    its position and to its own new columns), then if `reordered` the reordering steps' `hypo_ids`
    as `int64 [steps that reorder, batch]`."""

    type: str = "replay"
    replay_id: RequestId
    masked: bool = False
    reordered: bool = False


class Replayed(Message):
    """The reply to `Replay`: tensors hold every step's output, concatenated in step order."""

    type: str = "replayed"
    replay_id: str
    steps: int


class _WholeSequenceCall(Message):
    """What `Forward` and `Backward` share: the blocks, whether deep prompts come, the swarm's proof."""

    type: str
    start: int = Field(ge=0)
    end: int = Field(gt=0)
    prompts: bool = False
    swarm_proof: SwarmProof = ""
    adapter: str = Field(
        default="", max_length=64, pattern=OPTIONAL_ADAPTER_NAME
    )  # the LoRA adapter to apply ("" none)


class Forward(_WholeSequenceCall):
    """Blocks `[start, end)` on whole sequences, nothing kept. Tensors: hidden states `[batch, tokens,
    hidden]`, then a padding mask `[batch, tokens]` if the batch is padded, then the deep prompts
    `[end - start, batch or 1, prefix, hidden]` if `prompts`."""

    type: str = "forward"


class Backward(_WholeSequenceCall):
    """Gradients of a `Forward` (recomputed, nothing kept between calls). Tensors: hidden states, the
    gradient of the output (same shape), then the optional padding mask and prompts as in `Forward`.
    The reply holds the gradient of the hidden states, then of the prompts if `prompts`."""

    type: str = "backward"


class Computed(Message):
    """The reply to `Forward` and `Backward`."""

    type: str = "computed"


class Report(Message):
    """A client's notice to a server that its output for blocks `[start, end)` was wrong: outvoted by
    two replicas, or malformed (NaN, a wrong shape). Only counted and logged, so the operator of an
    honest server with a failing GPU or a bad quantization finds out; it changes nothing else, since
    any client may send it."""

    type: str = "report"
    start: int = Field(ge=0)
    end: int = Field(gt=0)
    reason: Literal["outvoted", "malformed"]
    # from the majority's output (outvoted); 0 when malformed
    relative_difference: float = Field(default=0.0, ge=0.0, le=1e30, allow_inf_nan=False)
    swarm_proof: SwarmProof = ""


class Ack(Message):
    type: str = "ack"


class InfoRequest(Message):
    type: str = "info"
    swarm_proof: SwarmProof = ""


class Error(Message):
    type: str = "error"
    code: ErrorCode
    message: str


class ProtocolError(Exception):
    """A message that is not what the protocol allows; the text says what was wrong."""

    def __init__(self, code: ErrorCode, message: str):
        super().__init__(message)
        self.code = code


class RemoteError(Exception):
    """An `Error` reply from a server."""

    def __init__(self, code: ErrorCode, message: str, peer: str = ""):
        super().__init__(f"{peer}: {message}" if peer else message)
        self.code, self.peer, self.message = code, peer, message


# fields messages leave out when they hold these values (what servers that predate them assume)
OPTIONAL_FIELDS = {
    "swarm_proof": "",
    "hypo_ids": None,
    "prompts": False,
    "last_only": False,
    "adapter": "",
    "cache_token": "",
    "cache_from": "",
    "leaving": False,
    "follow": False,
    "push_hops": 0,
    "next_frames": False,
    "pushed": False,
    "input_digest": "",
}


def _same(value: object, empty: object) -> bool:
    """`value` is `empty` itself: 0 is not False here, nor False 0."""
    return type(value) is type(empty) and value == empty


@functools.cache
def _optional_fields(kind: type[Message]) -> tuple[tuple[str, object], ...]:
    """`OPTIONAL_FIELDS` that messages of `kind` have (looked up once per kind, not per message)."""
    return tuple((name, empty) for name, empty in OPTIONAL_FIELDS.items() if name in kind.model_fields)


def encode(message: Message, tensors: list[torch.Tensor] = (), request: bool = True):
    # optional fields left empty are left out, so servers that predate them accept the message
    unused = {name for name, empty in _optional_fields(type(message)) if _same(getattr(message, name), empty)}
    metadata = MSGPackSerializer.dumps(message.model_dump(mode="json", exclude=unused))
    encoded = (
        runtime_pb2.ExpertRequest(uid="", metadata=metadata)
        if request
        else runtime_pb2.ExpertResponse(metadata=metadata)
    )
    for tensor in tensors:
        # host memory only on the wire: a server on a GPU sends its caches' chunks (hand-offs)
        write_tensor(encoded.tensors.add(), tensor.cpu())
    return encoded


def decode_metadata(raw: bytes) -> dict:
    if len(raw) > MAX_METADATA_BYTES:
        raise ProtocolError(
            ErrorCode.BAD_REQUEST, f"metadata of {len(raw)} bytes exceeds {MAX_METADATA_BYTES}"
        )
    try:
        metadata = MSGPackSerializer.loads(raw)
    except Exception:  # msgpack raises several unrelated types on garbage
        raise ProtocolError(ErrorCode.BAD_REQUEST, "metadata is not valid msgpack") from None
    if not isinstance(metadata, dict):
        raise ProtocolError(ErrorCode.BAD_REQUEST, "metadata must be a map")
    return metadata


def parse(raw: bytes, *allowed: type[Message]) -> Message:
    metadata = decode_metadata(raw)
    kinds = {cls.model_fields["type"].default: cls for cls in allowed}
    kind = metadata.get("type")
    if kind not in kinds:
        raise ProtocolError(
            ErrorCode.BAD_REQUEST, f"expected a message of type {sorted(kinds)}, got {kind!r}"
        )
    try:
        return kinds[kind].model_validate(metadata)
    except ValidationError as error:
        problems = "; ".join(
            f"{'.'.join(map(str, e['loc'])) or 'message'}: {e['msg']}" for e in error.errors()
        )
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"invalid {kind} message: {problems}") from None


def decode_tensors(message) -> list[torch.Tensor]:
    try:
        return [tensor_from_proto(t) for t in message.tensors]
    except Exception as error:  # unknown dtype, buffer of the wrong size, bad compression id...
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"cannot decode tensors: {error}") from None


def raise_if_error(reply: Message, peer: str = "") -> None:
    if isinstance(reply, Error):
        raise RemoteError(reply.code, reply.message, peer)
