"""The few places where transformers 4.57 and 5.x name or build things differently.

Everything else in the project uses the forms both versions share. Each difference is detected from
the installed library itself (a signature, a dataclass field), never from a version number, so a
later minor that finishes a deprecation keeps working.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import inspect

import torch
from torch import nn
from transformers import GenerationConfig, GenerationMixin
from transformers.modeling_outputs import CausalLMOutputWithPast

# the name generate() gives the model's cache: "cache" from transformers 5.x ("past_key_values" is
# deprecated there), "past_key_values" before
GENERATE_CACHE_ARGUMENT = (
    "cache"
    if "cache" in {field.name for field in dataclasses.fields(CausalLMOutputWithPast)}
    else "past_key_values"
)


@functools.cache
def layer_cache_argument(layer_class: type[nn.Module]) -> str:
    """The keyword a decoder layer's forward takes its cache by ("cache" or "past_key_values")."""
    parameters = inspect.signature(layer_class.forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"


def build_rotary_embedding(rotary_class: type[nn.Module], config, device: torch.device) -> nn.Module:
    """A rotary embedding module on `device`: 4.57's take the device, 5.x's are built and moved."""
    if "device" in inspect.signature(rotary_class.__init__).parameters:
        return rotary_class(config=config, device=device)
    return rotary_class(config=config).to(device)


def library_default(setting: str):
    """transformers' own default for a generation setting that nothing set: 4.57 keeps it in a fresh
    GenerationConfig; 5.x leaves that field None and applies its table of defaults in generate()."""
    value = getattr(GenerationConfig(), setting)
    if value is None and hasattr(GenerationConfig, "_get_default_generation_params"):
        value = GenerationConfig._get_default_generation_params().get(setting)
    return value


def resolved_generation_config(
    model: GenerationMixin, generation_config: GenerationConfig | None = None, **settings
) -> GenerationConfig:
    """The configuration `model.generate(generation_config=..., **settings)` runs with: the call's
    settings over the model's generation config over the library's defaults. transformers 5 keeps
    unset fields None until generate() fills them; 4.57 starts every field at its default. Both
    resolve through the same GenerationMixin step, which this asks (other keys of `settings`, the
    model inputs, are ignored)."""
    resolved, _model_inputs = model._prepare_generation_config(generation_config, **settings)
    return resolved


def with_default_experts_implementation(config):
    """`config` for building blocks with fused experts (transformers 5): a copy naming the kernel
    `from_pretrained` picks by default ("grouped_mm"), so that a span computes what the library's
    own model computes. A config that names one keeps it; 4.57's configs have no such setting.
    (A copy: the client's model, which holds no experts, must not be told to run some.)"""
    if getattr(config, "_experts_implementation", "absent") is not None:
        return config
    config = copy.copy(config)
    config._experts_implementation = "grouped_mm"
    return config


@functools.cache
def forward_takes(module_class: type[nn.Module], argument: str) -> bool:
    """Whether a module class's forward takes `argument` (4.57's Gemma 3 layers take both rotary
    tables, global and local, where 5.x's take the one of their layer type)."""
    return argument in inspect.signature(module_class.forward).parameters


def gemma3_rotary_embeddings(rotary_class: type[nn.Module], config, device: torch.device) -> nn.ModuleDict:
    """Gemma 3's rotary tables: 5.x builds one module that takes the layer type in its forward
    (`rotary`); 4.57 builds one per layer type, the local one from a copy of the config with
    `rope_local_base_freq` as its base and no scaling (`rotary_full_attention`,
    `rotary_sliding_attention`)."""
    if forward_takes(rotary_class, "layer_type"):
        return nn.ModuleDict({"rotary": build_rotary_embedding(rotary_class, config, device)})
    local = copy.deepcopy(config)
    local.rope_theta = config.rope_local_base_freq
    local.rope_scaling = {"rope_type": "default"}
    return nn.ModuleDict(
        {
            "rotary_full_attention": build_rotary_embedding(rotary_class, config, device),
            "rotary_sliding_attention": build_rotary_embedding(rotary_class, local, device),
        }
    )


def gemma3_rotary(helpers: nn.ModuleDict, hidden: torch.Tensor, position_ids: torch.Tensor, layer_type: str):
    """The (cos, sin) of `layer_type`'s rotary table, from what `gemma3_rotary_embeddings` built."""
    if "rotary" in helpers:
        return helpers["rotary"](hidden, position_ids, layer_type)
    return helpers[f"rotary_{layer_type}"](hidden, position_ids)
