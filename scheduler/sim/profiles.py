"""Profiled hardware and model constants used by the scenarios (all times in seconds, sizes in bytes).

Paper 000 (section 4.1, Table 2) runs BLOOM-176B in NF4 on A100-80GB GPUs and MIG 1g slices; the
decode times `tau` and memory budgets are those of SPEC 7. SPEC gives no prefill times or RTT
overheads, so we take the authors' published profile (their released simulator), which is linear
in the input length: per-block prefill `0.0743*l_in + 32.99` ms (A100) and `0.1041*l_in + 206.35`
ms (MIG). Memory budgets are read as GiB: that is the reading under which SPEC 3.3's PETALS block
count gives the 53 blocks per A100 and 4 per MIG that paper 000 reports.

Paper 001's experiment (Table 1) serves LLaMA-2-7B on MIG 3g.40gb / 2g.20gb slices; the paper
gives no per-block times for that model, so the ones below are our estimates from its footnote 11
(`tau ~ s_m / memory bandwidth` plus ~1 ms overhead; prefill compute-bound). They are assumptions.
"""

from __future__ import annotations

from dataclasses import dataclass

from swarm.cost import cache_bytes_per_block

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
        """SPEC 2: `s_c = 2 * d_kv * (l_in + l_out) * dtype_bytes` (keys and values, 16-bit cache)."""
        return cache_bytes_per_block(self.kv_dim, l_in + l_out, self.dtype_bytes)

    def embedding_bytes(self) -> int:
        """Bytes of one hidden-state vector on the wire (16-bit activations)."""
        return self.hidden_size * self.dtype_bytes


# Paper 000: s_m = 2466437120 parameters * 4.25 bits (NF4 with scales) * 1.01 = 1.3234e9 bytes.
BLOOM_176B = ModelProfile("bloom-176b", 70, 1.3234e9, 14336, 14336)
# LLaMA-2-7B in fp16: 202 M parameters per block; multi-head attention, so d_kv = hidden size.
LLAMA_2_7B = ModelProfile("llama-2-7b", 32, 202_383_360 * 2, 4096, 4096)

A100 = GpuProfile("A100", 79.13 * GIB, 3.2197 * MS, 32.99 * MS, 0.0743 * MS)
MIG_1G = GpuProfile("MIG-1g", 8.2 * GIB, 16.2488 * MS, 206.3547 * MS, 0.1041 * MS)
# Paper 001 section 4.2: 3 x 3g.40gb + 6 x 2g.20gb (our LLaMA-2-7B timing estimates, see above).
MIG_3G = GpuProfile("MIG-3g.40gb", 40 * GIB, 1.6 * MS, 4.0 * MS, 0.006 * MS)
MIG_2G = GpuProfile("MIG-2g.20gb", 20 * GIB, 2.4 * MS, 6.0 * MS, 0.009 * MS)

# Per-message overhead (serialization, framing) added to every network round trip: PETALS' own
# router assumes 18 ms (SPEC 3.3) and paper 001 section 4.1.1 adds the same 18 ms to RIPE RTTs.
# With it an inter-cluster embedding round trip costs ~0.12 s, as paper 000 section 4.2.1 states.
MESSAGE_OVERHEAD_S = 0.018
