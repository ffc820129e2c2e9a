"""Profiled hardware and model constants used by the scenarios (all times in seconds, sizes in bytes).

Sun et al. (section 4.1, Table 2) runs BLOOM-176B in NF4 on A100-80GB GPUs and MIG 1g slices; the
decode times `tau` and memory budgets are those of docs/reference.md 7. For prefill times and RTT overheads
we take the authors' published profile (their released simulator), which is linear
in the input length: per-block prefill `0.0743*l_in + 32.99` ms (A100) and `0.1041*l_in + 206.35`
ms (MIG). Memory budgets are read as GiB: that is the reading under which the PETALS block count
(docs/reference.md 3.3) gives the 53 blocks per A100 and 4 per MIG that Sun et al. reports.

Sun, He and Hou's experiment (Table 1) serves LLaMA-2-7B on MIG 3g.40gb / 2g.20gb slices. It prints no
per-block times (its Fig. 9 only validates the shape), so they follow its footnote 11 with the GPU
figures its section 4.1.1 gives for those two slice types: per-block prefill `t_o + t^I*l_in` and
decode `t^O` per token, with `t_o ~ 1 ms`, `t^I = F/f_j` (prefill is compute-bound; F = 2 FLOPs per
parameter) and `t^O = s_m/b_j` (decode is memory-bound); 3g: f = 120 TFLOPS, b = 1.02 GB/ms; 2g:
80 TFLOPS, 0.51 GB/ms. Budgets are the slices' nominal 40 GB / 20 GB (decimal): with the cache
sized for 2048 + 128 tokens that is the reading under which GBP-CR at c = 35 gives the 24 and 12
blocks of Sun, He and Hou's footnote 13 (GiB would give 25 and 13).
"""

from __future__ import annotations

from dataclasses import dataclass

from llm_swarm.swarm.cost import cache_bytes_per_block

GIB = 1024**3
MS = 1e-3


@dataclass(frozen=True)
class GpuProfile:
    """One GPU type: its effective memory budget and per-block decode/prefill times."""

    name: str
    memory_bytes: float
    tau: float  # per-block, per-token decode time
    prefill_base: float  # per-block prefill time = prefill_base + prefill_per_token * l_in
    prefill_per_token: float

    def tau_prefill(self, l_in: int) -> float:
        return self.prefill_base + self.prefill_per_token * l_in


@dataclass(frozen=True)
class ModelProfile:
    """A served model: L blocks of `block_bytes`, hidden size, KV width and cache dtype."""

    name: str
    num_blocks: int
    block_bytes: float
    hidden_size: int
    kv_dim: int
    dtype_bytes: int = 2

    def cache_bytes(self, l_in: int, l_out: int) -> int:
        """docs/reference.md 2: `s_c = 2 * d_kv * (l_in + l_out) * dtype_bytes` (keys and values, 16-bit
        cache)."""
        return cache_bytes_per_block(self.kv_dim, l_in + l_out, self.dtype_bytes)

    def embedding_bytes(self) -> int:
        """Bytes of one hidden-state vector on the wire (16-bit activations)."""
        return self.hidden_size * self.dtype_bytes


# Sun et al.: s_m = 2466437120 parameters * 4.25 bits (NF4 with scales) * 1.01 = 1.3234e9 bytes.
BLOOM_176B = ModelProfile("bloom-176b", 70, 1.3234e9, 14336, 14336)
# LLaMA-2-7B in fp16: 202 M parameters per block; multi-head attention, so d_kv = hidden size.
LLAMA_2_7B = ModelProfile("llama-2-7b", 32, 202_383_360 * 2, 4096, 4096)

A100 = GpuProfile("A100", 79.13 * GIB, 3.2197 * MS, 32.99 * MS, 0.0743 * MS)
MIG_1G = GpuProfile("MIG-1g", 8.2 * GIB, 16.2488 * MS, 206.3547 * MS, 0.1041 * MS)


def footnote11_profile(
    name: str, memory_bytes: float, model: ModelProfile, tflops: float, gb_per_ms: float
) -> GpuProfile:
    """Sun, He and Hou, footnote 11: overhead `t_o` per block, prefill `F/f` per token, decode `s_m/b`
    per token."""
    flops_per_token = 2 * model.block_bytes / model.dtype_bytes  # 2 FLOPs per (fp16) parameter
    return GpuProfile(
        name,
        memory_bytes,
        tau=model.block_bytes / (gb_per_ms * 1e9) * MS,
        prefill_base=FOOTNOTE11_OVERHEAD_S,
        prefill_per_token=flops_per_token / (tflops * 1e12),
    )


FOOTNOTE11_OVERHEAD_S = 1 * MS  # t_o
# Sun, He and Hou, section 4.2.1: 3 x 3g.40gb + 6 x 2g.20gb, GPU figures from its section 4.1.1.
MIG_3G = footnote11_profile("MIG-3g.40gb", 40e9, LLAMA_2_7B, tflops=120, gb_per_ms=1.02)
MIG_2G = footnote11_profile("MIG-2g.20gb", 20e9, LLAMA_2_7B, tflops=80, gb_per_ms=0.51)

# Per-message overhead (serialization, framing) added to every network round trip: PETALS' own
# router assumes 18 ms (docs/reference.md 3.3) and Sun, He and Hou (section 4.1.1) add the same 18 ms
# to RIPE RTTs.
# With it an inter-cluster embedding round trip costs ~0.12 s, as Sun et al., section 4.2.1 states.
MESSAGE_OVERHEAD_S = 0.018
