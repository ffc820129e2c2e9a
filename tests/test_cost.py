"""Block and cache sizes come from the loaded modules and match docs/reference.md section 2."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from llm_swarm.swarm.cost import HopCost, cache_bytes_per_block, cache_slots, kv_dim, request_time
from llm_swarm.swarm.models import load_span


def test_block_bytes_equal_the_parameter_bytes_of_one_block(bloom_dir, llama_dir):
    for model_dir, blocks_of in [
        (bloom_dir, lambda m: m.transformer.h),
        (llama_dir, lambda m: m.model.layers),
    ]:
        reference = AutoModelForCausalLM.from_pretrained(model_dir).eval()
        expected = sum(p.numel() * 4 for p in blocks_of(reference)[3].parameters())
        span, _ = load_span(model_dir, 3, 5)
        assert span.block_bytes == expected
        half, _ = load_span(model_dir, 3, 5, dtype="bfloat16")
        assert half.block_bytes == expected // 2


def test_cache_bytes_follow_the_formula_also_for_gqa(bloom_dir, llama_dir):
    bloom, _ = load_span(bloom_dir, 0, 1)
    llama, _ = load_span(llama_dir, 0, 1)
    # BLOOM: multi-head attention caches the whole hidden size (64)
    assert bloom.cache_bytes(num_tokens=27) == 2 * 64 * 27 * 4
    # LLaMA-GQA: 2 KV heads of dim 16 -> d_kv = 32, half the hidden size
    assert kv_dim(64, 4, 2) == 32
    assert llama.cache_bytes(num_tokens=27) == 2 * 32 * 27 * 4
    assert llama.cache_bytes(num_tokens=27, batch_size=3) == 3 * 2 * 32 * 27 * 4
    # the cache a session actually allocates is exactly what the formula charges
    cache = llama.new_cache(batch_size=3, max_length=27)
    assert cache.nbytes == llama.cache_bytes(27, batch_size=3)
    half, _ = load_span(llama_dir, 0, 1, dtype="float16")
    assert half.cache_bytes(num_tokens=10) == 2 * 32 * 10 * 2


def test_spec_formulas():
    assert cache_bytes_per_block(14336, 20 + 128, 2) == 2 * 14336 * 148 * 2
    assert cache_slots(memory_bytes=100, block_bytes=20, num_blocks=3, cache_bytes=7) == 5
    assert cache_slots(memory_bytes=50, block_bytes=20, num_blocks=3, cache_bytes=7) == 0
    hops = [
        HopCost(rtt=0.01, rtt_prefill=0.02, tau=0.001, tau_prefill=0.004, num_blocks=3),
        HopCost(rtt=0.05, rtt_prefill=0.06, tau=0.002, tau_prefill=0.01, num_blocks=2),
    ]
    expected = (0.02 + 3 * 0.004 + 0.06 + 2 * 0.01) + 9 * (0.01 + 3 * 0.001 + 0.05 + 2 * 0.002)
    assert request_time(hops, l_out=10) == pytest.approx(expected)
    with pytest.raises(ValueError):
        request_time(hops, l_out=0)
    assert torch.empty(0).element_size() == 4
