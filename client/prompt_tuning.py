"""Trainable prompts, PETALS' `tuning_mode`: what a client fine-tunes while the servers' weights stay frozen.

- "ptune": `length` trainable token embeddings placed before every input (prompt tuning);
- "deep_ptune": those, plus a trainable prompt per block, added to the first `length` positions of
  that block's input (P-tuning v2). The deep prompts start at zero, so an untrained model is the
  plain model with a prefix; the servers add them (`prompts` of the forward, backward and step RPCs).
"""

from __future__ import annotations

import torch
from torch import nn

from llm_swarm.swarm.errors import SwarmUserError
from llm_swarm.swarm.models.client_parts import ClientParts

TUNING_MODES = ("ptune", "deep_ptune")


class PromptTuning(nn.Module):
    def __init__(self, length: int, hidden_size: int, num_blocks: int, deep: bool, init_std: float):
        super().__init__()
        self.length, self.hidden_size, self.num_blocks = length, hidden_size, num_blocks
        self.prompt_embeddings = nn.Embedding(length, hidden_size)
        nn.init.normal_(self.prompt_embeddings.weight, std=init_std)
        self.intermediate_prompt_embeddings = None
        if deep:
            self.intermediate_prompt_embeddings = nn.Embedding(length, num_blocks * hidden_size)
            nn.init.zeros_(self.intermediate_prompt_embeddings.weight)

    @classmethod
    def create(cls, parts: ClientParts, tuning_mode: str | None, length: int) -> PromptTuning | None:
        """The prompts for a model's client parts, or None without a tuning mode."""
        if tuning_mode is None:
            if length:
                raise SwarmUserError("pre_seq_len needs a tuning_mode ('ptune' or 'deep_ptune')")
            return None
        if tuning_mode not in TUNING_MODES:
            raise SwarmUserError(f"tuning_mode must be one of {TUNING_MODES}, got {tuning_mode!r}")
        if length < 1:
            raise SwarmUserError(f"tuning_mode {tuning_mode!r} needs pre_seq_len >= 1, got {length}")
        hidden_size = parts.family.hidden_size(parts.config)
        init_std = float(getattr(parts.config, "initializer_range", 0.02))
        prompts = cls(length, hidden_size, parts.num_blocks, tuning_mode == "deep_ptune", init_std)
        return prompts.to(parts.lm_head.weight.device)

    def prefix(self, batch_size: int) -> torch.Tensor:
        """Token embeddings `[batch, length, hidden]` that go before the input."""
        return self.prompt_embeddings.weight[None].expand(batch_size, -1, -1)

    def deep(self) -> torch.Tensor | None:
        """Per-block prompts `[blocks, 1, length, hidden]` (shared by the batch), or None for "ptune"."""
        if self.intermediate_prompt_embeddings is None:
            return None
        weight = self.intermediate_prompt_embeddings.weight.view(
            self.length, self.num_blocks, self.hidden_size
        )
        return weight.permute(1, 0, 2)[:, None]
