"""What a server announces about itself in the DHT (docs/reference.md section 5), versioned and validated.

Readers skip records that fail validation (a buggy or hostile peer cannot break routing), and
ignore fields they do not know, so newer servers can add fields without breaking older clients.
Every number is finite and bounded: a record is what any peer of the DHT may have written, so
nothing in it may be large enough to overflow a sum, starve the placement or break a JSON page.
Bounds that depend on the model (blocks inside it, plausible block sizes) are the readers'
(`swarm.model_limits`), from their own copy of its config.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated

from pydantic import Field, model_validator

from llm_swarm.swarm.adapter_names import ADAPTER_NAME
from llm_swarm.swarm.versioned_record import VersionedRecord

SCHEMA_VERSION = 1

MAX_BLOCKS = 1 << 16  # more blocks than any model has
MAX_MEMORY_BYTES = 1 << 46  # 64 TiB: more than any one server holds
MAX_TOKENS = 1 << 24
MIN_TAU = 1e-6  # seconds per block per token: no real block decodes in under a microsecond
MAX_SECONDS = 3600.0
MAX_PING_SECONDS = 60.0  # a round trip between two servers; slower than this is no link to push over


class ServerState(StrEnum):
    JOINING = "joining"  # loading blocks: visible, but not serving yet
    ONLINE = "online"
    OFFLINE = "offline"  # leaving (or draining): accepts no new sessions
    MOVING = "moving"  # draining to switch to a new span the scheduler assigned


class Reachability(StrEnum):
    """How clients can connect to a server (decided at its start-up, see `swarm.reachability`)."""

    DIRECT = "direct"  # peers can dial it
    RELAY = "relay"  # behind NAT: reachable through a relay's circuit (one more hop)
    UNREACHABLE = "unreachable"  # neither: clients and the scheduler never route to it


class ServerRole(StrEnum):
    """Which phase of sessions a server takes (`swarm-server --role`): prompts only (its caches are
    handed to decode servers), decoding only, or both (every server before roles existed)."""

    PREFILL = "prefill"
    DECODE = "decode"
    BOTH = "both"

    def serves(self, phase: str) -> bool:
        """`phase`: "prefill" (the disaggregated prompt: prefill servers only), "decode" (a session
        as usual: decode and both), or "any"."""
        if phase == "prefill":
            return self == ServerRole.PREFILL
        if phase == "decode":
            return self != ServerRole.PREFILL
        return True


class ServerInfo(VersionedRecord):
    current_schema_version = SCHEMA_VERSION

    schema_version: int = SCHEMA_VERSION
    state: ServerState
    # None (with end None): no blocks yet, waiting for an assignment
    start: int | None = Field(default=None, ge=0, lt=MAX_BLOCKS)
    end: int | None = Field(default=None, gt=0, le=MAX_BLOCKS)
    managed: bool = False  # takes its span from the scheduler (started without --blocks)
    # DHT time of the announcement: the newest record of a peer wins
    announced_at: float = Field(default=0.0, ge=0, le=1e12)
    public_name: str = Field(default="", max_length=128)
    # what the blocks compute in ("float32", "bfloat16", ...; "int8"/"nf4" when quantized): how far
    # its outputs may honestly differ from another server's (replica verification's tolerance)
    dtype: str = Field(default="", max_length=16)
    version: str = Field(default="", max_length=64)
    memory_bytes: int = Field(ge=0, le=MAX_MEMORY_BYTES)  # M_j: the whole budget, blocks included
    block_bytes: int = Field(ge=0, le=MAX_MEMORY_BYTES)  # s_m
    # cache bytes per token per block per sequence (s_c / tokens)
    cache_token_bytes: int = Field(ge=0, le=1 << 32)
    cache_bytes_left: int = Field(ge=0, le=MAX_MEMORY_BYTES)  # what new sessions may still reserve
    # (session, block) caches of `slot_tokens` tokens that still fit
    cache_slots_left: int = Field(ge=0, le=MAX_MEMORY_BYTES)
    slot_tokens: int = Field(gt=0, le=MAX_TOKENS)  # the session length `cache_slots_left` is counted for
    max_length: int = Field(gt=0, le=MAX_TOKENS)  # longest session the server accepts
    tau: float | None = Field(default=None, ge=MIN_TAU, le=MAX_SECONDS)  # per-block per-token decode s
    # per-block prefill seconds for `prefill_tokens`
    tau_prefill: float | None = Field(default=None, ge=MIN_TAU, le=MAX_SECONDS)
    # what each other session decoding here at once adds to `tau` (measured: `server.decode_load`)
    tau_per_session: float | None = Field(default=None, ge=0, le=MAX_SECONDS)
    prefill_tokens: int = Field(default=0, ge=0, le=MAX_TOKENS)
    # tokens per chunk its prompts run in, each chunk's cache streamed as soon as computed when a
    # hand-off follows the prompt (`HandOff.follow`); 0: a server that predates streaming
    prefill_chunk: int = Field(default=0, ge=0, le=MAX_TOKENS)
    throughput: float | None = Field(default=None, ge=0, le=1 / MIN_TAU)  # tokens/s through the whole span
    active_sessions: int = Field(default=0, ge=0, le=1 << 24)
    # servers that predate the field were reachable as far as anyone knew: DIRECT
    reachability: Reachability = Reachability.DIRECT
    role: ServerRole = ServerRole.BOTH
    # takes part in chain sessions (swarm/chain_wire.py): pushes its outputs to the next server and
    # runs steps pushed to it; servers that predate them leave it out
    chain_push: bool = False
    # takes a session's steps as compact frames (swarm/step_frame.py) and answers them so; servers
    # that predate frames leave it out
    step_frames: bool = False
    # cache hand-offs this server measured: peer id -> bytes/s of its pushes there (at most 16)
    links: dict[Annotated[str, Field(max_length=128)], Annotated[float, Field(gt=0, le=1e12)]] = Field(
        default_factory=dict, max_length=16
    )
    # round trips this server measured to servers holding the block after its span, which chain
    # sessions push its outputs to (server/next_server_pings.py): peer id -> seconds (at most 16)
    next_rtts: dict[
        Annotated[str, Field(max_length=128)], Annotated[float, Field(gt=0, le=MAX_PING_SECONDS)]
    ] = Field(default_factory=dict, max_length=16)
    # where the server serves its streams directly ("host:port", swarm/direct_listener.py): TLS under
    # its identity key; "" when it serves them over libp2p only (and from servers that predate them)
    direct_address: str = Field(default="", max_length=64, pattern=r"^$|^[0-9A-Za-z.:\[\]-]+:[0-9]{1,5}$")
    # LoRA adapters a session may name (swarm.models.adapters): at most 16 names of at most 64 characters
    adapters: tuple[Annotated[str, Field(pattern=ADAPTER_NAME, max_length=64)], ...] = Field(
        default=(), max_length=16
    )

    @model_validator(mode="after")
    def _span_is_ordered(self) -> ServerInfo:
        if (self.start is None) != (self.end is None):
            raise ValueError("start and end are both set or both absent")
        if self.start is not None and self.end <= self.start:
            raise ValueError("end must be greater than start")
        if self.cache_bytes_left > self.memory_bytes:
            raise ValueError("cache_bytes_left exceeds memory_bytes")
        return self

    @property
    def routable(self) -> bool:
        """Clients may open sessions here: ONLINE, and reachable directly or through a relay."""
        return self.state == ServerState.ONLINE and self.reachability != Reachability.UNREACHABLE

    @property
    def has_blocks(self) -> bool:
        return self.start is not None

    @property
    def num_blocks(self) -> int:
        return self.end - self.start if self.start is not None else 0

    def cache_bytes_for(self, num_blocks: int, max_length: int, batch_size: int) -> int:
        """Cache bytes a session of `batch_size` x `max_length` tokens reserves on `num_blocks` blocks."""
        return self.cache_token_bytes * num_blocks * max_length * batch_size
