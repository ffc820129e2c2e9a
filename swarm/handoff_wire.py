"""The messages of a cache hand-off: a session's attention cache moving from server A to server B.

Only the client can authorize a hand-off (the session is its own): it opens a session on B that
expects a cache (`Open.cache_token`, `Open.cache_from` = A's peer id), then asks A on A's session
stream to push it there (`HandOff`, with the same token). A streams the cache to B directly over the
P2P transport (`PushCache`, then `CacheChunk`s), B checks everything and answers `CacheAccepted`, A
answers the client `HandedOff`. Protocol and failure cases: docs/architecture.md, "Cache hand-off".
"""

from __future__ import annotations

from pydantic import Field

from llm_swarm.swarm.wire import Message, RequestId, SessionId

TOKEN_PATTERN = r"^[0-9a-f]{32,64}$"  # a secret the client draws (hex): B accepts a cache only with it
PEER_ID_MAX = 128
CHUNK_BYTES = 1024 * 1024  # a chunk message carries at most this many tensor bytes (pacing granularity)


class HandOff(Message):
    """Client -> A, on A's session stream: push positions `[0, length)` of this session's cache to
    `target_session` on `target_peer`. A answers `HandedOff` or an error; the session on A stays
    open either way (the client closes it once B holds the cache). `max_seconds`: give up (and answer
    an error) once the push is measured to need longer than this (the client's estimate of a replay).

    `follow` (Splitwise's streaming during the prompt): the positions are not computed yet; the
    session's next request is the step that computes them (its prompt), and A pushes each part of the
    cache as soon as the prompt's chunk that computes it is done, overlapping the transfer with the
    rest of the prompt. A answers the step first, then `HandedOff` (or an error) once the push ends.
    Anything but a step next, or a step that does not compute all `length` positions, cancels it."""

    type: str = "hand_off"
    handoff_id: RequestId
    target_peer: str = Field(min_length=1, max_length=PEER_ID_MAX)
    target_session: SessionId
    token: str = Field(pattern=TOKEN_PATTERN)
    length: int = Field(ge=1)
    max_seconds: float = Field(gt=0, le=3600, allow_inf_nan=False)
    follow: bool = False


class HandedOff(Message):
    """A -> client: B accepted the cache; `seconds` and `bytes` of the push (A's measured link to B)."""

    type: str = "handed_off"
    handoff_id: str
    length: int
    bytes: int
    seconds: float


class PushCache(Message):
    """A -> B, the first message of a push stream: which session, its token, how much comes."""

    type: str = "push_cache"
    session_id: SessionId
    token: str = Field(pattern=TOKEN_PATTERN)
    length: int = Field(ge=1)


class CacheChunk(Message):
    """A -> B: keys and values of one block (index inside the session's blocks) for positions
    `[position, position + n)`. Tensors: keys, values, each `[batch, kv_heads, n, head_dim]`.
    Each block's positions come in order, without gaps, ending at the pushed length; blocks may
    interleave (block by block for a computed cache; position range by range, every block each time,
    for a cache pushed while its prompt runs)."""

    type: str = "cache_chunk"
    block: int = Field(ge=0)
    position: int = Field(ge=0)


class CacheAccepted(Message):
    """B -> A: every block holds the pushed positions; the session continues at `length`."""

    type: str = "cache_accepted"
    length: int


# --- link probes: how fast a server-to-server link is, before any hand-off needs it -----------------
PROBE_MAX_CHUNKS = 8  # a probe carries at most this many chunks of at most CHUNK_BYTES


class ProbeLink(Message):
    """A -> B, the first message of a probe stream: `chunks` chunks of filler bytes follow, each
    acknowledged (`ProbeAck`); A measures the link on the acknowledgements, B keeps nothing."""

    type: str = "probe_link"
    chunks: int = Field(ge=1, le=PROBE_MAX_CHUNKS)


class ProbeChunk(Message):
    """A -> B: filler bytes, one uint8 tensor of at most CHUNK_BYTES."""

    type: str = "probe_chunk"


class ProbeAck(Message):
    """B -> A after each chunk: the probe's bytes received so far."""

    type: str = "probe_ack"
    bytes: int
