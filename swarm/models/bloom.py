"""The BLOOM family: ALiBi position biases, fused QKV, tied LM head."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.models.bloom.modeling_bloom import BloomBlock, build_alibi_tensor

from llm_swarm.swarm.models.family import ModelFamily, StepInputs, StepTokens, register_family
from llm_swarm.swarm.models.inplace_attention import use_inplace_bloom_attention
from llm_swarm.swarm.models.layer_norm_head import layer_norm_client_modules, layer_norm_head_names


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
        hidden = config.hidden_size
        # BLOOM normalizes the word embeddings before the first block
        embed = nn.Sequential(
            nn.Embedding(config.vocab_size, hidden), nn.LayerNorm(hidden, eps=config.layer_norm_epsilon)
        )
        return layer_norm_client_modules(config, embed)

    def client_tensor_names(self, base_prefix: str) -> dict[str, str]:
        return {
            f"{base_prefix}word_embeddings.weight": "embed.0.weight",
            f"{base_prefix}word_embeddings_layernorm.weight": "embed.1.weight",
            f"{base_prefix}word_embeddings_layernorm.bias": "embed.1.bias",
            **layer_norm_head_names(base_prefix),
        }


BLOOM = register_family(BloomFamily())
