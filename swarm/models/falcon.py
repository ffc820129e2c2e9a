"""The Falcon family: fused QKV, LayerNorms with biases, a tied LM head, and several architectures.

One `model_type` ("falcon") covers what the config's flags select inside `transformers`'
`FalconDecoderLayer`:

- Falcon-7B: multi-query attention (one KV head), rotary positions, attention and MLP in parallel
  from one LayerNorm;
- Falcon-40B/180B: the new decoder architecture, grouped KV heads (`num_kv_heads`), rotary, attention
  and MLP in parallel from two LayerNorms (Falcon-11B: from one, `num_ln_in_parallel_attn=1`);
- Falcon-RW: ALiBi positions, multi-head attention, attention then MLP (`parallel_attn=False`).

What a block needs from the client: for rotary models, its tokens' positions (with left padding,
real tokens count from 0); for ALiBi models, the padding mask, from which the biases' key positions
are counted (as `transformers` builds them from the attention mask); and, for padded batches, the
padding mask as every family does. A client sends every family the same (each step's position
and, for padded batches, the padding mask), so nothing on the client is particular to Falcon.

Blocks use `swarm.models.falcon_attention`: one cached key and value per KV head (transformers
caches them repeated for every query head) and batched decode steps read caches in place.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.models.falcon.modeling_falcon import (
    FalconDecoderLayer,
    FalconRotaryEmbedding,
    build_alibi_tensor,
)

from llm_swarm.swarm.models.falcon_attention import use_falcon_attention
from llm_swarm.swarm.models.family import (
    ModelFamily,
    StepInputs,
    StepTokens,
    register_family,
    token_positions,
)
from llm_swarm.swarm.models.layer_norm_head import layer_norm_client_modules, layer_norm_head_names
from llm_swarm.swarm.transformers_compat import build_rotary_embedding


class FalconFamily(ModelFamily):
    model_types = ("falcon",)
    base_prefixes = ("transformer.", "")  # FalconForCausalLM saves "transformer.h.0..."
    blocks_attribute = "h."
    embedding_weight = "embed.weight"

    def num_kv_heads(self, config: PretrainedConfig) -> int:
        """Key/value heads per block as a span caches them (`swarm.models.falcon_attention`)."""
        if config.new_decoder_architecture:
            return int(config.num_kv_heads)
        return 1 if config.multi_query else self.num_heads(config)

    def build_block(self, config: PretrainedConfig, index: int) -> nn.Module:
        # FalconDecoderLayer picks its attention class by the config's kernel name and knows only
        # transformers' own; "sdpa" builds the class whose forward `use_falcon_attention` replaces
        block_config = copy.copy(config)
        block_config._attn_implementation = "sdpa"
        block = FalconDecoderLayer(block_config, layer_idx=index)
        use_falcon_attention(block.self_attention)
        return block

    def make_span_helpers(self, config: PretrainedConfig, device: torch.device) -> nn.ModuleDict:
        if config.alibi:
            return nn.ModuleDict()
        return nn.ModuleDict({"rotary": build_rotary_embedding(FalconRotaryEmbedding, config, device)})

    def position_inputs(
        self, config: PretrainedConfig, helpers: nn.ModuleDict, step: StepTokens
    ) -> StepInputs:
        """Rotary embeddings of the tokens' positions, or ALiBi biases over the step's keys."""
        hidden = step.hidden
        if not config.alibi:
            position_ids = token_positions(hidden, step.position, step.padding_mask)
            return {"position_embeddings": helpers["rotary"](hidden, position_ids)}
        total = step.position + hidden.shape[1]
        key_mask = step.padding_mask
        if key_mask is None:
            key_mask = torch.ones(hidden.shape[0], total, device=hidden.device)
        # an integer mask, as transformers' generate() passes it: Falcon multiplies bfloat16 slopes by
        # the key positions, and float positions would promote the product past bfloat16's rounding
        key_mask = key_mask[:, :total].long()
        return {"alibi": build_alibi_tensor(key_mask, self.num_heads(config), hidden.dtype)}

    def step_attention_mask(
        self,
        config: PretrainedConfig,
        step: StepTokens,
        positions: StepInputs,
        key_positions: torch.Tensor | None,  # never set: Falcon's blocks do not slide
    ) -> torch.Tensor | None:
        """ALiBi models attend with the biases inside the mask, as `FalconModel` builds it: ALiBi
        scaled by 1/sqrt(head_dim), blocked keys (future, padding) at the dtype's minimum."""
        blocked = super().step_attention_mask(config, step, positions, key_positions)
        if not config.alibi:
            return blocked
        hidden = step.hidden
        batch, total = hidden.shape[0], step.position + hidden.shape[1]
        biases = positions["alibi"].reshape(batch, -1, 1, total) / math.sqrt(self.head_dim(config))
        if blocked is not None:
            biases = torch.masked_fill(biases, blocked < -1, torch.finfo(hidden.dtype).min)
        return biases

    def run_block(
        self, block: nn.Module, hidden: torch.Tensor, cache: Any, inputs: StepInputs
    ) -> torch.Tensor:
        output, _attention = block(
            hidden,
            alibi=inputs.get("alibi"),  # not None: the block takes ALiBi's path (no rotary)
            attention_mask=inputs["attention_mask"],
            layer_past=cache,
            use_cache=True,
            position_embeddings=inputs.get("position_embeddings"),
        )
        return output

    def build_client_modules(self, config: PretrainedConfig) -> nn.ModuleDict:
        return layer_norm_client_modules(config, nn.Embedding(config.vocab_size, config.hidden_size))

    def client_tensor_names(self, base_prefix: str) -> dict[str, str]:
        return {f"{base_prefix}word_embeddings.weight": "embed.weight", **layer_norm_head_names(base_prefix)}


FALCON = register_family(FalconFamily())
