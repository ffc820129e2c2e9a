"""Spans run one after another with their own KV caches reproduce the full transformers model."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from llm_swarm.swarm.models import load_client_parts, load_span

PREFILL_TOKENS = 7
DECODE_STEPS = 20
SPLITS = [
    [(0, 6)],
    [(0, 1), (1, 6)],  # single-block span first
    [(0, 3), (3, 6)],
    [(0, 5), (5, 6)],  # single-block span last
    [(0, 2), (2, 3), (3, 6)],
]


def reference_run(model_dir, prompt: torch.Tensor):
    """Greedy tokens and per-position logits of the whole model, computed by transformers."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        sequence = model.generate(prompt, max_new_tokens=DECODE_STEPS + 1, do_sample=False)
        logits = model(sequence).logits
    return sequence, logits


def span_run(model_dir, prompt: torch.Tensor, split):
    client = load_client_parts(model_dir)
    spans = [load_span(model_dir, start, end)[0] for start, end in split]
    caches = [span.new_cache(batch_size=prompt.shape[0], max_length=64) for span in spans]
    new_tokens, logits_per_step, position = prompt, [], 0
    for _ in range(DECODE_STEPS + 1):
        hidden = client.embed_tokens(new_tokens)
        for span, cache in zip(spans, caches, strict=True):
            hidden = span(hidden, cache, position)
        logits = client.logits(hidden)
        logits_per_step.append(logits)
        position += new_tokens.shape[1]
        new_tokens = logits[:, -1:].argmax(-1)
    tokens = torch.cat([step[:, -1:].argmax(-1) for step in logits_per_step], dim=1)
    return tokens, torch.cat(logits_per_step, dim=1)


@pytest.mark.parametrize("split", SPLITS, ids=lambda split: "+".join(f"{a}:{b}" for a, b in split))
def test_spans_reproduce_full_model(model_dir, split):
    prompt = torch.randint(4, 500, (1, PREFILL_TOKENS), generator=torch.Generator().manual_seed(1))
    sequence, reference_logits = reference_run(model_dir, prompt)
    tokens, logits = span_run(model_dir, prompt, split)
    assert torch.equal(tokens[0], sequence[0, PREFILL_TOKENS:])
    compared = reference_logits[:, : logits.shape[1]]
    assert (logits - compared).abs().max().item() <= 1e-5


def test_cache_can_cover_the_tail_of_a_span(model_dir):
    """A session entering a server's span mid-way caches (and processes) only the blocks it needs."""
    whole, _ = load_span(model_dir, 0, 6)
    tail, _ = load_span(model_dir, 2, 6)
    hidden = torch.randn(1, 5, whole.hidden_size, generator=torch.Generator().manual_seed(2))
    partial_cache = whole.new_cache(1, 16, first=2, last=6)
    assert partial_cache.num_blocks == 4
    expected = tail(hidden, tail.new_cache(1, 16), 0)
    assert torch.equal(whole(hidden, partial_cache, 0), expected)


def test_replayed_step_overwrites_the_cache(model_dir):
    """Writing at a position already cached discards what followed: retries and replays are safe."""
    span, _ = load_span(model_dir, 0, 6)
    generator = torch.Generator().manual_seed(3)
    prefill = torch.randn(2, 4, span.hidden_size, generator=generator)
    step = torch.randn(2, 1, span.hidden_size, generator=generator)
    cache = span.new_cache(2, 16)
    span(prefill, cache, 0)
    first = span(step, cache, 4)
    span(torch.randn(2, 1, span.hidden_size, generator=generator), cache, 5)
    assert cache.length == 6
    again = span(step, cache, 4)
    assert cache.length == 5
    assert torch.equal(first, again)


def test_steps_past_max_length_or_skipping_positions_are_refused(model_dir):
    span, _ = load_span(model_dir, 0, 2)
    cache = span.new_cache(1, 4)
    with pytest.raises(ValueError, match="max_length"):
        span(torch.zeros(1, 5, span.hidden_size), cache, 0)
    with pytest.raises(ValueError, match="outside the cached prefix"):
        span(torch.zeros(1, 1, span.hidden_size), cache, 2)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_spans_match_the_full_model_closely(llama_dir, dtype):
    torch_dtype = getattr(torch, dtype)
    model = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch_dtype).eval()
    prompt = torch.randint(4, 500, (1, PREFILL_TOKENS), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        reference = model(prompt).logits.float()
    client = load_client_parts(llama_dir, dtype=dtype)
    spans = [load_span(llama_dir, 0, 3, dtype=dtype)[0], load_span(llama_dir, 3, 6, dtype=dtype)[0]]
    assert spans[0].blocks[0].mlp.up_proj.weight.dtype == torch_dtype
    hidden = client.embed_tokens(prompt)
    for span in spans:
        hidden = span(hidden, span.new_cache(1, 16), 0)
    logits = client.logits(hidden).float()
    assert torch.allclose(logits, reference, atol=5e-2, rtol=5e-2)
