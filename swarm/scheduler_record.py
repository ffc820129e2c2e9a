"""What a scheduler announces in the DHT: its gRPC address and placement, versioned and validated.

Readers use a scheduler only when its record is signed by a key they were given (`swarm.identity`);
this schema bounds what even that record may hold, so a broken or hostile one cannot blow up a
reader's memory or hand it an unusable address.
"""

from __future__ import annotations

from pydantic import Field, field_validator

from llm_swarm.swarm.versioned_record import VersionedRecord

SCHEDULER_RECORD_VERSION = 1
MAX_PLACEMENT_ENTRIES = 100_000
_PEER_ID_CHARS = frozenset("123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz")


class SchedulerRecord(VersionedRecord):
    current_schema_version = SCHEDULER_RECORD_VERSION

    schema_version: int
    address: str = Field(min_length=3, max_length=256, pattern=r"^[A-Za-z0-9.\-\[\]:_]+:[0-9]{1,5}$")
    status_url: str = Field(default="", max_length=512)
    policy: str = Field(default="", max_length=32)
    epoch: int = Field(default=0, ge=0, le=1 << 62)
    num_requests: int = Field(default=0, ge=0, le=1 << 31)
    placement: dict[str, tuple[int, int] | None] = Field(default_factory=dict)

    @field_validator("placement")
    @classmethod
    def _bounded_placement(cls, placement: dict) -> dict:
        if len(placement) > MAX_PLACEMENT_ENTRIES:
            raise ValueError(f"more than {MAX_PLACEMENT_ENTRIES} placement entries")
        for peer, span in placement.items():
            if not 1 <= len(peer) <= 128 or not set(peer) <= _PEER_ID_CHARS:
                raise ValueError("placement keys must be base58 peer ids")
            if span is not None and not 0 <= span[0] < span[1] <= 1 << 16:
                raise ValueError("placement spans must be ordered block ranges")
        return placement
