"""Validation of a `Replay` message: recorded steps of one session, to be run in their order.

Pure (no I/O): the handler decodes the tensors and calls `parse_replay`, which checks every step the
way a single step is checked (position within what is processed so far, room in the session, finite
hidden states of the right width, masks of zeros and ones, reorderings within the batch) and returns
the steps ready to run. Anything wrong is a `ProtocolError` naming the step and the problem.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llm_swarm.server.session import Session, check_hidden
from llm_swarm.swarm.wire import ErrorCode, ProtocolError, Replay

# a replay carries at most this many positions (summed over its steps) per session position: a
# client with a longer history (speculative rewinds overlap steps) sends it in several replays
MAX_TOKENS_PER_POSITION = 2
MAX_STEPS = 8192


@dataclass(frozen=True)
class ReplayedStep:
    hidden: torch.Tensor  # [batch, tokens, hidden]
    position: int
    padding_mask: torch.Tensor | None  # [batch, position + tokens], or None without padding
    hypo_ids: torch.Tensor | None  # reorder the session's sequences before this step


def _fail(text: str) -> ProtocolError:
    return ProtocolError(ErrorCode.BAD_REQUEST, text)


def _binary_mask(mask: torch.Tensor, shape: tuple[int, int], what: str) -> torch.Tensor:
    if mask.dtype not in (torch.bool, torch.uint8, torch.int64) or tuple(mask.shape) != shape:
        raise _fail(f"{what} must be a bool [batch, positions] tensor of shape {shape}, got {mask.dtype} "
                    f"{tuple(mask.shape)}")  # fmt: skip
    if not bool(((mask == 0) | (mask == 1)).all()):
        raise _fail(f"{what} values must be 0 or 1")
    return mask.long()


def parse_replay(message: Replay, tensors: list[torch.Tensor], session: Session, hidden_size: int):
    """The steps of `message` (with its decoded `tensors`) for `session`, checked; see the module."""
    expected = 2 + 2 * message.masked + message.reordered
    if len(tensors) != expected:
        raise _fail(f"this replay carries {expected} tensors, got {len(tensors)}")
    layout, hidden = tensors[0], check_hidden(tensors[1], hidden_size, "replayed hidden states")
    if layout.dtype != torch.int64 or layout.ndim != 2 or layout.shape[1] != 4:
        raise _fail(f"the replay layout must be int64 [steps, 4], got {layout.dtype} {tuple(layout.shape)}")
    steps = layout.shape[0]
    batch, total, _ = hidden.shape
    if not 1 <= steps <= MAX_STEPS:
        raise _fail(f"a replay holds 1 to {MAX_STEPS} steps, got {steps}")
    if batch != session.batch_size:
        raise _fail(f"batch size {batch} differs from the session's {session.batch_size}")
    if total > MAX_TOKENS_PER_POSITION * session.max_length:
        raise _fail(
            f"a replay of {total} tokens exceeds {MAX_TOKENS_PER_POSITION} x the session's max_length "
            f"{session.max_length}: send the history in several replays"
        )
    positions, counts, reorders, masked = (layout[:, column].tolist() for column in range(4))
    if min(counts) < 1 or sum(counts) != total:
        raise _fail(f"the replay's steps must hold at least one token each and {total} in all")
    if any(flag not in (0, 1) for flag in reorders) or (sum(reorders) > 0) != message.reordered:
        raise _fail("the replay layout's reorder flags must be 0 or 1, and set exactly when `reordered`")
    if any(flag not in (0, 1) for flag in masked) or (sum(masked) > 0) != message.masked:
        raise _fail("the replay layout's mask flags must be 0 or 1, and set exactly when `masked`")
    new_masks = session_mask = None
    if message.masked:
        new_masks = _binary_mask(tensors[2], (batch, total), "the replayed steps' mask")
        width = tensors[3].shape[-1] if tensors[3].ndim == 2 else -1
        session_mask = _binary_mask(tensors[3], (batch, width), "the replay's session mask")
    hypo_ids = None
    if message.reordered:
        hypo_ids = tensors[-1]
        if hypo_ids.dtype != torch.int64 or tuple(hypo_ids.shape) != (sum(reorders), batch):
            raise _fail(f"hypo_ids must be int64 [{sum(reorders)}, {batch}], got {tuple(hypo_ids.shape)}")
        if not bool(((hypo_ids >= 0) & (hypo_ids < batch)).all()):
            raise _fail(f"hypo_ids must be sequence indices in [0, {batch})")
    length, offset, reordering, parsed = session.cache.length, 0, 0, []
    written = session.cache.written
    for index, (position, count, reorders_first, has_mask) in enumerate(
        zip(positions, counts, reorders, masked, strict=True)
    ):
        if not 0 <= position <= length:
            raise _fail(
                f"replayed step {index} at position {position} is out of order: {length} positions are "
                "processed before it"
            )
        if position + count > session.max_length:
            raise _fail(
                f"replayed step {index} reaches position {position + count}, past the session's "
                f"max_length {session.max_length}"
            )
        refused = session.cache.rewind_error(position, written)
        if refused is not None:
            raise _fail(f"replayed step {index}: {refused}")
        written = max(written, position + count)
        mask = None
        if has_mask:
            if session_mask.shape[1] < position:
                raise _fail(f"the replay's session mask is shorter than step {index}'s position {position}")
            mask = torch.cat([session_mask[:, :position], new_masks[:, offset : offset + count]], dim=1)
        hypo = None
        if reorders_first:
            hypo, reordering = hypo_ids[reordering], reordering + 1
        parsed.append(ReplayedStep(hidden[:, offset : offset + count], position, mask, hypo))
        length, offset = position + count, offset + count
    return parsed
