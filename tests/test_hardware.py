"""Real-hardware paths that need no GPU: device/dtype resolution, quantization errors and
bytes, the memory budget, and the server CLI turning flags into a config."""

from __future__ import annotations

import pytest
import torch

from llm_swarm.server import cli as server_cli
from llm_swarm.server.cli import build_parser, config_from_args
from llm_swarm.swarm.cost import module_parameter_bytes
from llm_swarm.swarm.errors import SwarmUserError
from llm_swarm.swarm.hardware import (
    MIN_HEADROOM_BYTES,
    DeviceFacts,
    headroom_bytes,
    resolve_device,
    resolve_dtype,
    server_memory_budget,
    usable_memory,
)
from llm_swarm.swarm.models import load_span
from llm_swarm.swarm.models.tiny import TinyModelSpec, build_tiny_model
from llm_swarm.swarm.quantization import check_quant_device, parse_quant, quantize_block

GIB = 2**30
NO_GPU = DeviceFacts(cuda_devices=0)
A100 = DeviceFacts(cuda_devices=2, bf16_supported=True)
T4 = DeviceFacts(cuda_devices=1, bf16_supported=False)


def test_auto_device_is_the_first_gpu_or_the_cpu():
    assert resolve_device("auto", NO_GPU) == torch.device("cpu")
    assert resolve_device("auto", A100) == torch.device("cuda", 0)
    assert resolve_device("cuda:1", A100) == torch.device("cuda", 1)
    assert resolve_device("CPU", A100) == torch.device("cpu")


@pytest.mark.parametrize(
    ("name", "facts", "message"),
    [
        ("cuda", NO_GPU, "torch sees no CUDA GPU"),
        ("cuda:2", A100, "only 2 CUDA device"),
        ("tpu", A100, "device"),
        ("mps", A100, "unsupported device"),
    ],
)
def test_impossible_devices_are_clear_errors(name, facts, message):
    with pytest.raises(SwarmUserError, match=message):
        resolve_device(name, facts)


def test_auto_dtype_follows_the_device_and_the_checkpoint():
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    assert resolve_dtype("auto", cpu, NO_GPU, "bfloat16") == torch.float32
    assert resolve_dtype("auto", gpu, A100, None) == torch.bfloat16
    assert resolve_dtype("auto", gpu, A100, "float16") == torch.float16
    assert resolve_dtype("auto", gpu, A100, "float32") == torch.bfloat16
    assert resolve_dtype("auto", gpu, T4, "bfloat16") == torch.float16  # no bf16 on a T4
    assert resolve_dtype("float16", cpu, NO_GPU) == torch.float16
    with pytest.raises(SwarmUserError, match="does not support bfloat16"):
        resolve_dtype("bfloat16", gpu, T4)
    with pytest.raises(SwarmUserError, match="unsupported dtype"):
        resolve_dtype("int4", cpu, NO_GPU)


def test_quantization_needs_cuda():
    for quant in ("int8", "nf4"):
        with pytest.raises(SwarmUserError, match=f"--quant {quant} needs a CUDA GPU"):
            check_quant_device(quant, torch.device("cpu"))
        check_quant_device(quant, torch.device("cuda", 0))  # no error: the device is not touched
    check_quant_device("none", torch.device("cpu"))
    with pytest.raises(SwarmUserError, match="unknown quantization"):
        parse_quant("fp4")


def test_load_span_refuses_quantization_on_cpu(llama_dir):
    with pytest.raises(SwarmUserError, match="needs a CUDA GPU"):
        load_span(llama_dir, 0, 2, quant="nf4")


@pytest.mark.parametrize("quant", ["int8", "nf4"])
def test_quantized_block_is_smaller_counts_its_scales_and_stays_close(model_dir, quant):
    """bitsandbytes also quantizes on the CPU, which lets the swap be checked without a GPU."""
    span, _ = load_span(model_dir, 0, 1)
    block = span.blocks[0]
    linear_params = sum(
        module.weight.numel() for module in block.modules() if type(module) is torch.nn.Linear
    )
    full_bytes = module_parameter_bytes(block)
    reference = torch.randn(1, 5, span.hidden_size, generator=torch.Generator().manual_seed(0))
    expected = span(reference, span.new_cache(1, 5), 0)

    quantize_block(block, quant, torch.float32, torch.device("cpu"))
    assert not any(type(module) is torch.nn.Linear for module in block.modules())
    quantized_bytes = module_parameter_bytes(block)
    packed = linear_params if quant == "int8" else linear_params // 2
    # packed weights (1 byte or half a byte per weight) plus scales: far below float32's 4 bytes
    assert quantized_bytes < full_bytes - 4 * linear_params + packed + linear_params // 4
    scales = quantized_bytes - sum(p.numel() * p.element_size() for p in block.parameters())
    assert scales > 0  # absmax / SCB are counted in s_m, not only the packed data
    output = span(reference, span.new_cache(1, 5), 0)
    relative = (output - expected).norm() / expected.norm()
    assert relative < (0.05 if quant == "int8" else 0.3), relative


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
@pytest.mark.parametrize("quant", ["int8", "nf4"])
def test_a_mixture_of_experts_block_quantizes_its_experts_too(tmp_path, quant, family):
    """A mixture's experts are most of its weights: transformers 4.57 keeps them as linear layers,
    transformers 5 as 3-D parameters; either way every expert matrix ends up quantized, is counted,
    and the block still computes close to its full-precision self."""
    model_dir = build_tiny_model(tmp_path / family, TinyModelSpec(family=family, num_layers=1))
    span, _ = load_span(model_dir, 0, 1)
    block = span.blocks[0]
    full_bytes = module_parameter_bytes(block)
    reference = torch.randn(1, 7, span.hidden_size, generator=torch.Generator().manual_seed(0))
    expected = span(reference, span.new_cache(1, 7), 0)

    quantize_block(block, quant, torch.float32, torch.device("cpu"))
    assert not any(type(module) is torch.nn.Linear for module in block.modules())
    assert not any(parameter.ndim == 3 for parameter in block.parameters())  # no fused expert left
    assert module_parameter_bytes(block) < full_bytes / 2
    output = span(reference, span.new_cache(1, 7), 0)
    relative = (output - expected).norm() / expected.norm()
    assert relative < (0.05 if quant == "int8" else 0.3), relative


def test_gpt_oss_experts_are_refused_by_quantization_with_the_reason(tmp_path):
    """GPT-OSS's experts have biases and interleaved gate/up rows, which the per-expert quantized
    layers do not compute: quantizing says so rather than computing something else."""
    model_dir = build_tiny_model(tmp_path / "gpt_oss", TinyModelSpec(family="gpt_oss", num_layers=1))
    span, _ = load_span(model_dir, 0, 1)
    with pytest.raises(SwarmUserError, match="cannot quantize this model's experts: .*"):
        quantize_block(span.blocks[0], "int8", torch.float32, torch.device("cpu"))


def test_memory_budget_keeps_headroom_and_rejects_what_does_not_fit():
    total, free = 80 * GIB, 78 * GIB  # ~2 GB: CUDA context and other processes
    headroom = headroom_bytes(total)
    assert headroom == int(0.05 * total)
    assert headroom_bytes(8 * GIB) == MIN_HEADROOM_BYTES
    assert usable_memory(None, free, total, "cuda:0") == free - headroom
    assert usable_memory(70 * GIB, free, total, "cuda:0") == 70 * GIB
    with pytest.raises(SwarmUserError, match="does not fit on cuda:0.*--memory auto"):
        usable_memory(76 * GIB, free, total, "cuda:0")
    with pytest.raises(SwarmUserError, match="only 0.30 GiB free"):
        usable_memory(None, int(0.3 * GIB), 8 * GIB, "cuda:0")


def test_memory_auto_on_cpu_uses_available_ram():
    cpu = torch.device("cpu")
    budget = server_memory_budget(None, cpu)
    assert 0 < budget
    assert server_memory_budget(3 * GIB, cpu) == 3 * GIB  # explicit on CPU: the operator decides


def _server_args(model_dir, *extra):
    return build_parser().parse_args(
        [str(model_dir), "--initial-peers", "/ip4/127.0.0.1/tcp/1/p2p/QmPeer", "--blocks", "0:2", *extra]
    )


def test_server_flags_resolve_to_a_config(llama_dir):
    config = config_from_args(_server_args(llama_dir, "--memory", "1GB"))
    if torch.cuda.is_available():  # auto: the first GPU, in the checkpoint's 16-bit dtype or bfloat16
        assert config.device.startswith("cuda") and config.dtype in ("float16", "bfloat16")
    else:
        assert (config.device, config.dtype) == ("cpu", "float32")
    assert config.quant == "none"
    config = config_from_args(_server_args(llama_dir, "--memory", "auto", "--dtype", "bfloat16"))
    assert config.dtype == "bfloat16" and config.memory_bytes > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error a machine without a GPU gives")
@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--quant", "nf4"], "--quant nf4 needs a CUDA GPU"),
        (["--device", "cuda"], "torch sees no CUDA GPU"),
        (["--memory", "lots"], "is not a size"),
    ],
)
def test_server_cli_explains_bad_hardware_flags(llama_dir, flags, message, capsys):
    memory = [] if "--memory" in flags else ["--memory", "1GB"]
    argv = [str(llama_dir), "--initial-peers", "/ip4/127.0.0.1/tcp/1"]
    with pytest.raises(SystemExit) as exit_info:  # in this process: it fails before starting anything
        server_cli.main(argv + memory + flags)
    assert exit_info.value.code not in (0, None)
    assert message in capsys.readouterr().err
