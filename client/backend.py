"""What the client model needs from whatever runs the transformer blocks.

The client keeps embeddings and the LM head; a *backend* turns the first block's input into the
last block's output for a session. `LocalSpans` runs spans in this process (checks and the
single-machine demo); the swarm backend runs a chain of remote servers. Both implement the two
abstract classes here: `BlockBackend` and the `BlockSession`s it opens.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass

import torch

from llm_swarm.client.session_request import SessionRequest


@dataclass(frozen=True)
class SessionStep:
    """The arguments of one `BlockSession.step` call (see there)."""

    hidden: torch.Tensor
    position: int
    padding_mask: torch.Tensor | None
    hypo_ids: torch.Tensor | None = None
    prompts: torch.Tensor | None = None


class BlockSession(abc.ABC):
    """A stateful run of all blocks for one batch of sequences, holding attention caches somewhere.

    Implementations define `run_step` (and `close`); callers use `step`."""

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
        return self.run_step(SessionStep(hidden, position, padding_mask, hypo_ids, prompts))

    @abc.abstractmethod
    def run_step(self, step: SessionStep) -> torch.Tensor:
        """`step` through every block of the session: the last block's output."""

    @abc.abstractmethod
    def rewind(self, position: int) -> None:
        """Continue from `position` (at most what was processed): the next step starts there and
        overwrites what the caches hold at `>= position`. Nothing runs until that step."""

    @abc.abstractmethod
    def close(self) -> None:
        """End the session: its caches are freed."""


class BlockBackend(abc.ABC):
    """Runs every block: in sessions (`open_session`) or on whole sequences (`forward_sequence`).

    Implementations define `start_session` and `forward_sequence`."""

    def open_session(
        self,
        batch_size: int,
        max_length: int,
        prompt_tokens: int | None = None,
        expected_new_tokens: int | None = None,
    ) -> BlockSession:
        """A session for `batch_size` sequences of up to `max_length` positions; `prompt_tokens` and
        `expected_new_tokens`, when known, are how many of them the first step brings and how many
        will be generated (routing weighs prefill against decoding with them)."""
        return self.start_session(SessionRequest(batch_size, max_length, prompt_tokens, expected_new_tokens))

    @abc.abstractmethod
    def start_session(self, request: SessionRequest) -> BlockSession:
        """What `open_session` returns for these arguments."""

    @abc.abstractmethod
    def forward_sequence(
        self, hidden: torch.Tensor, padding_mask: torch.Tensor | None, prompts: torch.Tensor | None
    ) -> torch.Tensor:
        """Every block on whole sequences, no cache, differentiable in `hidden` and `prompts`."""


def _span_prompts(prompts: torch.Tensor | None, span) -> torch.Tensor | None:
    """The deep prompts of `span`'s blocks, out of prompts for every block (None: no prompts)."""
    return prompts[span.start : span.end] if prompts is not None else None


class LocalSpans(BlockBackend):
    """Consecutive in-process spans that together cover every block."""

    def __init__(self, spans: list):
        ends = [0] + [span.end for span in spans]
        if [span.start for span in spans] != ends[:-1]:
            raise ValueError("local spans must be consecutive and start at block 0")
        self.spans = spans

    def start_session(self, request: SessionRequest) -> _LocalSession:
        caches = [span.new_cache(request.batch_size, request.max_length) for span in self.spans]
        return _LocalSession(caches, self.spans)

    def forward_sequence(
        self, hidden: torch.Tensor, padding_mask: torch.Tensor | None, prompts: torch.Tensor | None
    ) -> torch.Tensor:
        for span in self.spans:
            hidden = span.forward_sequence(
                hidden, span.start, span.end, padding_mask, _span_prompts(prompts, span)
            )
        return hidden


class _LocalSession(BlockSession):
    def __init__(self, caches: list, spans: list):
        self.caches, self.spans = caches, spans

    def run_step(self, step: SessionStep) -> torch.Tensor:
        hidden = step.hidden
        for span, cache in zip(self.spans, self.caches, strict=True):
            if step.hypo_ids is not None:
                cache.reorder(step.hypo_ids)
            hidden = span(hidden, cache, step.position, step.padding_mask, _span_prompts(step.prompts, span))
        return hidden

    def rewind(self, position: int) -> None:
        """Nothing to do here: a step at `position` overwrites the caches from there (`SpanCache`)."""

    def close(self) -> None:
        self.caches = []
