"""The Qwen2 and Qwen3 families: LLaMA's layout (rotary embeddings, RMSNorm, grouped-query attention)
with biases on the q/k/v projections (Qwen2) or RMS norms on queries and keys (Qwen3), both inside
`transformers`' own decoder layers, so a block needs from the client exactly what a LLaMA block
needs: its tokens' positions (rotary embeddings) and, for padded batches, the padding mask.

Sliding-window attention (`use_sliding_window`, set in some Qwen2 checkpoints' configs) is refused:
the spans' attention masks are causal over the whole cache, so a window would silently differ.
"""

from __future__ import annotations

from torch import nn
from transformers import PretrainedConfig
from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer, Qwen2RMSNorm, Qwen2RotaryEmbedding
from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer, Qwen3RMSNorm, Qwen3RotaryEmbedding

from swarm.errors import UnsupportedModelError
from swarm.models.family import register_family
from swarm.models.llama import LlamaFamily


class Qwen2Family(LlamaFamily):
    model_types = ("qwen2",)
    decoder_layer: type[nn.Module] = Qwen2DecoderLayer
    rms_norm: type[nn.Module] = Qwen2RMSNorm
    rotary_embedding: type[nn.Module] = Qwen2RotaryEmbedding

    def build_block(self, config: PretrainedConfig, local_index: int) -> nn.Module:
        if getattr(config, "use_sliding_window", False):
            raise UnsupportedModelError(
                f"{config.model_type} with sliding-window attention (use_sliding_window) is not supported: "
                "spans attend over the whole cache"
            )
        return self.decoder_layer(config, layer_idx=local_index)

    def make_span_helpers(self, config: PretrainedConfig, device) -> nn.ModuleDict:
        return nn.ModuleDict({"rotary": self.rotary_embedding(config=config, device=device)})

    def build_client_modules(self, config: PretrainedConfig) -> nn.ModuleDict:
        return nn.ModuleDict(
            {
                "embed": nn.Embedding(config.vocab_size, config.hidden_size),
                "norm": self.rms_norm(config.hidden_size, eps=config.rms_norm_eps),
                "lm_head": nn.Linear(config.hidden_size, config.vocab_size, bias=False),
            }
        )


class Qwen3Family(Qwen2Family):
    model_types = ("qwen3",)
    decoder_layer = Qwen3DecoderLayer
    rms_norm = Qwen3RMSNorm
    rotary_embedding = Qwen3RotaryEmbedding


QWEN2 = register_family(Qwen2Family())
QWEN3 = register_family(Qwen3Family())
