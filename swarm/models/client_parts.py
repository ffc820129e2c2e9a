"""The modules a client keeps locally: token embeddings, the final norm and the LM head."""

from __future__ import annotations

from pathlib import Path

import torch
from accelerate import init_empty_weights
from torch import nn
from transformers import PretrainedConfig

from llm_swarm.swarm.dtypes import parse_dtype
from llm_swarm.swarm.models.checkpoint import CheckpointReader, load_config
from llm_swarm.swarm.models.family import ModelFamily, family_for
from llm_swarm.swarm.models.span import find_base_prefix, materialize, prepare_config


class ClientParts(nn.Module):
    """Embeddings before the first block and norm + LM head after the last one."""

    def __init__(self, family: ModelFamily, config: PretrainedConfig, modules: nn.ModuleDict):
        super().__init__()
        self.family, self.config = family, config
        self.embed, self.norm, self.lm_head = modules["embed"], modules["norm"], modules["lm_head"]

    @property
    def num_blocks(self) -> int:
        return self.family.num_blocks(self.config)

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    # no inference_mode here: training differentiates through the norm and LM head (whose weights are
    # frozen), and generate() already runs under inference mode
    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed(input_ids.to(self.lm_head.weight.device))

    @property
    def token_embedding(self) -> nn.Embedding:
        """The embedding table alone (BLOOM normalizes its output before the first block)."""
        return self.embed[0] if isinstance(self.embed, nn.Sequential) else self.embed

    def from_embeddings(self, embeddings: torch.Tensor) -> torch.Tensor:
        """The first block's input for token embeddings (`inputs_embeds`): what follows the table."""
        hidden = embeddings.to(device=self.lm_head.weight.device, dtype=self.dtype)
        if isinstance(self.embed, nn.Sequential):
            for module in list(self.embed)[1:]:
                hidden = module(hidden)
        return hidden

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        hidden = hidden.to(device=self.lm_head.weight.device, dtype=self.dtype)
        logits = self.lm_head(self.norm(hidden))
        # Gemma 2 and 3 soft-cap the final logits: cap * tanh(logits / cap), as their models do
        cap = getattr(self.config, "final_logit_softcapping", None)
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits


def load_client_parts(
    model_dir: str | Path, dtype: str | torch.dtype = "float32", device: str | torch.device = "cpu"
) -> ClientParts:
    """Load only the client-side modules; the LM head is tied to the embeddings when the model says so."""
    dtype, device = parse_dtype(dtype), torch.device(device)
    config = prepare_config(load_config(model_dir))
    family = family_for(config)
    with CheckpointReader(model_dir) as reader:
        base = find_base_prefix(family, reader)
        name_map = family.client_tensor_names(base)
        with init_empty_weights():
            modules = family.build_client_modules(config)
        tied = getattr(config, "tie_word_embeddings", True) or not reader.has("lm_head.weight")
        wanted = [name for name, local in name_map.items() if not (tied and local == "lm_head.weight")]
        tensors = {name_map[name]: tensor for name, tensor in reader.read(wanted).items()}
    if tied:
        tensors["lm_head.weight"] = tensors[family.embedding_weight]
    materialize(modules, tensors, dtype, device, what="the client-side modules")
    parts = ClientParts(family, config, modules).eval()
    parts.requires_grad_(False)  # frozen, like the servers' blocks: training tunes prompts (or adapters)
    return parts
