"""One client's inference session on this server: its cache, reservation and step bookkeeping."""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from llm_swarm.server.cache_progress import CacheProgress
from llm_swarm.server.step_pusher import StepPusher
from llm_swarm.swarm.models.cache import SpanCache
from llm_swarm.swarm.tensor_wire import all_finite
from llm_swarm.swarm.wire import ErrorCode, ProtocolError

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
ANSWERED_STEPS = 256  # step ids a session remembers having run: a later copy of one is not run again
INBOX_STEPS = 4  # pushed steps a session holds before it runs them (more are dropped)


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
    adapter: str | None = None  # the LoRA adapter every step of the session uses
    cache_token: str | None = None  # a hand-off may fill this session: the client's secret for it
    cache_from: str | None = None  # ... from this peer only
    receiving: bool = False  # a pushed cache is being written (steps wait for the client's go-ahead)
    progress: CacheProgress | None = None  # a push follows its prompt (`HandOff.follow`)
    last_step_id: str | None = None
    last_position: int = -1
    last_output: torch.Tensor | None = None
    last_active: float = field(default_factory=time.monotonic)
    prompt_tokens: int | None = None  # its step at position 0 (`server.session_lengths`), if seen
    # chain sessions (swarm.chain_wire): who may push steps here and with what token, what they pushed,
    # where this session pushes its own outputs, and which step ids ran (True: from a push)
    push_token: str = ""
    push_from: str = ""
    linked: asyncio.Event = field(default_factory=asyncio.Event)  # the client's first `ChainLink` came
    inbox: asyncio.Queue = field(default_factory=lambda: asyncio.Queue(INBOX_STEPS))
    pusher: StepPusher | None = None
    answered: OrderedDict[str, bool] = field(default_factory=OrderedDict)
    step_frames: bool = False  # the client sends steps as frames (swarm.step_frame): it reads them too

    def replayed_output(self, step_id: str, position: int) -> torch.Tensor | None:
        """The answer to a step that was already computed (a retry of the same step id), if any."""
        if step_id == self.last_step_id and position == self.last_position:
            return self.last_output
        return None

    def record(self, step_id: str, position: int, output: torch.Tensor, pushed: bool = False) -> None:
        self.last_step_id, self.last_position, self.last_output = step_id, position, output
        self.last_active = time.monotonic()
        self.answered[step_id] = pushed
        while len(self.answered) > ANSWERED_STEPS:
            self.answered.popitem(last=False)


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
    session: Session,
    hidden_size: int,
    position: int,
    tensors: list[torch.Tensor],
    with_prompts: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Validate a step's tensors against the session; returns (hidden, padding_mask, prompts), the
    last two None when absent."""
    prompts = None
    if with_prompts:
        if not tensors:
            raise ProtocolError(ErrorCode.BAD_REQUEST, "a step with prompts carries them as its last tensor")
        *tensors, prompts = tensors
    if not 1 <= len(tensors) <= 2:
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"a step carries 1 or 2 tensors, got {len(tensors)}")
    hidden = check_hidden(tensors[0], hidden_size, "hidden states")
    batch, num_new, _width = hidden.shape
    if batch != session.batch_size:
        raise ProtocolError(
            ErrorCode.BAD_REQUEST, f"batch size {batch} differs from the session's {session.batch_size}"
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
    refused = session.cache.rewind_error(position)
    if refused is not None:  # nothing wrong with the request: this session cannot go back that far
        raise ProtocolError(ErrorCode.SESSION_EXPIRED, refused)
    padding_mask = check_padding_mask(tensors[1], batch, position + num_new) if len(tensors) == 2 else None
    if prompts is not None:
        prompts = check_prompts(prompts, session.end - session.start, batch, hidden_size, session.max_length)
    return hidden, padding_mask, prompts


def check_hidden(hidden: torch.Tensor, hidden_size: int, what: str) -> torch.Tensor:
    """A finite float `[batch, tokens, hidden_size]` tensor."""
    if hidden.dtype not in FLOAT_DTYPES:
        raise ProtocolError(
            ErrorCode.BAD_REQUEST, f"{what} must be float32/bfloat16/float16, got {hidden.dtype}"
        )
    if hidden.ndim != 3:
        raise ProtocolError(
            ErrorCode.BAD_REQUEST, f"{what} must be [batch, tokens, hidden], got shape {tuple(hidden.shape)}"
        )
    if hidden.shape[2] != hidden_size:
        raise ProtocolError(
            ErrorCode.BAD_REQUEST, f"hidden size {hidden.shape[2]} differs from the model's {hidden_size}"
        )
    if not all_finite(hidden):
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"{what} contain NaN or infinity")
    return hidden


def check_padding_mask(padding_mask: torch.Tensor, batch: int, length: int) -> torch.Tensor:
    if tuple(padding_mask.shape) != (batch, length):
        raise ProtocolError(
            ErrorCode.BAD_REQUEST,
            f"padding mask must have shape {(batch, length)}, got {tuple(padding_mask.shape)}",
        )
    if not bool(((padding_mask == 0) | (padding_mask == 1)).all()):
        raise ProtocolError(ErrorCode.BAD_REQUEST, "padding mask values must be 0 or 1")
    return padding_mask


def check_prompts(
    prompts: torch.Tensor, num_blocks: int, batch: int, hidden_size: int, max_length: int
) -> torch.Tensor:
    """Deep prompts: `[num_blocks, batch or 1, prefix, hidden_size]`, finite, prefix <= max_length."""
    if prompts.dtype not in FLOAT_DTYPES or prompts.ndim != 4:
        raise ProtocolError(
            ErrorCode.BAD_REQUEST,
            f"prompts must be a float [blocks, batch, prefix, hidden] tensor, got {prompts.dtype} "
            f"{tuple(prompts.shape)}",
        )
    blocks, prompt_batch, prefix, width = prompts.shape
    if blocks != num_blocks or prompt_batch not in (1, batch) or width != hidden_size:
        raise ProtocolError(
            ErrorCode.BAD_REQUEST,
            f"prompts of shape {tuple(prompts.shape)} do not fit {num_blocks} blocks, batch {batch} and "
            f"hidden size {hidden_size}",
        )
    if not 1 <= prefix <= max_length:
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"a prompt of {prefix} positions exceeds {max_length}")
    if not all_finite(prompts):
        raise ProtocolError(ErrorCode.BAD_REQUEST, "prompts contain NaN or infinity")
    return prompts
