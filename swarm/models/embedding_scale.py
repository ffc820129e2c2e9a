"""Multiplies hidden states by a constant in their own dtype: Gemma 2's embedding normalizer under
transformers 4.57, which the model applies to token embeddings and to given `inputs_embeds` alike (so
it follows the table, as BLOOM's embedding norm does; 5.x scales inside the embedding module)."""

from __future__ import annotations

import torch
from torch import nn


class EmbeddingScale(nn.Module):
    def __init__(self, scale: float):
        super().__init__()
        self.scale = scale

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden * torch.tensor(self.scale, dtype=hidden.dtype)

    def extra_repr(self) -> str:
        return f"scale={self.scale}"
