"""A cache push that a following hand-off started, waiting for the step that computes its positions."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from llm_swarm.swarm.handoff_wire import HandOff
from llm_swarm.swarm.wire import ProtocolError


@dataclass(frozen=True)
class FollowingPush:
    """A push started by a following hand-off, waiting for the step that computes its positions."""

    order: HandOff
    task: asyncio.Task | None  # None: refused (`refusal`), answered after the step
    refusal: ProtocolError | None = None
