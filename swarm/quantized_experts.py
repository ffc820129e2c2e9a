"""A mixture of experts stored as 3-D parameters (transformers 5), served with quantized weights.

transformers 5 keeps a MoE layer's experts fused: `gate_up_proj` (`[experts, 2 * intermediate,
hidden]`, gate rows then up rows) and `down_proj` (`[experts, hidden, intermediate]`), multiplied
with `F.linear` per expert. bitsandbytes quantizes linear layers, not 3-D parameters, and the experts
are nearly all of such a model's weights, so a quantized span replaces the fused module with one
quantized linear layer per expert and projection, and computes what the fused module's own
(eager) forward computes: each token's chosen experts, weighted by the router, summed.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


class QuantizedExperts(nn.Module):
    """Drop-in for a fused experts module: `forward(hidden [tokens, hidden], top_k_index [tokens, k],
    top_k_weights [tokens, k])`, each expert's projections a quantized linear layer made by
    `quantized_linear(weight)` from the fused module's matrices."""

    def __init__(self, fused: nn.Module, quantized_linear: Callable[[torch.Tensor], nn.Module]):
        super().__init__()
        self.num_experts = int(fused.gate_up_proj.shape[0])
        self.act_fn = fused.act_fn
        self.gate_up = nn.ModuleList(quantized_linear(matrix) for matrix in fused.gate_up_proj.data)
        self.down = nn.ModuleList(quantized_linear(matrix) for matrix in fused.down_proj.data)

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        output = torch.zeros_like(hidden_states)
        for expert in range(self.num_experts):
            tokens, slots = torch.where(top_k_index == expert)
            if tokens.numel() == 0:
                continue
            gate, up = self.gate_up[expert](hidden_states[tokens]).chunk(2, dim=-1)
            expert_output = self.down[expert](self.act_fn(gate) * up)
            expert_output = expert_output * top_k_weights[tokens, slots, None]
            output.index_add_(0, tokens, expert_output.to(output.dtype))
        return output


def fused_layout_problem(module: nn.Module) -> str | None:
    """Why `QuantizedExperts` cannot stand in for this fused module (None: it can): it knows the
    concatenated, untransposed, bias-free layout of Mixtral and the Qwen MoE families."""
    if getattr(module, "is_transposed", False):
        return "its expert weights are stored transposed"
    if not getattr(module, "is_concatenated", True):
        return "its gate and up projections are interleaved"
    # 4.57's GPT-OSS experts declare no layout flags: their bias parameters tell
    if getattr(module, "has_bias", False) or getattr(module, "gate_up_proj_bias", None) is not None:
        return "its experts have biases"
    if getattr(module, "has_post_expert_norm", False):
        return "its experts have a norm after each expert"
    return None
