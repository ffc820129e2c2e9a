"""The swarm's blocks as a module, like PETALS' `model.transformer.h`: slicing, autograd, sessions.

`RemoteSequential(connection)[2:5]` is blocks 2..4 wherever the swarm holds them. Calling it runs
whole sequences through the forward RPC (differentiable: `backward()` calls the servers' backward
RPC); `inference_session(max_length)` opens a session over just those blocks whose `step(hidden)`
takes any number of new tokens (zero included) and keeps the servers' caches between steps.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from llm_swarm.client.connection import SwarmConnection
from llm_swarm.client.remote import RemoteBlockSession
from llm_swarm.client.sequence_rpc import SequenceFunction
from llm_swarm.swarm.errors import SwarmUserError


class RemoteSequential(nn.Module):
    """Blocks `[start, end)` of the swarm's model (all of them by default)."""

    def __init__(self, connection: SwarmConnection, start: int = 0, end: int | None = None):
        super().__init__()
        end = connection.num_blocks if end is None else end
        if not 0 <= start < end <= connection.num_blocks:
            raise SwarmUserError(
                f"blocks {start}:{end} are not a non-empty range of 0:{connection.num_blocks}"
            )
        self.connection, self.start, self.end = connection, start, end

    def __len__(self) -> int:
        return self.end - self.start

    def __getitem__(self, index: int | slice) -> RemoteSequential:
        if isinstance(index, slice):
            first, last, stride = index.indices(len(self))
            if stride != 1:
                raise SwarmUserError("remote blocks can be sliced only with step 1 (they run in order)")
            return RemoteSequential(self.connection, self.start + first, self.start + last)
        if not -len(self) <= index < len(self):
            raise IndexError(f"block {index} is outside these {len(self)} blocks")
        block = self.start + index % len(self)
        return RemoteSequential(self.connection, block, block + 1)

    def __iter__(self) -> Iterator[RemoteSequential]:
        return (self[index] for index in range(len(self)))

    def forward(
        self,
        hidden: torch.Tensor,
        prompts: torch.Tensor | None = None,
        padding_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The blocks' output for whole sequences `[batch, tokens, hidden]`; `prompts` (deep prompt
        tuning): `[len(self), batch or 1, prefix, hidden]`, added to each block's first positions;
        `padding_mask`: `[batch, tokens]`, 1 = real token (left padding)."""
        if hidden.ndim != 3 or hidden.shape[1] == 0:
            raise SwarmUserError(
                f"hidden states must be [batch, tokens > 0, hidden], got {tuple(hidden.shape)}"
            )
        if prompts is not None and (prompts.ndim != 4 or prompts.shape[0] != len(self)):
            raise SwarmUserError(
                f"prompts must be [{len(self)}, batch or 1, prefix, hidden], got {tuple(prompts.shape)}"
            )
        return SequenceFunction.apply(hidden, prompts, padding_mask, self.connection, self.start, self.end)

    @contextlib.contextmanager
    def inference_session(self, max_length: int, batch_size: int = 1) -> Iterator[SpanSession]:
        session = SpanSession(
            RemoteBlockSession(self.connection, batch_size, max_length, self.start, self.end)
        )
        try:
            yield session
        finally:
            session.close()

    def extra_repr(self) -> str:
        return f"blocks {self.start}:{self.end} of {self.connection.prefix}"


class SpanSession:
    """Steps through some blocks with the servers' caches kept: each call continues the sequences."""

    def __init__(self, blocks: RemoteBlockSession):
        self.blocks, self.position = blocks, 0

    @torch.inference_mode()
    def step(self, hidden: torch.Tensor, prompts: torch.Tensor | None = None) -> torch.Tensor:
        """The blocks' output for `hidden` (`[batch, new tokens, hidden]`, any number of new tokens)."""
        if hidden.ndim != 3:
            raise SwarmUserError(f"hidden states must be [batch, tokens, hidden], got {tuple(hidden.shape)}")
        if hidden.shape[1] == 0:
            return hidden  # nothing new: nothing to ask the servers
        if self.position + hidden.shape[1] > self.blocks.shape.max_length:
            raise SwarmUserError(
                f"the session's max_length {self.blocks.shape.max_length} is exceeded: {self.position} "
                f"positions done, {hidden.shape[1]} more requested"
            )
        output = self.blocks.step(hidden, self.position, None, prompts=prompts)
        self.position += hidden.shape[1]
        return output

    def close(self) -> None:
        self.blocks.close()

    def __enter__(self) -> SpanSession:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
