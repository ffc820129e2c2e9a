"""The LLaMA family: rotary position embeddings, RMSNorm, grouped-query attention."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm, LlamaRotaryEmbedding

from llm_swarm.swarm.models.family import (
    ModelFamily,
    StepInputs,
    StepTokens,
    register_family,
    token_positions,
)
from llm_swarm.swarm.transformers_compat import build_rotary_embedding, layer_cache_argument


class LlamaFamily(ModelFamily):
    model_types = ("llama",)
    base_prefixes = ("model.", "")
    embedding_weight = "embed.weight"
    blocks_attribute = "layers."

    def num_kv_heads(self, config: PretrainedConfig) -> int:
        return int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)

    def head_dim(self, config: PretrainedConfig) -> int:
        return int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)

    def build_block(self, config: PretrainedConfig, index: int) -> nn.Module:
        return LlamaDecoderLayer(config, layer_idx=index)

    def make_span_helpers(self, config: PretrainedConfig, device: torch.device) -> nn.ModuleDict:
        # the rotary tables are computed from the config, not stored in checkpoints
        return nn.ModuleDict({"rotary": build_rotary_embedding(LlamaRotaryEmbedding, config, device)})

    def position_inputs(
        self, config: PretrainedConfig, helpers: nn.ModuleDict, step: StepTokens
    ) -> StepInputs:
        """Rotary embeddings of the tokens' positions (with left padding, real tokens count from 0)."""
        position_ids = token_positions(step.hidden, step.position, step.padding_mask)
        return self.positions_from_ids(helpers, step.hidden, position_ids)

    decode_graphs = True

    def positions_from_ids(
        self, helpers: nn.ModuleDict, hidden: torch.Tensor, position_ids: torch.Tensor
    ) -> StepInputs:
        return {"position_embeddings": helpers["rotary"](hidden, position_ids)}

    def run_block(
        self, block: nn.Module, hidden: torch.Tensor, cache: Any, inputs: StepInputs
    ) -> torch.Tensor:
        output = block(
            hidden,
            attention_mask=inputs["attention_mask"],
            use_cache=True,
            position_embeddings=inputs["position_embeddings"],
            **{layer_cache_argument(type(block)): cache},
        )
        return output[0] if isinstance(output, tuple) else output

    def build_client_modules(self, config: PretrainedConfig) -> nn.ModuleDict:
        return nn.ModuleDict(
            {
                "embed": nn.Embedding(config.vocab_size, config.hidden_size),
                "norm": LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps),
                "lm_head": nn.Linear(config.hidden_size, config.vocab_size, bias=False),
            }
        )

    def client_tensor_names(self, base_prefix: str) -> dict[str, str]:
        return {
            f"{base_prefix}embed_tokens.weight": self.embedding_weight,
            f"{base_prefix}norm.weight": "norm.weight",
            "lm_head.weight": "lm_head.weight",
        }


LLAMA = register_family(LlamaFamily())
