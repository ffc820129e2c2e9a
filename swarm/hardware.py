"""Which device and dtype a process computes in, and how much memory a server may really budget.

Resolving `auto` and checking what the user asked for are pure functions of the facts they are
given (`DeviceFacts`, free/total bytes), so every rule is testable without a GPU; `probe_device`
and `probe_memory` are the only parts that ask torch about the machine.

Memory (eq. 2 of docs/reference.md 2 wants the budget `M_j` that blocks and attention caches may
fill): on CUDA the free memory torch reports is what is left *after* this process's CUDA context (a
few hundred MB that no tensor accounts for), and the caching allocator needs headroom for
fragmentation and for the transient activations of a step (attention scores and MLP intermediates
of a long prefill). So a GPU server budgets `free - headroom`, and `--memory X` larger than that is
an error now rather than an out-of-memory crash under load later.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llm_swarm.swarm.dtypes import DTYPES, parse_dtype
from llm_swarm.swarm.errors import SwarmUserError

DTYPE_CHOICES = ("auto", *DTYPES)
MIN_HEADROOM_BYTES = 512 * 2**20  # allocator slack + activations of one step, at least
HEADROOM_FRACTION = 0.05  # ... or this share of the device's memory, whichever is larger


@dataclass(frozen=True)
class DeviceFacts:
    """What torch says about this machine (see `probe_device`)."""

    cuda_devices: int = 0
    bf16_supported: bool = False  # on the CUDA device that would be used


def probe_device() -> DeviceFacts:
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return DeviceFacts(cuda_devices=count, bf16_supported=count > 0 and torch.cuda.is_bf16_supported())


def resolve_device(name: str, facts: DeviceFacts) -> torch.device:
    """`auto` is the first CUDA GPU if there is one, else the CPU; `cuda[:N]` must exist."""
    text = name.strip().lower()
    if text == "auto":
        return torch.device("cuda:0" if facts.cuda_devices else "cpu")
    try:
        device = torch.device(text)
    except RuntimeError:
        raise SwarmUserError(f"unknown device {name!r}; choose auto, cpu, cuda or cuda:N") from None
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise SwarmUserError(f"unsupported device {name!r}; choose auto, cpu, cuda or cuda:N")
    if not facts.cuda_devices:
        raise SwarmUserError(
            f"--device {name} but torch sees no CUDA GPU (torch {torch.__version__}, "
            f"CUDA build: {torch.version.cuda or 'no'}); use --device cpu or auto"
        )
    index = device.index or 0
    if index >= facts.cuda_devices:
        raise SwarmUserError(f"--device {name}: only {facts.cuda_devices} CUDA device(s) are visible")
    return torch.device("cuda", index)


def resolve_dtype(
    name: str, device: torch.device, facts: DeviceFacts, checkpoint_dtype: str | None = None
) -> torch.dtype:
    """`auto`: float32 on CPU (16-bit matrix products are slow there); on CUDA the checkpoint's own
    16-bit dtype, else bfloat16 where the GPU supports it, else float16."""
    if name != "auto":
        dtype = parse_dtype(name)
        if dtype == torch.bfloat16 and device.type == "cuda" and not facts.bf16_supported:
            raise SwarmUserError("--dtype bfloat16: this GPU does not support bfloat16; use float16")
        return dtype
    if device.type != "cuda":
        return torch.float32
    if checkpoint_dtype in ("float16", "bfloat16"):
        if checkpoint_dtype == "float16" or facts.bf16_supported:
            return DTYPES[checkpoint_dtype]
    return torch.bfloat16 if facts.bf16_supported else torch.float16


def checkpoint_dtype_name(config) -> str | None:
    """The dtype a Hugging Face config says its weights are stored in (`dtype`; transformers maps the
    older `torch_dtype` key onto it, and reading `torch_dtype` itself prints a deprecation notice)."""
    value = getattr(config, "dtype", None)
    if isinstance(value, torch.dtype):
        value = str(value).removeprefix("torch.")
    return value if isinstance(value, str) else None


def headroom_bytes(total_bytes: int) -> int:
    return max(MIN_HEADROOM_BYTES, int(HEADROOM_FRACTION * total_bytes))


def usable_memory(requested: int | None, free_bytes: int, total_bytes: int, where: str) -> int:
    """The budget `M_j` a server may fill with blocks and caches on a device with `free_bytes` free
    (after this process's CUDA context) of `total_bytes`. `requested` None means `--memory auto`:
    everything free but the headroom. An explicit request must fit under the same limit."""
    headroom = headroom_bytes(total_bytes)
    available = free_bytes - headroom
    if requested is None:
        if available <= 0:
            raise SwarmUserError(
                f"--memory auto: {where} has only {free_bytes / 2**30:.2f} GiB free, less than the "
                f"{headroom / 2**30:.2f} GiB kept for the allocator and activations"
            )
        return available
    if requested > available:
        raise SwarmUserError(
            f"--memory {requested / 2**30:.2f} GiB does not fit on {where}: {free_bytes / 2**30:.2f} GiB "
            f"are free of {total_bytes / 2**30:.2f} GiB, and {headroom / 2**30:.2f} GiB stay free for "
            f"fragmentation and activations; use --memory auto (= {max(available, 0) / 2**30:.2f} GiB) "
            "or a smaller value"
        )
    return requested


def probe_memory(device: torch.device) -> tuple[int, int]:
    """(free, total) bytes of `device`: CUDA after creating this process's context; for the CPU,
    the memory the kernel says is available without swapping, and the machine's total."""
    if device.type == "cuda":
        torch.cuda.init()
        free, total = torch.cuda.mem_get_info(device)
        return int(free), int(total)
    import psutil  # a hivemind dependency

    memory = psutil.virtual_memory()
    return int(memory.available), int(memory.total)


def server_memory_budget(requested: int | None, device: torch.device) -> int:
    """`--memory` (None: auto) checked against, or derived from, what `device` has free."""
    if requested is not None and device.type == "cpu":
        return requested  # the CPU shares memory with everything else: trust the operator
    free, total = probe_memory(device)
    return usable_memory(requested, free, total, where=str(device))


def prepare_attention_kernels(device: torch.device) -> None:
    """Keep PyTorch's cuDNN attention out of the swarm's decode path on CUDA.

    `scaled_dot_product_attention` prefers cuDNN on Hopper GPUs, and cuDNN builds an execution
    graph for every new key length: every decode step has a new one, and the build costs ~50 ms of
    CPU per block (measured on an H100, against ~1.5 ms for the step itself with flash/memory-
    efficient attention). The other backends handle any length without per-shape set-up.
    Process-wide, and a no-op on the CPU.
    """
    if device.type == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(False)
