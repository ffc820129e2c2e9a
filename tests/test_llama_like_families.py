"""Families with LLaMA's layout: Qwen2 (q/k/v biases), Qwen3 (q/k norms), Mistral (a sliding
window), Mixtral and Qwen3-MoE (a mixture of experts in every block), Gemma 2 and 3 (sliding and
full layers alternating, soft-capped logits, scaled embeddings; Gemma 3 a local rotary table),
GPT-OSS (alternating layers, attention sinks, biased experts) and DeepSeek-V2 and V3 (latent
attention caching its compressed latent, dense first blocks, routed and shared experts).

In-process spans and real servers give local transformers' tokens (greedy, beam search, a left-padded
batch, speculative decoding); concurrent sessions batched on a server equal each alone; a session
survives its server being killed; a sharded checkpoint loads only its span's shards; sliding windows
are exact past their end and past the ring their blocks keep, in process and through real servers,
across a hand-off."""

from __future__ import annotations

import json
import shutil
import signal
import time

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, DynamicCache
from transformers.integrations.mxfp4 import FP4_VALUES

from llm_swarm.client import AutoDistributedModelForCausalLM, ClientOptions
from llm_swarm.client.backend import LocalSpans
from llm_swarm.client.model import DistributedModelForCausalLM
from llm_swarm.swarm.cost import REWIND_RESERVE, module_parameter_bytes
from llm_swarm.swarm.dht_keys import default_prefix
from llm_swarm.swarm.errors import CheckpointError, UnsupportedModelError
from llm_swarm.swarm.models import load_span
from llm_swarm.swarm.models.tiny import FAMILIES as TINY_FAMILIES
from llm_swarm.swarm.models.tiny import TinyModelSpec, build_tiny_model
from llm_swarm.swarm.transformers_compat import GENERATE_CACHE_ARGUMENT
from tests.family_checks import (
    PROMPT,
    REPEATING_PROMPT,
    assert_a_span_loads_only_its_own_shards,
    assert_concurrent_sessions_equal_each_alone,
    assert_failover_mid_generation_is_exact,
    assert_generates_like_transformers,
    assert_spans_generate_like_transformers,
)

LAYERS = 4


FAMILIES = [family for family in TINY_FAMILIES if family not in ("llama", "bloom", "falcon")]
LATENT_ATTENTION = ("deepseek_v2", "deepseek_v3")  # no grouped heads, no sliding window


# the families whose real-server test the compatibility leg also runs (every family's in-process tests
# run there): those whose code differs between transformers majors, fused experts (Mixtral,
# Qwen3-MoE), Gemma 2's soft-capped kernel, GPT-OSS's sinks and MXFP4, DeepSeek-V3's latents and FP8
COMPAT_FAMILIES = ("mixtral", "qwen3_moe", "gemma2", "gpt_oss", "deepseek_v3")


@pytest.fixture(
    scope="module",
    params=[pytest.param(f, marks=pytest.mark.compat) if f in COMPAT_FAMILIES else f for f in FAMILIES],
)
def family_dir(request, tmp_path_factory):
    kv_heads = None if request.param in LATENT_ATTENTION else 2
    spec = TinyModelSpec(family=request.param, num_layers=LAYERS, num_kv_heads=kv_heads)
    return build_tiny_model(tmp_path_factory.mktemp(request.param) / "model", spec, max_shard_size="60KB")


def test_in_process_spans_generate_what_transformers_generates(family_dir, local_reference):
    reference = local_reference(family_dir)[0]
    assert_spans_generate_like_transformers(family_dir, reference, LAYERS, new_tokens=10, padded_new_tokens=8)


def test_a_span_loads_only_its_own_shards(family_dir):
    assert_a_span_loads_only_its_own_shards(family_dir, "model.layers.")


def test_sliding_windows_are_exact_past_the_window_or_refused(family_dir, tmp_path):
    """A window of 4 positions (Mistral and Mixtral: every block; Qwen2 and Qwen3: the blocks their
    `layer_types` make sliding, here every other one, as Gemma's and GPT-OSS's tiny configs have
    them): a sliding block keeps a ring of 3 + REWIND_RESERVE positions and masks the keys outside
    the window, so generating past the ring equals local transformers (alone and in a left-padded
    batch), and a batched decode step of sessions inside the window, past it and past the ring equals
    each session alone. Qwen3-MoE's windows are refused."""
    copy = tmp_path / "windowed"
    shutil.copytree(family_dir, copy)
    config = json.loads((copy / "config.json").read_text())
    if config["model_type"] in LATENT_ATTENTION:
        pytest.skip(f"{config['model_type']} has no sliding attention")
    config.update(use_sliding_window=True, sliding_window=4)
    if config["model_type"] in ("qwen2", "qwen3"):
        layer_types = ["full_attention", "sliding_attention"] * (LAYERS // 2)
        config.update(layer_types=layer_types, max_window_layers=1)
    (copy / "config.json").write_text(json.dumps(config))
    if config["model_type"] == "qwen3_moe":
        with pytest.raises(UnsupportedModelError, match="sliding-window"):
            load_span(copy, 0, 1)
        return
    reference = AutoModelForCausalLM.from_pretrained(copy).eval()
    spans = [load_span(copy, 0, 1)[0], load_span(copy, 1, LAYERS)[0]]
    assert spans[0].family.longest_session(spans[0].config) is None  # no cap on sessions
    ring = 3 + REWIND_RESERVE
    cache = spans[1].new_cache(1, 1000)
    assert {tensor.shape[2] for tensor in cache.keys} == (
        {ring} if config["model_type"] in ("mistral", "mixtral") else {ring, 1000}
    )
    assert spans[1].session_cache_bytes(1, 1000, 1, LAYERS) == cache.nbytes
    model = DistributedModelForCausalLM.from_local_parts(copy, LocalSpans(spans))
    new = ring + 4 - PROMPT.shape[1]  # the session passes its ring
    expected = reference.generate(PROMPT, max_new_tokens=new, do_sample=False)
    assert torch.equal(model.generate(PROMPT, max_new_tokens=new, do_sample=False), expected)
    unwindowed = AutoModelForCausalLM.from_pretrained(family_dir).eval()
    assert not torch.allclose(unwindowed(expected).logits, reference(expected).logits)  # the window matters
    tokenizer = AutoTokenizer.from_pretrained(copy)
    texts = ["one two", "A cat sat on a mat"]
    batch = tokenizer(texts, return_tensors="pt", padding=True, padding_side="left")
    expected = reference.generate(**batch, max_new_tokens=new, do_sample=False)
    assert torch.equal(model.generate(**batch, max_new_tokens=new, do_sample=False), expected)
    assert_batched_step_equals_steps_alone(spans[1], (3, 9, ring + 2))


def assert_batched_step_equals_steps_alone(span, lengths: tuple[int, ...] = (3, 9)) -> None:
    """Sessions of `lengths` positions (for windows of 4: inside them, past them, and past the ring)
    take one more step together in one batched forward, and each gets what its step alone gives."""
    generator = torch.Generator().manual_seed(0)
    prefixes = [torch.randn(1, length, span.hidden_size, generator=generator) for length in lengths]
    tokens = [torch.randn(1, 1, span.hidden_size, generator=generator) for _ in prefixes]
    alone, caches = [], []
    for prefix in prefixes:
        for destination in (alone, caches):
            cache = span.new_cache(1, max(lengths) + 8)
            span(prefix, cache, 0)
            destination.append(cache)
    expected_steps = [span(token, cache, cache.length) for token, cache in zip(tokens, alone, strict=True)]
    batched = span.forward_batch(
        [(token, cache, cache.length, None) for token, cache in zip(tokens, caches, strict=True)]
    )
    for output, expected_step in zip(batched, expected_steps, strict=True):
        torch.testing.assert_close(output, expected_step, rtol=1e-5, atol=1e-5)


@pytest.mark.swarm
def test_real_servers_batching_and_failover(swarm, family_dir, local_reference):
    prefix = default_prefix(str(family_dir))
    swarm.start_server("a", family_dir, "0:2")
    swarm.start_server("b", family_dir, "2:4")
    swarm.start_server("a2", family_dir, "0:2")
    swarm.wait_online(prefix, LAYERS, ["a", "b", "a2"])
    reference = local_reference(family_dir)[0]
    options = ClientOptions(request_timeout=20.0, ban_base=60.0, wait_for_servers=30.0)
    model = AutoDistributedModelForCausalLM.from_pretrained(family_dir, swarm.initial_peers, options=options)
    try:
        assert_generates_like_transformers(model, reference, family_dir, 10, 8, speculative=True)
        # concurrent sessions: their decode steps batch on the servers, each equals its own run
        assert_concurrent_sessions_equal_each_alone(
            model, reference, [PROMPT[:, : 3 + k] for k in range(4)], 12
        )
        assert_failover_mid_generation_is_exact(swarm, model, reference)
    finally:
        model.shutdown()


@pytest.mark.swarm
def test_real_servers_serve_sessions_past_a_mistral_window(swarm, tmp_path):
    """A tiny Mistral with a window of 6 through real servers: sessions past the window and past the
    ring its blocks keep equal local transformers, alone and batched concurrently on the servers; the
    servers do not cap sessions at the window; a server draining mid-session hands its wrapped ring
    off (only the positions a ring keeps) and generation goes on exactly; a rewind deeper than a
    wrapped ring keeps is refused by the server and replayed by the client on a new session."""
    spec = TinyModelSpec(family="mistral", num_layers=2, num_kv_heads=2)
    model_dir = build_tiny_model(tmp_path / "mistral", spec)
    config = json.loads((model_dir / "config.json").read_text())
    config["sliding_window"] = 6
    (model_dir / "config.json").write_text(json.dumps(config))
    ring = 5 + REWIND_RESERVE
    prefix = default_prefix(str(model_dir))
    swarm.start_server("first", model_dir, "0:1")
    for name in ("second", "second2"):
        swarm.start_server(name, model_dir, "1:2", "1GB", "--drain-timeout", "60")
    swarm.wait_online(prefix, 2, ["first", "second", "second2"])
    assert all(info.max_length > ring for info in swarm.servers(prefix, 2).values())  # not capped
    reference = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    options = ClientOptions(request_timeout=20.0)
    model = AutoDistributedModelForCausalLM.from_pretrained(model_dir, swarm.initial_peers, options=options)
    try:
        new = ring + 6 - PROMPT.shape[1]
        assert_concurrent_sessions_equal_each_alone(
            model, reference, [PROMPT[:, : 3 + 2 * k] for k in range(3)], new
        )
        expected = reference.generate(PROMPT, max_new_tokens=new + 8, do_sample=False)
        with model.inference_session(max_length=PROMPT.shape[1] + new + 8) as session:
            first = model.generate(PROMPT, max_new_tokens=new, do_sample=False, session=session)
            stream = session.blocks.streams[-1]
            victim = model.backend.connection.roster.known[stream.hop.peer_id].public_name
            swarm.processes[victim].send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 30
            while "draining" not in swarm.log(victim):
                assert time.monotonic() < deadline, swarm.log(victim)[-2000:]
                time.sleep(0.1)
            rest = model.generate(None, max_new_tokens=8, do_sample=False)
            assert session.blocks.streams[-1].hop.peer_id != stream.hop.peer_id
        assert torch.equal(torch.cat([first, rest], dim=1), expected)
        assert swarm.processes[victim].wait(30) == 0
        assert "handed" in swarm.log(victim)
        # a rewind deeper than a wrapped ring keeps: the server says so, the client replays
        ids = expected[:, : ring + 20]
        embed = model.get_input_embeddings()
        with model.inference_session(max_length=ids.shape[1]) as session:
            session.step(ids, embed(ids), None)
            session.rewind(10)
            deep = session.step(ids[:, 10:13], embed(ids[:, 10:13]), None)
        with model.inference_session(max_length=ids.shape[1]) as session:
            session.step(ids[:, :10], embed(ids[:, :10]), None)
            # a replay computes the prefix it keeps as a chunk of its own: equal up to float rounding
            torch.testing.assert_close(deep, session.step(ids[:, 10:13], embed(ids[:, 10:13]), None))
    finally:
        model.shutdown()


@pytest.mark.swarm
def test_speculative_decoding_through_real_servers_equals_greedy(swarm, tmp_path):
    """Prompt lookup and an assistant through two real servers: GPT-OSS's rings (past a window of 4,
    with sinks) rewind past rejected drafts on the servers, and the greedy tokens stay local
    transformers' (DeepSeek's latents rewind the same way in process, below)."""
    model_dir = build_tiny_model(tmp_path / "gpt_oss", TinyModelSpec(family="gpt_oss", num_layers=2))
    config = json.loads((model_dir / "config.json").read_text())
    config["sliding_window"] = 4
    (model_dir / "config.json").write_text(json.dumps(config))
    prefix = default_prefix(str(model_dir))
    swarm.start_server("first", model_dir, "0:1")
    swarm.start_server("second", model_dir, "1:2")
    swarm.wait_online(prefix, 2, ["first", "second"])
    reference = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    options = ClientOptions(request_timeout=20.0)
    model = AutoDistributedModelForCausalLM.from_pretrained(model_dir, swarm.initial_peers, options=options)
    prompt = REPEATING_PROMPT
    new = 3 + REWIND_RESERVE  # past the ring of a window of 4
    try:
        expected = reference.generate(prompt, max_new_tokens=new, do_sample=False)
        lookup = model.generate(prompt, max_new_tokens=new, do_sample=False, prompt_lookup_num_tokens=3)
        assisted = model.generate(prompt, max_new_tokens=new, do_sample=False, assistant_model=reference)
        assert torch.equal(lookup, expected) and torch.equal(assisted, expected)
    finally:
        model.shutdown()


@pytest.mark.parametrize("family", ["gemma2", "gemma3_text", "gpt_oss", "deepseek_v3"])
def test_speculative_decoding_over_windows_sinks_and_latents_equals_greedy(family, tmp_path):
    """Prompt lookup and an assistant make the spans rewind their caches past rejected drafts (across
    sliding windows, with sinks, in DeepSeek's latent cache): greedy tokens stay transformers'."""
    model_dir = build_tiny_model(tmp_path / family, TinyModelSpec(family=family, num_layers=2))
    reference = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    spans = [load_span(model_dir, 0, 1)[0], load_span(model_dir, 1, 2)[0]]
    model = DistributedModelForCausalLM.from_local_parts(model_dir, LocalSpans(spans))
    prompt = REPEATING_PROMPT
    expected = reference.generate(prompt, max_new_tokens=20, do_sample=False)
    lookup = model.generate(prompt, max_new_tokens=20, do_sample=False, prompt_lookup_num_tokens=3)
    assisted = model.generate(prompt, max_new_tokens=20, do_sample=False, assistant_model=reference)
    assert torch.equal(lookup, expected) and torch.equal(assisted, expected)


def test_qwen3_moe_with_dense_blocks_among_the_sparse_ones(tmp_path):
    """Qwen3-MoE configs may keep blocks dense (`mlp_only_layers`, `decoder_sparse_step`): each block
    is of the model's kind at its index, a span is priced at its largest block, and generation
    equals transformers'."""
    config = TinyModelSpec(family="qwen3_moe", num_layers=4, num_kv_heads=2).config()
    config.mlp_only_layers, config.decoder_sparse_step = [0], 2  # blocks 1 and 3 hold experts
    torch.manual_seed(0)
    model_dir = tmp_path / "moe"
    AutoModelForCausalLM.from_config(config).save_pretrained(model_dir)
    reference = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    spans = [load_span(model_dir, 0, 1)[0], load_span(model_dir, 1, 4)[0]]
    kinds = [type(block.mlp).__name__ for span in spans for block in span.blocks]
    assert kinds == [type(layer.mlp).__name__ for layer in reference.model.layers]
    assert kinds[0] == kinds[2] != kinds[1] == kinds[3]
    assert spans[0].block_bytes < spans[1].block_bytes
    assert spans[1].family.representative_block(spans[1].config) == 1
    model = DistributedModelForCausalLM.from_local_parts(model_dir, LocalSpans(spans))
    expected = reference.generate(PROMPT, max_new_tokens=12, do_sample=False)
    assert torch.equal(model.generate(PROMPT, max_new_tokens=12, do_sample=False), expected)


@pytest.mark.parametrize("family", ["deepseek_v2", "deepseek_v3"])
def test_deepseek_spans_cache_what_its_attention_caches(family, tmp_path):
    """A span caches per position what transformers' DeepSeek attention caches (5.x: the compressed
    latent and the rotary key, one row each; 4.57: every head's keys and values); its dense first
    block is smaller than the expert blocks, and a span is priced at its largest; V3's routing
    correction comes from the checkpoint; sessions on both sides of a batched decode step (their
    latents gathered into one batch) equal each alone."""
    model_dir = build_tiny_model(tmp_path / family, TinyModelSpec(family=family, num_layers=3))
    config = AutoConfig.from_pretrained(model_dir)
    reference = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    cache = DynamicCache(config=config)
    reference(PROMPT, use_cache=True, **{GENERATE_CACHE_ARGUMENT: cache})
    span = load_span(model_dir, 0, 3)[0]
    session = span.new_cache(1, 16)
    span(torch.randn(1, PROMPT.shape[1], span.hidden_size), session, 0)
    for block in range(3):
        for ours, theirs in (
            (session.keys[block], cache.layers[block].keys),
            (session.values[block], cache.layers[block].values),
        ):
            assert (ours.shape[1], ours.shape[3]) == (theirs.shape[1], theirs.shape[3])
    dense, sparse = (module_parameter_bytes(block) for block in span.blocks[:2])
    assert dense < sparse == span.block_bytes and span.family.representative_block(config) == 1
    if family == "deepseek_v3":
        expected = reference.model.layers[1].mlp.gate.e_score_correction_bias
        assert expected.abs().sum() > 0
        assert torch.equal(span.blocks[1].mlp.gate.e_score_correction_bias, expected)
    assert_batched_step_equals_steps_alone(span)


def pack_mxfp4(
    weight: torch.Tensor, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Experts `[experts, rows, columns]` in the module's layout as an MXFP4 checkpoint stores them
    (blocks `[experts, columns, rows / 32, 16]` of two 4-bit codes a byte, scales `[experts, columns,
    rows / 32]` biased by 127), with values every code can hold exactly: random codes, a random
    power of two per 32. Returns (blocks, scales, the weight they decode to)."""
    experts, rows, columns = weight.shape
    codes = torch.randint(0, 16, (experts, columns, rows // 32, 32), generator=generator)
    exponents = torch.randint(-4, 1, (experts, columns, rows // 32), generator=generator)
    table = torch.tensor(FP4_VALUES)
    values = torch.ldexp(table[codes], exponents[..., None].float())
    decoded = values.reshape(experts, columns, rows).transpose(1, 2).contiguous()
    blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)
    return blocks, (exponents + 127).to(torch.uint8), decoded


def test_gpt_oss_loads_its_published_mxfp4_experts(tmp_path):
    """GPT-OSS is published with its experts in MXFP4: spans dequantize them on load and generate
    what transformers generates from the same (exactly representable) weights in full precision.
    Blocks and scales that do not fit each other are refused."""
    model_dir = build_tiny_model(
        tmp_path / "full", TinyModelSpec(family="gpt_oss", num_layers=2, hidden_size=64)
    )
    reference = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    generator = torch.Generator().manual_seed(0)
    packed = {}
    for index, layer in enumerate(reference.model.layers):
        for name in ("gate_up_proj", "down_proj"):
            parameter = getattr(layer.mlp.experts, name)
            blocks, scales, decoded = pack_mxfp4(parameter.data, generator)
            parameter.data.copy_(decoded)
            packed[f"model.layers.{index}.mlp.experts.{name}_blocks"] = blocks
            packed[f"model.layers.{index}.mlp.experts.{name}_scales"] = scales
    quantized_dir = tmp_path / "mxfp4"
    shutil.copytree(model_dir, quantized_dir)
    tensors = load_file(quantized_dir / "model.safetensors")
    for name in list(tensors):
        if ".mlp.experts.gate_up_proj" in name or name.endswith(".mlp.experts.down_proj"):
            if not name.endswith("_bias"):
                del tensors[name]
    save_file({**tensors, **packed}, quantized_dir / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((quantized_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": None}
    (quantized_dir / "config.json").write_text(json.dumps(config))
    spans = [load_span(quantized_dir, 0, 1)[0], load_span(quantized_dir, 1, 2)[0]]
    model = DistributedModelForCausalLM.from_local_parts(quantized_dir, LocalSpans(spans))
    expected = reference.generate(PROMPT, max_new_tokens=16, do_sample=False)
    assert torch.equal(model.generate(PROMPT, max_new_tokens=16, do_sample=False), expected)
    scales = "model.layers.1.mlp.experts.down_proj_scales"
    packed[scales] = packed[scales][:, 1:].clone()  # one row of scales short
    save_file({**tensors, **packed}, quantized_dir / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="MXFP4 blocks .* do not fit scales"):
        load_span(quantized_dir, 1, 2)


def test_deepseek_loads_its_published_fp8_weights(tmp_path):
    """DeepSeek-V3 is published with its linear weights in float8, one float32 factor per 128 x 128
    tile (`weight_scale_inv`): spans dequantize them on load and generate what transformers
    generates from the same weights in full precision. A scale of the wrong shape is refused."""
    model_dir = build_tiny_model(tmp_path / "tiny", TinyModelSpec(family="deepseek_v3", num_layers=2))
    tensors = load_file(model_dir / "model.safetensors")
    generator = torch.Generator().manual_seed(0)
    full, quantized = {}, {}
    for name, tensor in tensors.items():
        linear = ".layers." in name and name.endswith(("proj.weight", "proj_with_mqa.weight"))
        if not linear:
            full[name] = quantized[name] = tensor
            continue
        factor = 2.0 ** float(torch.randint(-6, -1, (), generator=generator))  # a power of two per tile
        stored = (tensor / factor).to(torch.float8_e4m3fn)
        quantized[name], quantized[f"{name}_scale_inv"] = stored, torch.full((1, 1), factor)
        full[name] = stored.float() * factor
    full_dir, fp8_dir = tmp_path / "full", tmp_path / "fp8"
    for directory, weights in ((full_dir, full), (fp8_dir, quantized)):
        shutil.copytree(model_dir, directory)
        save_file(weights, directory / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((fp8_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (fp8_dir / "config.json").write_text(json.dumps(config))
    reference = AutoModelForCausalLM.from_pretrained(full_dir).eval()
    spans = [load_span(fp8_dir, 0, 1)[0], load_span(fp8_dir, 1, 2)[0]]
    model = DistributedModelForCausalLM.from_local_parts(fp8_dir, LocalSpans(spans))
    expected = reference.generate(PROMPT, max_new_tokens=16, do_sample=False)
    assert torch.equal(model.generate(PROMPT, max_new_tokens=16, do_sample=False), expected)
    quantized["model.layers.1.self_attn.o_proj.weight_scale_inv"] = torch.ones(2, 1)
    save_file(quantized, fp8_dir / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="o_proj.weight_scale_inv has shape"):
        load_span(fp8_dir, 1, 2)


@pytest.mark.parametrize("family", ["gemma2", "gemma3_text"])
def test_gemma_soft_caps_are_the_models_own(family, tmp_path):
    """Caps small enough to change the logits: the final one (the client's head) and Gemma 2's
    attention one (the blocks' kernel, which transformers 5 applies and 4.57's SDPA does not) give
    transformers' tokens, alone and in a padded batch."""
    model_dir = build_tiny_model(
        tmp_path / family, TinyModelSpec(family=family, num_layers=2, num_kv_heads=2)
    )
    plain = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    config = json.loads((model_dir / "config.json").read_text())
    config.update(final_logit_softcapping=2.0, attn_logit_softcapping=0.5)
    (model_dir / "config.json").write_text(json.dumps(config))
    reference = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    model = DistributedModelForCausalLM.from_local_parts(
        model_dir, LocalSpans([load_span(model_dir, 0, 1)[0], load_span(model_dir, 1, 2)[0]])
    )
    expected = reference.generate(PROMPT, max_new_tokens=16, do_sample=False)
    assert torch.equal(model.generate(PROMPT, max_new_tokens=16, do_sample=False), expected)
    assert not torch.allclose(reference(expected).logits, plain(expected).logits)  # the caps matter
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    batch = tokenizer(
        ["one two", "A cat sat on a mat"], return_tensors="pt", padding=True, padding_side="left"
    )
    expected = reference.generate(**batch, max_new_tokens=12, do_sample=False)
    assert torch.equal(model.generate(**batch, max_new_tokens=12, do_sample=False), expected)


def test_llama3_rope_scaling_is_the_models_own(tmp_path):
    """LLaMA 3.x's rope scaling comes from the config into the spans' rotary tables: generation past
    the original context length equals transformers'."""
    model_dir = build_tiny_model(
        tmp_path / "llama3", TinyModelSpec(family="llama", num_layers=2, num_kv_heads=2)
    )
    plain = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    config = json.loads((model_dir / "config.json").read_text())
    config["rope_scaling"] = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
    }
    (model_dir / "config.json").write_text(json.dumps(config))
    reference = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    model = DistributedModelForCausalLM.from_local_parts(
        model_dir, LocalSpans([load_span(model_dir, 0, 2)[0]])
    )
    expected = reference.generate(PROMPT, max_new_tokens=40, do_sample=False)
    assert torch.equal(model.generate(PROMPT, max_new_tokens=40, do_sample=False), expected)
    unscaled = plain(expected).logits
    assert not torch.allclose(reference(expected).logits, unscaled)  # the scaling does change the model
