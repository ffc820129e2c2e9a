"""A random-weight LoRA adapter for a tiny checkpoint, saved as peft saves one (tests, the demo).

peft initializes LoRA's B factor to zero (an untrained adapter changes nothing); here both factors are
random (`init_lora_weights=False`), so an adapter visibly changes what the model generates.
"""

from __future__ import annotations

from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

# the attention projections' names per family (what LoRA adapters usually target)
DEFAULT_TARGETS = {
    "bloom": ["query_key_value", "dense"],
    "falcon": ["query_key_value", "dense"],
}
LLAMA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]


def build_tiny_adapter(
    model_dir: str | Path,
    out_dir: str | Path,
    rank: int = 4,
    alpha: float = 8.0,
    targets: list[str] | None = None,
    seed: int = 0,
    scale: float = 0.5,
    **config,
) -> Path:
    """Save a LoRA adapter of `model_dir` to `out_dir` (adapter_config.json, adapter_model.safetensors).
    `scale`: the factors' random magnitude, large enough that greedy outputs change."""
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    if targets is None:
        targets = DEFAULT_TARGETS.get(model.config.model_type, LLAMA_TARGETS)
    lora = LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, init_lora_weights=False, **config)
    peft_model = get_peft_model(model, lora)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in peft_model.named_parameters():
            if "lora_" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * scale)
    out_dir = Path(out_dir)
    peft_model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir
