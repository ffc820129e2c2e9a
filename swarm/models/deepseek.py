"""DeepSeek-V2 and DeepSeek-V3/R1: multi-head latent attention (MLA) and, from block
`first_k_dense_replace` on, a mixture of routed experts beside shared ones, chosen by group-limited
top-k routing (V3 adds a score correction to the choice and scales the chosen weights). The blocks
are transformers' own, built by their index in the model: the first ones hold one dense MLP, the
rest their experts, so a span's blocks differ in size and are priced at their largest.

Latent attention: transformers 5 caches each position's compressed latent (`kv_lora_rank`, after
its norm) and its shared rotary key (`qk_rope_head_dim`), one row each, and expands them into every
head's keys and values at each step: DeepSeek-V3's 576 cached elements per position and block are
57x fewer than 128 multi-head keys and values of 128. Spans cache exactly that; a batched decode
step hands the blocks each session's latents gathered into one right-aligned batch (small, unlike
expanded keys), since the expansion runs on the whole batch. transformers 4.57 caches the expanded
keys (`qk_nope_head_dim + qk_rope_head_dim` wide) and values (`v_head_dim`) of every head, and so do
spans there.
"""

from __future__ import annotations

from torch import nn
from transformers import PretrainedConfig
from transformers.models.deepseek_v2.modeling_deepseek_v2 import (
    DeepseekV2Attention,
    DeepseekV2DecoderLayer,
    DeepseekV2PreTrainedModel,
    DeepseekV2RMSNorm,
    DeepseekV2RotaryEmbedding,
)
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
    DeepseekV3Attention,
    DeepseekV3DecoderLayer,
    DeepseekV3PreTrainedModel,
    DeepseekV3RMSNorm,
    DeepseekV3RotaryEmbedding,
)

from llm_swarm.swarm.models.expert_weights import ExpertNames
from llm_swarm.swarm.models.family import CacheLayout, register_family
from llm_swarm.swarm.models.llama_like import Qwen2Family


class DeepseekV3Family(Qwen2Family):
    """Qwen2Family's building and expert fusing, with DeepSeek's layers, cache and block kinds."""

    model_types = ("deepseek_v3",)
    decode_graphs = False  # experts chosen with a host-synchronizing nonzero()
    decoder_layer: type[nn.Module] = DeepseekV3DecoderLayer
    rms_norm: type[nn.Module] = DeepseekV3RMSNorm
    rotary_embedding: type[nn.Module] = DeepseekV3RotaryEmbedding
    pretrained_class = DeepseekV3PreTrainedModel
    # the latent form (transformers 5) expands the latents of the whole batch at once
    latent_cache = hasattr(DeepseekV3Attention, "expand_kv")
    experts = ExpertNames(
        checkpoint_prefix="mlp.", module_prefix="mlp.", gate="gate_proj", up="up_proj", down="down_proj"
    )

    @property
    def reads_cache_in_place(self) -> bool:
        return not self.latent_cache

    def cache_layout(self, config: PretrainedConfig) -> CacheLayout:
        if self.latent_cache:
            return CacheLayout(1, int(config.kv_lora_rank), int(config.qk_rope_head_dim))
        key_dim = int(config.qk_nope_head_dim) + int(config.qk_rope_head_dim)
        return CacheLayout(int(config.num_attention_heads), key_dim, int(config.v_head_dim))

    def representative_block(self, config: PretrainedConfig) -> int:
        first_sparse = int(config.first_k_dense_replace)
        return first_sparse if first_sparse < self.num_blocks(config) else 0


class DeepseekV2Family(DeepseekV3Family):
    """DeepSeek-V2 and V2-Lite: V3's latent attention (V2-Lite without a query compression) and
    experts routed greedily or group-limited by `topk_method`, with no score correction."""

    model_types = ("deepseek_v2",)
    decoder_layer = DeepseekV2DecoderLayer
    rms_norm = DeepseekV2RMSNorm
    rotary_embedding = DeepseekV2RotaryEmbedding
    pretrained_class = DeepseekV2PreTrainedModel
    latent_cache = hasattr(DeepseekV2Attention, "expand_kv")


DEEPSEEK_V3 = register_family(DeepseekV3Family())
DEEPSEEK_V2 = register_family(DeepseekV2Family())
