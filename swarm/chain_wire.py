"""The messages of chain sessions: each server of a client's chain sends its output for a step
straight to the next server, which runs the step from whichever copy comes first, the pushed one or
the client's, exactly once.

The client still sends every server its copy of the step (what it keeps to replay a failed server),
so a push that fails or comes late never stalls a session. What changes is who waits: a server that
ran a step from a push answers the client at once, without waiting for the client's copy, so a token
through n hops costs one client round trip plus the servers' own links instead of n client round
trips. Protocol and failure cases: docs/architecture.md, "Chain sessions".

  client -> server, on its session stream, no reply:
      ChainLink(accept_token, accept_from, next_peer, next_session, next_token, next_frames)
  client -> server: Step(..., step_id, push_hops=k): after the step, push its output k hops on
  server A -> server B, on a stream to B's `push_steps` handler:
      PushSteps(session_id, token), then per step PushedStep(step_id, position, hypo_ids, masked,
      push_hops) + tensors [hidden, padding_mask if masked], as a step frame when `next_frames` and
      it has one; B answers only a refusal (an `Error`, and the stream ends)
  server B -> client, on B's session stream, unprompted: StepDone(step_id, position, pushed=True,
      input_digest): the digest of the input B ran, which the client compares with its own copy
"""

from __future__ import annotations

import hashlib

import torch
from hivemind.proto import runtime_pb2
from pydantic import Field

from llm_swarm.swarm.wire import Message, ProtocolError, RequestId, SessionId, decode_metadata

TOKEN_PATTERN = r"^[0-9a-f]{32,64}$"  # a secret the client draws: only its holder may push to a session
OPTIONAL_TOKEN_PATTERN = r"^([0-9a-f]{32,64})?$"
PEER_ID_MAX = 128
MAX_PUSH_HOPS = 64  # the longest chain a step travels by pushes


class ChainLink(Message):
    """Client -> server, on the session's stream, before the step it first concerns; no reply.

    `accept_token` and `accept_from`: the session accepts pushed steps from `accept_from` (its
    predecessor in the client's chain) bearing `accept_token`, and from nobody else ("": from nobody).
    `next_peer`, `next_session`, `next_token`: where the session pushes its outputs when a step asks
    for it (its successor; "": nowhere). Sent again whenever the chain around the server changes."""

    type: str = "chain_link"
    accept_token: str = Field(default="", pattern=OPTIONAL_TOKEN_PATTERN)
    accept_from: str = Field(default="", max_length=PEER_ID_MAX)
    next_peer: str = Field(default="", max_length=PEER_ID_MAX)
    next_session: str = Field(default="", max_length=64)
    next_token: str = Field(default="", pattern=OPTIONAL_TOKEN_PATTERN)
    # the successor takes pushed steps as frames (swarm.step_frame); only for servers that announce
    # frames themselves (others predate the field)
    next_frames: bool = False


class PushSteps(Message):
    """A -> B, the first message of a push stream: the session the steps are for, and its token."""

    type: str = "push_steps"
    session_id: SessionId
    token: str = Field(pattern=TOKEN_PATTERN)


class PushedStep(Message):
    """A -> B: a step of the session, computed by A; tensors: the hidden states `[batch, tokens,
    hidden]`, then the padding mask `[batch, position + tokens]` if `masked`. `push_hops`: how many
    hops further B pushes its own output."""

    type: str = "pushed_step"
    step_id: RequestId
    position: int = Field(ge=0)
    hypo_ids: list[int] | None = Field(default=None, max_length=4096)
    masked: bool = False
    push_hops: int = Field(default=0, ge=0, le=MAX_PUSH_HOPS)


def step_digest(hidden: torch.Tensor, padding_mask: torch.Tensor | None, hypo_ids) -> str:
    """What identifies a step's input: its hidden states' bytes, dtype and shape, its padding mask and
    its reordering. Equal on the client and the server exactly when both ran the same input."""
    digest = hashlib.blake2b(digest_size=16)
    for tensor in (hidden, padding_mask):
        if tensor is None:
            digest.update(b"none")
            continue
        tensor = tensor.detach().cpu().contiguous()
        digest.update(f"{tensor.dtype}{tuple(tensor.shape)}".encode())
        digest.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    digest.update(repr(None if hypo_ids is None else [int(i) for i in hypo_ids]).encode())
    return digest.hexdigest()


def answers_another_step(response: runtime_pb2.ExpertResponse, step_id: str | None) -> bool:
    """`response` is a server's answer to a step it ran from a push, and that step is not `step_id`:
    an answer to a chain step the client gave up (and ran again under another id)."""
    try:
        metadata = decode_metadata(response.metadata)
    except ProtocolError:  # garbage is for the reader's parser to refuse
        return False
    pushed = metadata.get("type") == "step_done" and metadata.get("pushed") is True
    return pushed and metadata.get("step_id") != step_id
