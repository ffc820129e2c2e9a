"""The BLOOM family: ALiBi position biases, fused QKV, tied LM head."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.models.bloom.modeling_bloom import BloomBlock, build_alibi_tensor

from llm_swarm.swarm.models.family import ModelFamily, StepInputs, StepTokens, register_family
from llm_swarm.swarm.models.inplace_attention import use_inplace_bloom_attention


class BloomFamily(ModelFamily):
    model_types = ("bloom",)
    base_prefixes = (
        "transformer.",
        "",
    )  # BloomForCausalLM saves "transformer.h.0..."; bigscience/bloom "h.0..."
    embedding_weight = "embed.0.weight"
    blocks_attribute = "h."

    def build_block(self, config: PretrainedConfig, index: int) -> nn.Module:
        block = BloomBlock(config, layer_idx=index)
        use_inplace_bloom_attention(block.self_attention)  # batched decode reads caches in place
        return block

    def position_inputs(
        self, config: PretrainedConfig, helpers: nn.ModuleDict, step: StepTokens
    ) -> StepInputs:
        """ALiBi biases over the step's keys, from the padding mask (every key real without one)."""
        hidden, total = step.hidden, step.position + step.hidden.shape[1]
        key_mask = step.padding_mask
        if key_mask is None:
            key_mask = torch.ones(hidden.shape[0], total, device=hidden.device)
        return {"alibi": build_alibi_tensor(key_mask[:, :total], self.num_heads(config), hidden.dtype)}

    def run_block(
        self, block: nn.Module, hidden: torch.Tensor, cache: Any, inputs: StepInputs
    ) -> torch.Tensor:
        output, _attention = block(
            hidden,
            alibi=inputs["alibi"],
            attention_mask=inputs["attention_mask"],
            layer_past=cache,
            use_cache=True,
        )
        return output

    def build_client_modules(self, config: PretrainedConfig) -> nn.ModuleDict:
        hidden, eps = config.hidden_size, config.layer_norm_epsilon
        return nn.ModuleDict(
            {
                "embed": nn.Sequential(
                    nn.Embedding(config.vocab_size, hidden), nn.LayerNorm(hidden, eps=eps)
                ),
                "norm": nn.LayerNorm(hidden, eps=eps),
                "lm_head": nn.Linear(hidden, config.vocab_size, bias=False),
            }
        )

    def client_tensor_names(self, base_prefix: str) -> dict[str, str]:
        return {
            f"{base_prefix}word_embeddings.weight": "embed.0.weight",
            f"{base_prefix}word_embeddings_layernorm.weight": "embed.1.weight",
            f"{base_prefix}word_embeddings_layernorm.bias": "embed.1.bias",
            f"{base_prefix}ln_f.weight": "norm.weight",
            f"{base_prefix}ln_f.bias": "norm.bias",
            "lm_head.weight": "lm_head.weight",
        }


BLOOM = register_family(BloomFamily())
