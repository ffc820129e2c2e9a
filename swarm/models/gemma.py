"""Gemma 2 and Gemma 3 (text): LLaMA's layout with local (sliding) and global layers alternating as
the config's `layer_types` say, a norm after attention and around the MLP, queries scaled by
`query_pre_attn_scalar`, embeddings scaled by the square root of the width (a client part) and the
final logits soft-capped (`final_logit_softcapping`, applied by the client's head).

- Gemma 2 soft-caps its attention logits (`attn_logit_softcapping`), which SDPA cannot compute:
  transformers 5 runs it with its eager kernel, and so do spans (per session in batched steps);
  4.57 runs SDPA, without the cap, and so do spans there.
- Gemma 3 uses SDPA and two rotary tables, a global one for full layers and a local one (base
  `rope_local_base_freq`) for sliding layers: a span computes one per layer type among its blocks.

Spans keep the whole cache and mask the keys outside each sliding layer's window, so sessions of
any length are exact.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.models.gemma2 import modeling_gemma2
from transformers.models.gemma2.modeling_gemma2 import (
    Gemma2DecoderLayer,
    Gemma2RMSNorm,
    Gemma2RotaryEmbedding,
)
from transformers.models.gemma3.modeling_gemma3 import (
    Gemma3DecoderLayer,
    Gemma3RMSNorm,
    Gemma3RotaryEmbedding,
    Gemma3TextScaledWordEmbedding,
)

from llm_swarm.swarm.errors import UnsupportedModelError
from llm_swarm.swarm.models.embedding_scale import EmbeddingScale
from llm_swarm.swarm.models.family import (
    StepInputs,
    StepTokens,
    layer_types_window,
    register_family,
    token_positions,
)
from llm_swarm.swarm.models.inplace_attention import ATTENTION_NAME, register_session_attention
from llm_swarm.swarm.models.llama import LlamaFamily
from llm_swarm.swarm.transformers_compat import (
    build_rotary_embedding,
    forward_takes,
    gemma3_rotary,
    gemma3_rotary_embeddings,
    layer_cache_argument,
)

# 5.x scales inside Gemma 2's embedding module; 4.57's model scales whatever embeddings it gets
GEMMA2_SCALED_EMBEDDING = getattr(modeling_gemma2, "Gemma2TextScaledWordEmbedding", None)


def refuse_bidirectional(config: PretrainedConfig) -> None:
    if getattr(config, "use_bidirectional_attention", False):
        raise UnsupportedModelError(
            f"{config.model_type} with bidirectional attention (use_bidirectional_attention) is an "
            "encoder, not a causal language model: it is not supported"
        )


class Gemma2Family(LlamaFamily):
    model_types = ("gemma2",)
    decode_graphs = False  # its eager kernel adds masks, where a captured step passes boolean ones
    # what `from_pretrained` picks: 5.x runs the eager kernel, which soft-caps attention logits; 4.57
    # picks SDPA, which does not
    attention_implementation = (
        ATTENTION_NAME
        if modeling_gemma2.Gemma2PreTrainedModel._supports_sdpa
        else register_session_attention("swarm_gemma2_eager", modeling_gemma2.eager_attention_forward)
    )
    embedding_weight = "embed.weight" if GEMMA2_SCALED_EMBEDDING is not None else "embed.0.weight"

    def build_block(self, config: PretrainedConfig, index: int) -> nn.Module:
        refuse_bidirectional(config)
        return Gemma2DecoderLayer(config, layer_idx=index)

    def layer_window(self, config: PretrainedConfig, index: int) -> int | None:
        return layer_types_window(config, index)

    def make_span_helpers(self, config: PretrainedConfig, device: torch.device) -> nn.ModuleDict:
        return nn.ModuleDict({"rotary": build_rotary_embedding(Gemma2RotaryEmbedding, config, device)})

    def build_client_modules(self, config: PretrainedConfig) -> nn.ModuleDict:
        scale = config.hidden_size**0.5
        if GEMMA2_SCALED_EMBEDDING is not None:
            embed = GEMMA2_SCALED_EMBEDDING(config.vocab_size, config.hidden_size, config.pad_token_id, scale)
        else:
            embed = nn.Sequential(
                nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id),
                EmbeddingScale(scale),
            )
        return nn.ModuleDict(
            {
                "embed": embed,
                "norm": Gemma2RMSNorm(config.hidden_size, eps=config.rms_norm_eps),
                "lm_head": nn.Linear(config.hidden_size, config.vocab_size, bias=False),
            }
        )


class Gemma3TextFamily(LlamaFamily):
    model_types = ("gemma3_text",)
    decode_graphs = False

    def build_block(self, config: PretrainedConfig, index: int) -> nn.Module:
        refuse_bidirectional(config)
        if "sliding_attention" in config.layer_types and not config.sliding_window:
            raise UnsupportedModelError(
                "gemma3_text with sliding layers needs a sliding_window in its config"
            )
        return Gemma3DecoderLayer(config, layer_idx=index)

    def layer_window(self, config: PretrainedConfig, index: int) -> int | None:
        return layer_types_window(config, index)

    def make_span_helpers(self, config: PretrainedConfig, device: torch.device) -> nn.ModuleDict:
        return gemma3_rotary_embeddings(Gemma3RotaryEmbedding, config, device)

    def position_inputs(
        self, config: PretrainedConfig, helpers: nn.ModuleDict, step: StepTokens
    ) -> StepInputs:
        """The rotary table of the blocks' layer type: a window marks the sliding (local) layers."""
        position_ids = token_positions(step.hidden, step.position, step.padding_mask)
        layer_type = "sliding_attention" if step.window is not None else "full_attention"
        return {"position_embeddings": gemma3_rotary(helpers, step.hidden, position_ids, layer_type)}

    def run_block(
        self, block: nn.Module, hidden: torch.Tensor, cache: Any, inputs: StepInputs
    ) -> torch.Tensor:
        rotary = inputs["position_embeddings"]
        if forward_takes(type(block), "position_embeddings_local"):  # 4.57: the block picks its own
            rotary_arguments = {"position_embeddings_global": rotary, "position_embeddings_local": rotary}
        else:
            rotary_arguments = {"position_embeddings": rotary}
        output = block(
            hidden,
            attention_mask=inputs["attention_mask"],
            use_cache=True,
            **rotary_arguments,
            **{layer_cache_argument(type(block)): cache},
        )
        return output[0] if isinstance(output, tuple) else output

    def build_client_modules(self, config: PretrainedConfig) -> nn.ModuleDict:
        return nn.ModuleDict(
            {
                "embed": Gemma3TextScaledWordEmbedding(
                    config.vocab_size, config.hidden_size, config.pad_token_id, config.hidden_size**0.5
                ),
                "norm": Gemma3RMSNorm(config.hidden_size, eps=config.rms_norm_eps),
                "lm_head": nn.Linear(config.hidden_size, config.vocab_size, bias=False),
            }
        )


GEMMA2 = register_family(Gemma2Family())
GEMMA3_TEXT = register_family(Gemma3TextFamily())
