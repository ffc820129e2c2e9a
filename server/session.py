"""One client's inference session on this server: its cache, reservation and step bookkeeping."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from swarm.models.cache import SpanCache
from swarm.wire import ErrorCode, ProtocolError

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass
class Session:
    session_id: str
    peer: str
    start: int
    end: int
    batch_size: int
    max_length: int
    cache: SpanCache
    reserved_bytes: int
    last_step_id: str | None = None
    last_position: int = -1
    last_output: torch.Tensor | None = None
    last_active: float = field(default_factory=time.monotonic)

    def replayed_output(self, step_id: str, position: int) -> torch.Tensor | None:
        """The answer to a step that was already computed (a retry of the same step id), if any."""
        if step_id == self.last_step_id and position == self.last_position:
            return self.last_output
        return None

    def record(self, step_id: str, position: int, output: torch.Tensor) -> None:
        self.last_step_id, self.last_position, self.last_output = step_id, position, output
        self.last_active = time.monotonic()


def check_hypo_ids(session: Session, hypo_ids: list[int] | None) -> torch.Tensor | None:
    """Beam search's reordering of the session's sequences, validated (None: no reordering)."""
    if hypo_ids is None:
        return None
    if len(hypo_ids) != session.batch_size or not all(0 <= i < session.batch_size for i in hypo_ids):
        raise ProtocolError(
            ErrorCode.BAD_REQUEST,
            f"hypo_ids must hold {session.batch_size} sequence indices in [0, {session.batch_size})",
        )
    return torch.tensor(hypo_ids, dtype=torch.long)


def check_step_inputs(
    session: Session, hidden_size: int, position: int, tensors: list[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Validate a step's tensors against the session; returns (hidden, padding_mask or None)."""
    if not 1 <= len(tensors) <= 2:
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"a step carries 1 or 2 tensors, got {len(tensors)}")
    hidden = tensors[0]
    if hidden.dtype not in FLOAT_DTYPES:
        raise ProtocolError(
            ErrorCode.BAD_REQUEST, f"hidden states must be float32/bfloat16/float16, got {hidden.dtype}"
        )
    if hidden.ndim != 3:
        raise ProtocolError(
            ErrorCode.BAD_REQUEST,
            f"hidden states must be [batch, tokens, hidden], got shape {tuple(hidden.shape)}",
        )
    batch, num_new, width = hidden.shape
    if batch != session.batch_size:
        raise ProtocolError(
            ErrorCode.BAD_REQUEST, f"batch size {batch} differs from the session's {session.batch_size}"
        )
    if width != hidden_size:
        raise ProtocolError(
            ErrorCode.BAD_REQUEST, f"hidden size {width} differs from the model's {hidden_size}"
        )
    if num_new == 0:
        raise ProtocolError(ErrorCode.BAD_REQUEST, "a step must carry at least one token")
    if position > session.cache.length:
        raise ProtocolError(
            ErrorCode.BAD_REQUEST,
            f"step position {position} skips past the {session.cache.length} positions processed so far",
        )
    if position + num_new > session.max_length:
        raise ProtocolError(
            ErrorCode.BAD_REQUEST,
            f"positions up to {position + num_new} exceed the session's max_length {session.max_length}",
        )
    if not bool(torch.isfinite(hidden).all()):
        raise ProtocolError(ErrorCode.BAD_REQUEST, "hidden states contain NaN or infinity")
    padding_mask = None
    if len(tensors) == 2:
        padding_mask = tensors[1]
        if tuple(padding_mask.shape) != (batch, position + num_new):
            raise ProtocolError(
                ErrorCode.BAD_REQUEST,
                f"padding mask must have shape {(batch, position + num_new)}, "
                f"got {tuple(padding_mask.shape)}",
            )
        if not bool(((padding_mask == 0) | (padding_mask == 1)).all()):
            raise ProtocolError(ErrorCode.BAD_REQUEST, "padding mask values must be 0 or 1")
    return hidden, padding_mask
