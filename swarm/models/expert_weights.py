"""A block's mixture-of-experts tensors, from the checkpoint's names to the module's own layout.

Checkpoints keep one tensor per expert and projection (Mixtral: `block_sparse_moe.experts.{e}.w1`,
`w2`, `w3`). transformers 4.57 builds one `nn.Linear` per expert with those names; transformers 5
builds fused 3-D parameters (`mlp.experts.gate_up_proj`: `[experts, 2 * intermediate, hidden]`,
gate rows then up rows; `mlp.experts.down_proj`: `[experts, hidden, intermediate]`) and converts the
checkpoint's names as it loads (its `conversion_mapping`). A span never runs `from_pretrained`, so it
converts a block's tensors itself, following whichever layout the installed library's block has, and
takes tensors that are already fused (a checkpoint saved in that layout) as they are.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn

from llm_swarm.swarm.errors import CheckpointError


@dataclass(frozen=True)
class ExpertNames:
    """Where a family's checkpoints keep their experts, and what the fused module calls them."""

    checkpoint_prefix: str  # e.g. "block_sparse_moe.": the MoE layer's name in checkpoints
    module_prefix: str  # e.g. "mlp.": its name in a fused (transformers 5) block
    gate: str  # per-expert projection names inside "experts.{e}.": gate, up and down
    up: str
    down: str

    def fuse(self, tensors: dict[str, torch.Tensor], parameter_names: set[str]) -> dict[str, torch.Tensor]:
        """`tensors` (a block's, by block-local name) in the layout of a block whose parameters are
        `parameter_names`: unchanged when the block keeps one linear layer per expert, else renamed
        to the fused module and each projection's experts stacked."""
        fused_gate_up = f"{self.module_prefix}experts.gate_up_proj"
        if fused_gate_up not in parameter_names:
            return tensors
        per_expert = re.compile(
            rf"{re.escape(self.checkpoint_prefix)}experts\.(\d+)\.({self.gate}|{self.up}|{self.down})\.weight"
        )
        by_projection: dict[str, dict[int, torch.Tensor]] = {self.gate: {}, self.up: {}, self.down: {}}
        converted: dict[str, torch.Tensor] = {}
        for name, tensor in tensors.items():
            match = per_expert.fullmatch(name)
            if match:
                by_projection[match.group(2)][int(match.group(1))] = tensor
            elif name.startswith(self.checkpoint_prefix):
                converted[self.module_prefix + name[len(self.checkpoint_prefix) :]] = tensor
            else:
                converted[name] = tensor
        if not any(by_projection.values()):
            return converted  # already fused in the checkpoint
        gates, ups, downs = (
            _stacked(by_projection[projection], projection) for projection in (self.gate, self.up, self.down)
        )
        if not len(gates) == len(ups) == len(downs):
            raise CheckpointError(
                f"the checkpoint's experts disagree in number: {len(gates)} {self.gate}, "
                f"{len(ups)} {self.up}, {len(downs)} {self.down}"
            )
        converted[fused_gate_up] = torch.cat([gates, ups], dim=1)
        converted[f"{self.module_prefix}experts.down_proj"] = downs
        return converted


def _stacked(experts: dict[int, torch.Tensor], projection: str) -> torch.Tensor:
    """One projection's per-expert matrices as `[experts, out, in]`, refusing a gap in the numbering."""
    if sorted(experts) != list(range(len(experts))):
        raise CheckpointError(
            f"the checkpoint's {projection} experts are not numbered 0..n-1: {sorted(experts)}"
        )
    return torch.stack([experts[index] for index in range(len(experts))])


def is_fused_experts(module: nn.Module) -> bool:
    """Whether `module` keeps its experts as 3-D `gate_up_proj` and `down_proj` parameters."""
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    return isinstance(gate_up, nn.Parameter) and isinstance(down, nn.Parameter) and gate_up.ndim == 3
