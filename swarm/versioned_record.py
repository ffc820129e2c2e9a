"""The base of the records peers publish in the DHT (`ServerInfo`, `SchedulerRecord`).

A record is what any peer of the DHT may have written: it is frozen, holds finite numbers only,
ignores fields it does not know (newer writers may add some), and is read only when its
`schema_version` is the one this code understands.
"""

from __future__ import annotations

from typing import ClassVar, Self

from pydantic import BaseModel, ConfigDict, ValidationError


class VersionedRecord(BaseModel):
    """Subclasses declare a `schema_version` field and set `current_schema_version`."""

    model_config = ConfigDict(extra="ignore", frozen=True, allow_inf_nan=False)

    current_schema_version: ClassVar[int]

    def to_wire(self) -> dict:
        """The record as a DHT value (JSON-compatible)."""
        return self.model_dump(mode="json")

    @classmethod
    def from_wire(cls, value: object) -> Self | None:
        """Parse a DHT value; None if it is not a valid record of a schema we understand."""
        if not isinstance(value, dict) or value.get("schema_version") != cls.current_schema_version:
            return None
        try:
            return cls.model_validate(value)
        except ValidationError:
            return None
