"""The client side of families whose final norm is a LayerNorm named `ln_f` (BLOOM, Falcon)."""

from __future__ import annotations

from torch import nn
from transformers import PretrainedConfig


def layer_norm_client_modules(config: PretrainedConfig, embed: nn.Module) -> nn.ModuleDict:
    """`build_client_modules` of a family whose final norm is a LayerNorm (`layer_norm_epsilon`)
    with an untied-by-name `lm_head`, as BLOOM and Falcon have; `embed` is the family's own."""
    hidden = config.hidden_size
    return nn.ModuleDict(
        {
            "embed": embed,
            "norm": nn.LayerNorm(hidden, eps=config.layer_norm_epsilon),
            "lm_head": nn.Linear(hidden, config.vocab_size, bias=False),
        }
    )


def layer_norm_head_names(base_prefix: str) -> dict[str, str]:
    """The checkpoint names of `layer_norm_client_modules`' `norm` (`ln_f`) and `lm_head`."""
    return {
        f"{base_prefix}ln_f.weight": "norm.weight",
        f"{base_prefix}ln_f.bias": "norm.bias",
        "lm_head.weight": "lm_head.weight",
    }
