"""GPT-OSS (gpt-oss-20b, gpt-oss-120b): LLaMA's layout with sliding (128 positions) and full layers
alternating as the config's `layer_types` say, a learned attention sink per head (a softmax column
that takes weight and gives no value), biased q/k/v/o projections, and a mixture of experts in every
block: a biased top-k router, experts with biases whose gate and up rows interleave, and a clamped
gated activation (`swiglu_limit`). The experts are fused 3-D tensors in checkpoints and modules
alike, in both transformers versions; a block holds all its experts and routes its own tokens.

Published checkpoints keep the experts in MXFP4; spans dequantize them on load into the serving
dtype, as transformers does without its GPU kernels.

SDPA has no sinks: transformers runs GPT-OSS with its eager kernel, and so do spans (per session in
batched steps). Spans keep the whole cache and mask the keys outside each sliding layer's window.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.integrations.mxfp4 import convert_moe_packed_tensors
from transformers.models.gpt_oss import modeling_gpt_oss
from transformers.models.gpt_oss.modeling_gpt_oss import (
    GptOssDecoderLayer,
    GptOssRMSNorm,
    GptOssRotaryEmbedding,
)

from llm_swarm.swarm.errors import CheckpointError
from llm_swarm.swarm.models.family import layer_types_window, register_family
from llm_swarm.swarm.models.inplace_attention import register_session_attention
from llm_swarm.swarm.models.llama import LlamaFamily
from llm_swarm.swarm.transformers_compat import build_rotary_embedding, with_default_experts_implementation

MXFP4_EXPERT_TENSORS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


class GptOssFamily(LlamaFamily):
    model_types = ("gpt_oss",)
    # experts chosen with a host-synchronizing nonzero(), and an eager kernel that adds masks
    decode_graphs = False
    attention_implementation = register_session_attention(
        "swarm_gpt_oss_eager", modeling_gpt_oss.eager_attention_forward
    )

    def build_block(self, config: PretrainedConfig, index: int) -> nn.Module:
        return GptOssDecoderLayer(with_default_experts_implementation(config), layer_idx=index)

    def layer_window(self, config: PretrainedConfig, index: int) -> int | None:
        return layer_types_window(config, index)

    def block_tensors(self, block: nn.Module, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The published checkpoints keep the experts in MXFP4 (`{name}_blocks`: packed 4-bit
        values, `{name}_scales`: a power of two per 32): dequantized with transformers' own
        conversion, exactly (every MXFP4 value is a float32 and a bfloat16)."""
        tensors = dict(tensors)
        for name in MXFP4_EXPERT_TENSORS:
            blocks, scales = tensors.pop(f"{name}_blocks", None), tensors.pop(f"{name}_scales", None)
            if blocks is not None and scales is not None:
                if blocks.dtype != torch.uint8 or blocks.shape[:-1] != scales.shape:
                    raise CheckpointError(
                        f"{name}: MXFP4 blocks {blocks.dtype} {tuple(blocks.shape)} do not fit scales "
                        f"{tuple(scales.shape)} (uint8 blocks, one scale per block of 32 values)"
                    )
                tensors[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
        return tensors

    def make_span_helpers(self, config: PretrainedConfig, device: torch.device) -> nn.ModuleDict:
        return nn.ModuleDict({"rotary": build_rotary_embedding(GptOssRotaryEmbedding, config, device)})

    def build_client_modules(self, config: PretrainedConfig) -> nn.ModuleDict:
        return nn.ModuleDict(
            {
                "embed": nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id),
                "norm": GptOssRMSNorm(config.hidden_size, eps=config.rms_norm_eps),
                "lm_head": nn.Linear(config.hidden_size, config.vocab_size, bias=False),
            }
        )


GPT_OSS = register_family(GptOssFamily())
