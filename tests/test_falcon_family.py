"""The Falcon family, every architecture of its one `model_type`: the new decoder
architecture with grouped KV heads from two LayerNorms (Falcon-40B/180B) or one (Falcon-11B),
multi-query with parallel attention (Falcon-7B), and ALiBi with sequential attention and biases
(Falcon-RW). In-process spans give local transformers' tokens (greedy, beam search, a left-padded
batch) and batched decode steps equal steps alone, for every variant; a sharded checkpoint loads only
its span's shards. Through real servers (the default variant, new decoder): greedy, beam search, a
left-padded batch and speculative decoding, concurrent sessions batched on a server equal each
alone, and a session survives its server being killed mid-generation. One swarm serves the
real-server tests: the failover, which kills a server, runs last."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer

from llm_swarm.client import AutoDistributedModelForCausalLM, ClientOptions
from llm_swarm.swarm.dht_keys import default_prefix
from llm_swarm.swarm.models import load_span
from llm_swarm.swarm.models.tiny import FALCON_VARIANTS, TinyModelSpec, build_tiny_model
from tests import family_checks
from tests.family_checks import PROMPT

LAYERS = 4
SHARD = "60KB"


def build_falcon(out_dir: Path, variant: str | None) -> Path:
    """A tiny Falcon whose LayerNorms and biases are random too: at their usual init (ones, zeros)
    `ln_attn` and `ln_mlp` would be interchangeable and unloaded biases would go unnoticed."""
    spec = TinyModelSpec(family="falcon", num_layers=LAYERS, variant=variant)
    model_dir = build_tiny_model(out_dir, spec, max_shard_size=SHARD)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.LayerNorm):
                module.weight.add_(0.2 * torch.randn(module.weight.shape, generator=generator))
            if isinstance(module, (nn.LayerNorm, nn.Linear)) and module.bias is not None:
                module.bias.add_(0.1 * torch.randn(module.bias.shape, generator=generator))
    model.save_pretrained(model_dir, max_shard_size=SHARD)
    return model_dir


@pytest.fixture(scope="module", params=sorted(FALCON_VARIANTS))
def variant_dir(request, tmp_path_factory) -> Path:
    return build_falcon(tmp_path_factory.mktemp(f"falcon-{request.param}") / "model", request.param)


def test_in_process_spans_generate_what_transformers_generates(variant_dir, local_reference):
    family_checks.assert_spans_generate_like_transformers(
        variant_dir, local_reference(variant_dir)[0], LAYERS, new_tokens=12, padded_new_tokens=8
    )


def test_alibi_biases_of_a_padded_batch_are_transformers_own(tmp_path):
    """ALiBi is invariant to where key positions start, up to rounding: Falcon rounds its slopes
    times key positions to bfloat16, counting positions from each row's first real token. With 16
    heads the slopes are not powers of two, so only the same positions and the same rounding give
    transformers' logits (counting from the padding or skipping the rounding is off by ~5e-3)."""
    spec = TinyModelSpec(family="falcon", num_layers=2, num_heads=16, variant="alibi")
    model_dir = build_tiny_model(tmp_path / "model", spec)
    reference = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    texts = ["A cat sat on a mat and then some more words", "one two"]
    batch = tokenizer(texts, return_tensors="pt", padding=True, padding_side="left")
    ids, mask = batch["input_ids"], batch["attention_mask"]
    span, _ = load_span(model_dir, 0, 2)
    cache = span.new_cache(2, ids.shape[1] + 1)
    new_ids, longer = torch.tensor([[40], [41]]), torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], 1)

    def logits(hidden: torch.Tensor) -> torch.Tensor:
        return reference.lm_head(reference.transformer.ln_f(hidden))

    embed = reference.transformer.word_embeddings
    with torch.no_grad():
        prefill = logits(span(embed(ids), cache, 0, mask))
        step = logits(span(embed(new_ids), cache, ids.shape[1], longer))
        expected = reference(torch.cat([ids, new_ids], 1), attention_mask=longer).logits
    real = mask.bool()
    assert torch.allclose(prefill[real], expected[:, :-1][real], atol=1e-5, rtol=0)
    assert torch.allclose(step[:, -1], expected[:, -1], atol=1e-5, rtol=0)


def test_batched_decode_steps_equal_steps_alone(variant_dir):
    """Sessions of different lengths (one a left-padded batch) in one batched step: per-session
    positions, rotary angles or ALiBi biases and masks, each reading its own cache."""
    span, _ = load_span(variant_dir, 0, LAYERS)
    generator = torch.Generator().manual_seed(2)
    lengths, batches = [3, 9, 5], [1, 1, 2]
    padding = torch.ones(2, lengths[2] + 1, dtype=torch.long)
    padding[1, :2] = 0  # the padded session's second row starts two positions late
    masks = [None, None, padding]
    caches, tokens = [], []
    for length, batch, mask in zip(lengths, batches, masks, strict=True):
        cache = span.new_cache(batch, 16)
        prompt = torch.randn(batch, length, span.hidden_size, generator=generator)
        span(prompt, cache, 0, None if mask is None else mask[:, :length])
        caches.append(cache)
        tokens.append(torch.randn(batch, 1, span.hidden_size, generator=generator))
    copies = [span.new_cache(cache.batch_size, 16) for cache in caches]
    for copy, cache in zip(copies, caches, strict=True):  # the same history, for the steps alone
        for layer in range(cache.num_blocks):
            copy.keys[layer].copy_(cache.keys[layer])
            copy.values[layer].copy_(cache.values[layer])
        copy.length = cache.length
    batched = span.forward_batch(
        [
            (token, cache, length, mask)
            for token, cache, length, mask in zip(tokens, caches, lengths, masks, strict=True)
        ]
    )
    for index, (token, copy) in enumerate(zip(tokens, copies, strict=True)):
        alone = span(token, copy, lengths[index], masks[index])
        assert torch.allclose(batched[index], alone, atol=1e-5), index


def test_a_span_loads_only_its_own_shards(variant_dir):
    span = family_checks.assert_a_span_loads_only_its_own_shards(variant_dir, "transformer.h.")
    # one cached key and value per KV head, not one per query head as transformers caches them
    config = span.config
    kv_heads = config.num_attention_heads
    if config.new_decoder_architecture or config.multi_query:
        kv_heads = config.num_kv_heads if config.new_decoder_architecture else 1
    assert span.new_cache(1, 8).keys[0].shape == (1, kv_heads, 8, span.head_dim)


# --- real servers: the default variant -----------------------------------------------------------------
@pytest.fixture(scope="module")
def default_dir(tmp_path_factory) -> Path:
    return build_falcon(tmp_path_factory.mktemp("falcon-default") / "model", None)


@pytest.fixture(scope="module")
def reference(default_dir, local_reference):
    return local_reference(default_dir)[0]


@pytest.fixture(scope="module")
def served(tmp_path_factory, default_dir):
    """Servers a (0:2), a2 (0:2) and b (2:4), and a client of them; b is on every chain."""
    from harness.local_swarm import LocalSwarm  # imported here: it pulls in hivemind, which takes seconds

    swarm = LocalSwarm(tmp_path_factory.mktemp("falcon-swarm"))
    swarm.start_dht()
    model = None
    try:
        batching = ("--batch-wait-ms", "5", "--metrics-port", "0")
        for name, blocks in (("a", "0:2"), ("b", "2:4"), ("a2", "0:2")):
            swarm.start_server(name, default_dir, blocks, "1GB", *batching)
        swarm.wait_online(default_prefix(str(default_dir)), LAYERS, ["a", "b", "a2"])
        options = ClientOptions(request_timeout=20.0, ban_base=60.0, wait_for_servers=30.0)
        model = AutoDistributedModelForCausalLM.from_pretrained(
            default_dir, swarm.initial_peers, options=options
        )
        yield swarm, model
    finally:
        if model is not None:
            model.shutdown()
        assert not swarm.close(), "process groups left running"


@pytest.mark.swarm
@pytest.mark.compat
def test_real_servers_generate_what_transformers_generates(served, reference, default_dir):
    _swarm, model = served
    family_checks.assert_generates_like_transformers(model, reference, default_dir, 12, 8, speculative=True)


@pytest.mark.swarm
def test_concurrent_sessions_batched_on_a_server_equal_each_alone(served, reference):
    from harness.local_swarm import prometheus_sample

    swarm, model = served
    before = swarm.metrics("b")
    family_checks.assert_concurrent_sessions_equal_each_alone(
        model, reference, [PROMPT[:, : 3 + k] for k in range(4)], 12
    )
    # b serves every chain: some of its decode iterations ran several sessions' steps at once
    after = swarm.metrics("b")
    name = "swarm_server_decode_batch_steps"

    def batched(metrics: str) -> float:
        alone = prometheus_sample(metrics, f"{name}_bucket", 'le="1.0"')
        return prometheus_sample(metrics, f"{name}_count") - alone

    assert batched(after) > batched(before)


@pytest.mark.swarm
def test_failover_mid_generation_continues_exactly(served, reference):
    """Runs last: it kills the first server of the session's chain between two generate() calls."""
    swarm, model = served
    family_checks.assert_failover_mid_generation_is_exact(swarm, model, reference)
