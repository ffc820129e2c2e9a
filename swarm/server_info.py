"""What a server announces about itself in the DHT (SPEC section 5), versioned and validated.

Readers skip records that fail validation (a buggy or hostile peer cannot break routing), and
ignore fields they do not know, so newer servers can add fields without breaking older clients.
"""

from __future__ import annotations

from enum import StrEnum

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

SCHEMA_VERSION = 1


class ServerState(StrEnum):
    JOINING = "joining"  # loading blocks: visible, but not serving yet
    ONLINE = "online"
    OFFLINE = "offline"  # leaving (or draining): accepts no new sessions
    MOVING = "moving"  # draining to switch to a new span the scheduler assigned


class ServerInfo(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)

    schema_version: int = SCHEMA_VERSION
    state: ServerState
    start: int | None = Field(default=None, ge=0)  # None: no blocks yet (waiting for an assignment)
    end: int | None = Field(default=None, gt=0)
    managed: bool = False  # takes its span from the scheduler (started without --blocks)
    announced_at: float = Field(default=0.0, ge=0)  # DHT time of the announcement: newest record wins
    public_name: str = Field(default="", max_length=128)
    version: str = Field(default="", max_length=64)
    memory_bytes: int = Field(ge=0)  # M_j: the whole budget, blocks included
    block_bytes: int = Field(ge=0)  # s_m
    cache_token_bytes: int = Field(ge=0)  # cache bytes per token per block per sequence (s_c / tokens)
    cache_bytes_left: int = Field(ge=0)  # what new sessions may still reserve
    cache_slots_left: int = Field(ge=0)  # (session, block) caches of `slot_tokens` tokens that still fit
    slot_tokens: int = Field(gt=0)  # the session length `cache_slots_left` is counted for
    max_length: int = Field(gt=0)  # longest session the server accepts
    tau: float | None = Field(default=None, ge=0)  # per-block per-token decode seconds
    tau_prefill: float | None = Field(default=None, ge=0)  # per-block prefill seconds for `prefill_tokens`
    prefill_tokens: int = Field(default=0, ge=0)
    throughput: float | None = Field(default=None, ge=0)  # tokens/s through the whole span
    active_sessions: int = Field(default=0, ge=0)

    @model_validator(mode="after")
    def _span_is_ordered(self) -> ServerInfo:
        if (self.start is None) != (self.end is None):
            raise ValueError("start and end are both set or both absent")
        if self.start is not None and self.end <= self.start:
            raise ValueError("end must be greater than start")
        return self

    @property
    def has_blocks(self) -> bool:
        return self.start is not None

    @property
    def num_blocks(self) -> int:
        return self.end - self.start if self.start is not None else 0

    def cache_bytes_for(self, num_blocks: int, max_length: int, batch_size: int) -> int:
        """Cache bytes a session of `batch_size` x `max_length` tokens reserves on `num_blocks` blocks."""
        return self.cache_token_bytes * num_blocks * max_length * batch_size

    def to_wire(self) -> dict:
        return self.model_dump(mode="json")

    @classmethod
    def from_wire(cls, value: object) -> ServerInfo | None:
        """Parse a DHT value; None if it is not a valid record of a schema we understand."""
        if not isinstance(value, dict) or value.get("schema_version") != SCHEMA_VERSION:
            return None
        try:
            return cls.model_validate(value)
        except ValidationError:
            return None
