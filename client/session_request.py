"""What a session is opened for, as backends receive it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SessionRequest:
    """The arguments of one `BlockBackend.open_session` call (see there)."""

    batch_size: int
    max_length: int
    prompt_tokens: int | None = None
    expected_new_tokens: int | None = None
