"""Quantized blocks: every linear layer of a transformer block as a bitsandbytes int8 or NF4 layer.

Blocks are materialized on the CPU in the compute dtype, then each `nn.Linear` is swapped for
`bnb.nn.Linear8bitLt` (LLM.int8, outlier threshold 6.0) or `bnb.nn.Linear4bit` (NF4 with double
quantization of the scales, as in QLoRA and PETALS), and fused 3-D experts (transformers 5's MoE
layers) for one such layer per expert (`swarm.quantized_experts`); bitsandbytes quantizes the
weights when the layer is moved to the GPU. Embeddings, norms and the LM head stay in the compute
dtype (they are on the client, or tiny). `transformers`' own bitsandbytes integration only works inside
`from_pretrained` of a whole model, which a server never builds, hence this small swap.

Servers quantize only on CUDA (`check_quant_device`); the swap itself also runs on the CPU in
bitsandbytes >= 0.45, which is how the tests exercise it without a GPU.
"""

from __future__ import annotations

import torch
from torch import nn

from llm_swarm.swarm.errors import SwarmUserError
from llm_swarm.swarm.models.expert_weights import is_fused_experts
from llm_swarm.swarm.quantized_experts import QuantizedExperts, fused_layout_problem

QUANT_CHOICES = ("none", "int8", "nf4")
INT8_THRESHOLD = 6.0  # LLM.int8's outlier threshold: columns above it stay in 16 bits


def parse_quant(name: str) -> str:
    if name not in QUANT_CHOICES:
        raise SwarmUserError(f"unknown quantization {name!r}; choose one of {', '.join(QUANT_CHOICES)}")
    return name


def check_quant_device(quant: str, device: torch.device) -> None:
    """Quantized blocks are served from CUDA only: bitsandbytes' CPU kernels are a slow fallback."""
    if parse_quant(quant) != "none" and device.type != "cuda":
        raise SwarmUserError(
            f"--quant {quant} needs a CUDA GPU (bitsandbytes' quantized kernels run on CUDA), but the "
            f"device is {device}; use --quant none on CPU, or --device cuda"
        )


def quantize_block(
    block: nn.Module, quant: str, compute_dtype: torch.dtype, device: torch.device
) -> nn.Module:
    """Swap `block`'s linear layers for quantized ones (weights read from the CPU copies), and its
    fused experts (transformers 5's 3-D expert weights) for one quantized layer per expert, and move
    the block to `device`, which quantizes them. Returns the block (changed in place)."""
    if parse_quant(quant) == "none":
        return block.to(device)

    def quantized_linear(weight: torch.Tensor, bias: torch.Tensor | None = None) -> nn.Module:
        return _quantized_linear(weight.to(compute_dtype), bias, quant, compute_dtype)

    for parent in list(block.modules()):
        for child_name, child in list(parent.named_children()):
            if is_fused_experts(child):
                problem = fused_layout_problem(child)
                if problem is not None:
                    raise SwarmUserError(f"--quant {quant} cannot quantize this model's experts: {problem}")
                setattr(parent, child_name, QuantizedExperts(child, quantized_linear))
            # subclasses too: Falcon's FalconLinear is a plain linear layer with its own forward
            elif isinstance(child, nn.Linear):
                setattr(parent, child_name, quantized_linear(child.weight.data, child.bias))
    return block.to(device)


def _quantized_linear(
    weight: torch.Tensor, bias: torch.Tensor | None, quant: str, compute_dtype: torch.dtype
) -> nn.Module:
    """A bitsandbytes linear layer holding `weight` (`[out, in]`, quantized when moved to the GPU)."""
    import bitsandbytes as bnb  # imported here: loading it prints CUDA probing noise on CPU machines

    out_features, in_features = weight.shape
    if quant == "int8":
        layer = bnb.nn.Linear8bitLt(
            in_features, out_features, bias=bias is not None, has_fp16_weights=False, threshold=INT8_THRESHOLD
        )
        layer.weight = bnb.nn.Int8Params(weight, requires_grad=False, has_fp16_weights=False)
    else:
        nf4 = dict(compress_statistics=True, quant_type="nf4")  # double quantization of the scales
        layer = bnb.nn.Linear4bit(
            in_features, out_features, bias=bias is not None, compute_dtype=compute_dtype, **nf4
        )
        layer.weight = bnb.nn.Params4bit(weight, requires_grad=False, **nf4)
    if bias is not None:
        layer.bias = nn.Parameter(bias.data.to(compute_dtype), requires_grad=False)
    return layer


def quantization_state_bytes(parameter: torch.Tensor) -> int:
    """Bytes a quantized parameter keeps beside its packed data: NF4 block scales (absmax, code
    books, nested scales) or LLM.int8's per-row scales (SCB). 0 for ordinary parameters."""
    total = 0
    state = getattr(parameter, "quant_state", None)
    if state is not None:
        total += sum(
            value.numel() * value.element_size()
            for value in state.as_dict(packed=False).values()
            if torch.is_tensor(value)
        )
    scales = getattr(parameter, "SCB", None)
    if torch.is_tensor(scales):
        total += scales.numel() * scales.element_size()
    return total
