"""What the client model needs from whatever runs the transformer blocks.

The client keeps embeddings and the LM head; a *backend* turns the first block's input into the
last block's output for a session. `LocalSpans` runs spans in this process (checks and the
single-machine demo); the swarm backend runs a chain of remote servers. Both speak this protocol.
"""

from __future__ import annotations

from typing import Protocol

import torch


class BlockSession(Protocol):
    """A stateful run of all blocks for one batch of sequences, holding attention caches somewhere."""

    def step(
        self,
        hidden: torch.Tensor,
        position: int,
        padding_mask: torch.Tensor | None,
        hypo_ids: torch.Tensor | None = None,
        prompts: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run `hidden` (`[batch, new, hidden]`) at absolute `position`; returns the last block's output.
        `hypo_ids` (beam search): first, sequence i continues what sequence hypo_ids[i] held.
        `prompts` (deep prompt tuning, `[blocks, batch or 1, prefix, hidden]`): added to each block's
        input at positions below `prefix`."""
        ...

    def close(self) -> None: ...


class BlockBackend(Protocol):
    def open_session(self, batch_size: int, max_length: int) -> BlockSession: ...

    def forward_sequence(
        self,
        hidden: torch.Tensor,
        padding_mask: torch.Tensor | None = None,
        prompts: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Every block on whole sequences, no cache, differentiable in `hidden` and `prompts`."""
        ...


class LocalSpans:
    """Consecutive in-process spans that together cover every block."""

    def __init__(self, spans: list):
        ends = [0] + [span.end for span in spans]
        if [span.start for span in spans] != ends[:-1]:
            raise ValueError("local spans must be consecutive and start at block 0")
        self.spans = spans

    def open_session(self, batch_size: int, max_length: int) -> _LocalSession:
        return _LocalSession([span.new_cache(batch_size, max_length) for span in self.spans], self.spans)

    def forward_sequence(
        self,
        hidden: torch.Tensor,
        padding_mask: torch.Tensor | None = None,
        prompts: torch.Tensor | None = None,
    ) -> torch.Tensor:
        for span in self.spans:
            span_prompts = prompts[span.start : span.end] if prompts is not None else None
            hidden = span.forward_sequence(hidden, span.start, span.end, padding_mask, span_prompts)
        return hidden


class _LocalSession:
    def __init__(self, caches: list, spans: list):
        self.caches, self.spans = caches, spans

    def step(
        self,
        hidden: torch.Tensor,
        position: int,
        padding_mask: torch.Tensor | None,
        hypo_ids: torch.Tensor | None = None,
        prompts: torch.Tensor | None = None,
    ) -> torch.Tensor:
        for span, cache in zip(self.spans, self.caches, strict=True):
            if hypo_ids is not None:
                cache.reorder(hypo_ids)
            span_prompts = prompts[span.start : span.end] if prompts is not None else None
            hidden = span(hidden, cache, position, padding_mask, span_prompts)
        return hidden

    def close(self) -> None:
        self.caches = []
