"""Families with LLaMA's layout (rotary embeddings, RMSNorm, grouped-query attention) and their own
`transformers` decoder layers: Qwen2 (biases on the q/k/v projections), Qwen3 (RMS norms on
queries and keys), Mistral (a sliding attention window), Mixtral (Mistral's attention with a
sparse mixture of experts as its MLP: a block holds all its experts, and routing tokens to them is
the block's own business) and Qwen3-MoE (Qwen3's attention with experts, as Mixtral). A block
needs from the client exactly what a LLaMA block needs: its tokens' positions (rotary embeddings)
and, for padded batches, the padding mask.

A Mistral/Mixtral `sliding_window` (Mistral-7B v0.1: 4096; later versions set none) applies to
every block alike; Qwen2's and Qwen3's (`use_sliding_window`) to the blocks from `max_window_layers`
on, as their `layer_types` say. Spans keep the whole cache and mask the keys outside each block's
window (`layer_window`), so sessions of any length are exact.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.models.mistral.modeling_mistral import (
    MistralDecoderLayer,
    MistralRMSNorm,
    MistralRotaryEmbedding,
)
from transformers.models.mixtral.modeling_mixtral import (
    MixtralDecoderLayer,
    MixtralRMSNorm,
    MixtralRotaryEmbedding,
)
from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer, Qwen2RMSNorm, Qwen2RotaryEmbedding
from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer, Qwen3RMSNorm, Qwen3RotaryEmbedding
from transformers.models.qwen3_moe.modeling_qwen3_moe import (
    Qwen3MoeDecoderLayer,
    Qwen3MoeRMSNorm,
    Qwen3MoeRotaryEmbedding,
)

from llm_swarm.swarm.errors import UnsupportedModelError
from llm_swarm.swarm.models.expert_weights import ExpertNames
from llm_swarm.swarm.models.family import layer_types_window, register_family
from llm_swarm.swarm.models.llama import LlamaFamily
from llm_swarm.swarm.transformers_compat import build_rotary_embedding, with_default_experts_implementation


class Qwen2Family(LlamaFamily):
    model_types = ("qwen2",)
    decoder_layer: type[nn.Module] = Qwen2DecoderLayer
    rms_norm: type[nn.Module] = Qwen2RMSNorm
    rotary_embedding: type[nn.Module] = Qwen2RotaryEmbedding
    experts: ExpertNames | None = None  # where a mixture keeps its experts (None: one dense MLP)

    def build_block(self, config: PretrainedConfig, index: int) -> nn.Module:
        if self.experts is not None:
            config = with_default_experts_implementation(config)
        return self.decoder_layer(config, layer_idx=index)

    def block_tensors(self, block: nn.Module, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if self.experts is None:
            return tensors
        return self.experts.fuse(tensors, {name for name, _ in block.named_parameters()})

    def layer_window(self, config: PretrainedConfig, index: int) -> int | None:
        # the blocks from `max_window_layers` on slide when `use_sliding_window`: `layer_types` says which
        return layer_types_window(config, index)

    def make_span_helpers(self, config: PretrainedConfig, device) -> nn.ModuleDict:
        return nn.ModuleDict({"rotary": build_rotary_embedding(self.rotary_embedding, config, device)})

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


class MistralFamily(Qwen2Family):
    model_types = ("mistral",)
    decoder_layer = MistralDecoderLayer
    rms_norm = MistralRMSNorm
    rotary_embedding = MistralRotaryEmbedding

    def layer_window(self, config: PretrainedConfig, index: int) -> int | None:
        window = getattr(config, "sliding_window", None)  # every block slides alike
        return int(window) if window else None


class MixtralFamily(MistralFamily):
    model_types = ("mixtral",)
    # its experts are chosen with a host-synchronizing nonzero(): not capturable
    decode_graphs = False
    decoder_layer = MixtralDecoderLayer
    rms_norm = MixtralRMSNorm
    rotary_embedding = MixtralRotaryEmbedding
    experts = ExpertNames(
        checkpoint_prefix="block_sparse_moe.", module_prefix="mlp.", gate="w1", up="w3", down="w2"
    )


class Qwen3MoeFamily(Qwen3Family):
    """Qwen3's attention with a sparse mixture of experts in its blocks (Qwen3-30B-A3B,
    Qwen3-235B-A22B: every block): the router's top-k weights, renormalized when `norm_topk_prob`,
    are the block's own business, as in Mixtral. Configs may keep some blocks dense
    (`mlp_only_layers`, `decoder_sparse_step`): blocks are built by their index, so each is of the
    model's kind there, and a span is priced at its largest."""

    model_types = ("qwen3_moe",)
    decode_graphs = False  # experts chosen with a host-synchronizing nonzero(), as Mixtral's
    decoder_layer = Qwen3MoeDecoderLayer
    rms_norm = Qwen3MoeRMSNorm
    rotary_embedding = Qwen3MoeRotaryEmbedding
    experts = ExpertNames(
        checkpoint_prefix="mlp.", module_prefix="mlp.", gate="gate_proj", up="up_proj", down="down_proj"
    )

    def representative_block(self, config: PretrainedConfig) -> int:
        # blocks in `mlp_only_layers`, or off every `decoder_sparse_step`-th, hold one dense MLP
        dense = set(getattr(config, "mlp_only_layers", None) or ())
        step = getattr(config, "decoder_sparse_step", 1) or 1
        sparse = [
            index
            for index in range(self.num_blocks(config))
            if index not in dense and config.num_experts > 0 and (index + 1) % step == 0
        ]
        return sparse[0] if sparse else 0

    def build_block(self, config: PretrainedConfig, index: int) -> nn.Module:
        if getattr(config, "use_sliding_window", False):
            raise UnsupportedModelError(
                "qwen3_moe with sliding-window attention (use_sliding_window) is not supported"
            )
        return super().build_block(config, index)


QWEN2 = register_family(Qwen2Family())
QWEN3 = register_family(Qwen3Family())
MISTRAL = register_family(MistralFamily())
MIXTRAL = register_family(MixtralFamily())
QWEN3_MOE = register_family(Qwen3MoeFamily())
