"""The decode-step experiment of benchmarks/families/decode_step_profile.py stays right on the CPU: its
fused plain-torch step (one QKV and one gate/up product, static caches) equals the span's own blocks,
with multi-head and grouped-query attention. Only its timings need a GPU."""

from __future__ import annotations

import pytest
import torch

import benchmarks.families.decode_step_profile as experiment
from llm_swarm.swarm.models.span import load_span
from llm_swarm.swarm.models.tiny import TinyModelSpec, build_tiny_model


@pytest.mark.parametrize("kv_heads", [None, 2])
def test_the_fused_step_equals_the_span(tmp_path, monkeypatch, kv_heads):
    monkeypatch.setattr(experiment, "DEVICE", "cpu")
    monkeypatch.setattr(experiment, "DTYPE", torch.float32)
    spec = TinyModelSpec(
        family="llama", num_layers=3, hidden_size=64, num_heads=4, num_kv_heads=kv_heads, intermediate_size=96
    )
    build_tiny_model(tmp_path, spec)
    span, _ = load_span(tmp_path, 0, 3, dtype=torch.float32, device="cpu")
    torch.manual_seed(0)
    assert experiment.fused_error(span, experiment.FusedBlocks(span, 64)) < 1e-5
