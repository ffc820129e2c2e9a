"""`hetero`: a heterogeneous swarm for prefill/decode roles, and Poisson arrivals with
the Azure code trace's lengths.

Two A100-80GB and six 24 GB GPUs of an older generation (a Tesla P40's figures) serve a
LLaMA-2-70B-shaped model with grouped-query attention (80 blocks, hidden 8192, 8 KV heads of 128,
so 4 KB of cache per token per block) in NF4. Times follow Sun, He and Hou's footnote 11 (per block:
prefill `t_o + F/f` per token, decode `s_m/b` per token, `t_o` = 1 ms) with each GPU's nominal
figures: A100 312 TFLOPS and 2.04 TB/s; the older card 12 TFLOPS (no fast half precision) and
347 GB/s. So the older cards decode at a sixth of an A100's speed but prefill at a twenty-sixth:
the case for running their prompts elsewhere (Splitwise, DistServe). The client is 20 ms from every
server over 1 Gbit/s; the servers' links between themselves are the experiment's variable
(`--link-mbps`, `--link-rtt-ms`), and `--roles` decides who takes prompts only.
"""

from __future__ import annotations

import numpy as np

from llm_swarm.scheduler.sim import profiles
from llm_swarm.scheduler.sim.profiles import GIB, GpuProfile, ModelProfile
from llm_swarm.scheduler.sim.scenarios import Link, Scenario, build_scenario
from llm_swarm.scheduler.sim.workload import Request, TraceRecord

PARAMETERS_PER_BLOCK = 856_000_000  # LLaMA-2-70B: attention 151 M (GQA) + MLP 705 M per block
# NF4 with its scales, read as Sun et al. reads BLOOM's (4.25 bits per parameter, 1% overhead)
LLAMA_2_70B_NF4 = ModelProfile("llama-2-70b-nf4", 80, PARAMETERS_PER_BLOCK * 4.25 / 8 * 1.01, 8192, 1024)


def footnote11(name: str, memory_bytes: float, tflops: float, gb_per_ms: float) -> GpuProfile:
    """Sun, He and Hou footnote 11 for this model: decode `s_m/b`, prefill `t_o + 2*params/f` per token."""
    return GpuProfile(
        name,
        memory_bytes,
        tau=LLAMA_2_70B_NF4.block_bytes / (gb_per_ms * 1e9) * profiles.MS,
        prefill_base=profiles.FOOTNOTE11_OVERHEAD_S,
        prefill_per_token=2 * PARAMETERS_PER_BLOCK / (tflops * 1e12),
    )


A100_80GB = footnote11("A100-80GB", 79.13 * GIB, tflops=312, gb_per_ms=2.04)
OLDER_24GB = footnote11("P40-24GB", 22.4 * GIB, tflops=12, gb_per_ms=0.347)
HETERO_GPUS = (A100_80GB,) * 2 + (OLDER_24GB,) * 6
CLIENT_LINK = Link(0.020, 1e9)


def hetero(l_in: int, l_out: int) -> Scenario:
    """The swarm above; every server is `both` (colocated) until `--roles` says otherwise."""
    links = [CLIENT_LINK] * len(HETERO_GPUS)
    return build_scenario("hetero", LLAMA_2_70B_NF4, HETERO_GPUS, links, l_in, l_out)


def poisson_trace_lengths(
    rate: float,
    count: int,
    records: list[TraceRecord],
    max_l_in: int | None,
    max_l_out: int | None,
    rng: np.random.Generator,
) -> list[Request]:
    """Poisson arrivals at `rate` (the first at 0) whose lengths are drawn from the trace's records
    (with replacement), each capped where a cap is given: the trace's mix of prompts and answers
    at any load, so that a goodput search can vary the rate."""
    if not rate > 0 or count < 0 or not records:
        raise ValueError(f"need rate > 0, count >= 0 and trace records, got {rate}, {count}, {len(records)}")
    gaps = rng.exponential(1 / rate, size=count)
    if count:
        gaps[0] = 0.0
    picks = rng.integers(len(records), size=count)
    requests = []
    for i, (t, k) in enumerate(zip(np.cumsum(gaps), picks, strict=True)):
        record = records[int(k)]
        l_in = record.l_in if max_l_in is None else min(record.l_in, max_l_in)
        l_out = record.l_out if max_l_out is None else min(record.l_out, max_l_out)
        requests.append(Request(i, float(t), l_in, l_out))
    return requests
