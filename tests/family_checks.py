"""Checks every model family's tests make the same way (`test_llama_like_families.py`,
`test_falcon_family.py`): in-process spans generate what local transformers generates, and a span
loads only the shards that hold its blocks."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from llm_swarm.client.backend import LocalSpans
from llm_swarm.client.model import DistributedModelForCausalLM
from llm_swarm.swarm.models import load_span

PROMPT = torch.tensor([[5, 17, 99, 200, 33, 41, 7]])
PADDED_TEXTS = ["A cat sat on a mat", "one two"]


def assert_spans_generate_like_transformers(
    model_dir: Path, layers: int, new_tokens: int, padded_new_tokens: int
):
    """Spans `[0, 1)` and `[1, layers)` in process: greedy and beam search, then a left-padded batch,
    each token for token what local transformers generates."""
    reference = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    spans = [load_span(model_dir, 0, 1)[0], load_span(model_dir, 1, layers)[0]]
    model = DistributedModelForCausalLM.from_local_parts(model_dir, LocalSpans(spans))
    for options in ({"do_sample": False}, {"do_sample": False, "num_beams": 3}):
        expected = reference.generate(PROMPT, max_new_tokens=new_tokens, **options)
        assert torch.equal(model.generate(PROMPT, max_new_tokens=new_tokens, **options), expected), options
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    batch = tokenizer(PADDED_TEXTS, return_tensors="pt", padding=True, padding_side="left")
    assert not batch["attention_mask"].all()  # the batch is padded: positions count without it
    expected = reference.generate(**batch, max_new_tokens=padded_new_tokens, do_sample=False)
    assert torch.equal(model.generate(**batch, max_new_tokens=padded_new_tokens, do_sample=False), expected)


def assert_a_span_loads_only_its_own_shards(model_dir: Path, block_prefix: str):
    """Block 1 alone opens only the shards holding tensors named `{block_prefix}1.`; returns the span."""
    weight_map = json.loads((model_dir / "model.safetensors.index.json").read_text())["weight_map"]
    expected = {file for name, file in weight_map.items() if name.startswith(f"{block_prefix}1.")}
    span, files = load_span(model_dir, 1, 2)
    assert set(files) == expected and len(expected) < len(set(weight_map.values()))
    assert span.num_blocks == 1
    return span
