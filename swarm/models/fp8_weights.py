"""Block-quantized FP8 checkpoints (DeepSeek-V3 and R1 as published, the "-FP8" releases of other
families): a weight is stored in float8 with `{name}_scale_inv`, one float32 factor per tile of
`weight_block_size` (128 x 128) elements. Spans serve 16- or 32-bit weights, so a block's weights
are dequantized as they are read: each tile times its factor, computed in float32 (exact for the
float8 values; one rounding when the span's dtype is narrower)."""

from __future__ import annotations

import torch
from transformers import PretrainedConfig

from llm_swarm.swarm.errors import CheckpointError

SCALE_SUFFIX = "_scale_inv"


def fp8_block_size(config: PretrainedConfig) -> tuple[int, int] | None:
    """The tile of a block-quantized FP8 checkpoint (None: the checkpoint is not one)."""
    quantization = getattr(config, "quantization_config", None)
    if quantization is None:
        return None
    settings = quantization if isinstance(quantization, dict) else quantization.to_dict()
    if settings.get("quant_method") != "fp8":
        return None
    block = settings.get("weight_block_size") or (128, 128)
    if len(block) != 2 or min(block) < 1:
        raise CheckpointError(f"quantization_config.weight_block_size {block!r} is not two positive sizes")
    return int(block[0]), int(block[1])


def dequantize_fp8(tensors: dict[str, torch.Tensor], block: tuple[int, int]) -> dict[str, torch.Tensor]:
    """`tensors` with every weight that has a `_scale_inv` companion dequantized (float32) and the
    companions removed."""
    tensors = dict(tensors)
    for scale_name in [name for name in tensors if name.endswith(SCALE_SUFFIX)]:
        weight_name = scale_name[: -len(SCALE_SUFFIX)]
        scale = tensors.pop(scale_name).float()
        weight = tensors.get(weight_name)
        if weight is None:
            raise CheckpointError(f"{scale_name} scales a tensor the checkpoint does not hold")
        rows, columns = weight.shape[-2:]
        tiles = (-(-rows // block[0]), -(-columns // block[1]))
        if weight.ndim < 2 or tuple(scale.shape[-2:]) != tiles or scale.shape[:-2] != weight.shape[:-2]:
            raise CheckpointError(
                f"{scale_name} has shape {tuple(scale.shape)}; {weight_name} {tuple(weight.shape)} in "
                f"{block[0]}x{block[1]} tiles needs {(*weight.shape[:-2], *tiles)}"
            )
        factors = scale.repeat_interleave(block[0], -2)[..., :rows, :].repeat_interleave(block[1], -1)
        tensors[weight_name] = weight.float() * factors[..., :columns]
    return tensors
