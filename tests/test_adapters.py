"""LoRA adapters on servers: `swarm-server --adapters`, chosen per session by the client.

Through real servers, generation with an adapter equals a local peft `PeftModel` with that adapter
(greedy, and sessions with different adapters or none batched together on the same servers); the
forward used for training too; routing only uses servers announcing the adapter; an adapter no server
has is a clear error naming it; the memory budget counts the adapters. Hostile adapter directories are
refused at start-up, by the loader in process and by a real `swarm-server`.
"""

from __future__ import annotations

import json
import math
import subprocess
import threading

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from harness.local_swarm import CHILD_ENV, server_argv
from llm_swarm.client import AutoDistributedModelForCausalLM, ClientOptions
from llm_swarm.client.connection import SwarmUnavailable
from llm_swarm.swarm.adapter_names import AdapterError
from llm_swarm.swarm.dht_keys import default_prefix
from llm_swarm.swarm.models import load_span
from llm_swarm.swarm.models.adapters import AdapterSource, attach_adapters
from llm_swarm.swarm.models.tiny_adapter import build_tiny_adapter
from tests.conftest import NUM_BLOCKS

PROMPT = torch.tensor([[5, 17, 99, 200, 33, 41, 7]])
NEW = 10


@pytest.fixture(scope="module")
def adapters(llama_dir, tmp_path_factory):
    """Two random-weight LoRA adapters of the tiny LLaMA (different targets and ranks)."""
    root = tmp_path_factory.mktemp("adapters")
    one = build_tiny_adapter(llama_dir, root / "one", rank=4, seed=1)
    two = build_tiny_adapter(
        llama_dir, root / "two", rank=8, alpha=4.0, targets=["q_proj", "down_proj"], seed=2
    )
    return {"one": one, "two": two}


def peft_model(llama_dir, adapter_dir):
    base = AutoModelForCausalLM.from_pretrained(llama_dir)
    return PeftModel.from_pretrained(base, adapter_dir).eval()


@pytest.fixture(scope="module")
def swarm_with_adapters(llama_dir, adapters, tmp_path_factory):
    """Servers a (0:3) and b (3:6) hold both adapters; c (0:6) holds none and is the fastest route
    for plain sessions, never for adapter sessions."""
    from harness.local_swarm import LocalSwarm

    swarm = LocalSwarm(tmp_path_factory.mktemp("adapter-swarm"))
    try:
        swarm.start_dht()
        held = ["--adapters", f"one={adapters['one']}", str(adapters["two"])]
        swarm.start_server("a", llama_dir, "0:3", "1GB", *held)
        swarm.start_server("b", llama_dir, f"3:{NUM_BLOCKS}", "1GB", *held)
        swarm.start_server("c", llama_dir, f"0:{NUM_BLOCKS}")
        prefix = default_prefix(str(llama_dir))
        online = swarm.wait_online(prefix, NUM_BLOCKS, ["a", "b", "c"])
        yield swarm, online
    finally:
        assert not swarm.close()


@pytest.mark.swarm
@pytest.mark.compat
def test_generation_with_an_adapter_equals_local_peft(swarm_with_adapters, llama_dir, adapters):
    swarm, online = swarm_with_adapters
    assert online["a"].adapters == ("one", "two") and online["c"].adapters == ()
    options = ClientOptions(request_timeout=20.0)
    models = {
        name: AutoDistributedModelForCausalLM.from_pretrained(
            llama_dir, swarm.initial_peers, options=options, active_adapter=name
        )
        for name in (None, "one", "two")
    }
    try:
        local = {name: peft_model(llama_dir, path) for name, path in adapters.items()}
        local[None] = AutoModelForCausalLM.from_pretrained(llama_dir).eval()
        expected = {
            name: model.generate(input_ids=PROMPT, max_new_tokens=NEW, do_sample=False)
            for name, model in local.items()
        }
        assert not torch.equal(expected["one"], expected[None])  # the adapters change what is generated
        # concurrently: sessions with different adapters (and none) share the servers' decode batches
        results: dict = {}

        def run(name) -> None:
            results[name] = models[name].generate(PROMPT, max_new_tokens=NEW, do_sample=False)

        threads = [threading.Thread(target=run, args=(name,)) for name in models]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        for name in models:
            assert torch.equal(results[name], expected[name]), name
        # an adapter session went only through servers that hold it
        with models["one"].inference_session(max_length=16) as session:
            models["one"].generate(PROMPT, max_new_tokens=2, do_sample=False, session=session)
            peers = {stream.hop.peer_id for stream in session.blocks.streams}
        known = models["one"].backend.connection.roster.known
        assert {known[peer].public_name for peer in peers} <= {"a", "b"}
        # the forward of whole sequences (training) applies the adapter as well
        with torch.no_grad():
            logits = models["two"](PROMPT).logits
            reference = local["two"](input_ids=PROMPT).logits
        assert torch.allclose(logits, reference, atol=1e-4)
    finally:
        for model in models.values():
            model.shutdown()


@pytest.mark.swarm
def test_an_adapter_no_server_has_is_a_clear_error(swarm_with_adapters, llama_dir):
    swarm, _ = swarm_with_adapters
    options = ClientOptions(wait_for_servers=1.0, request_timeout=20.0)
    model = AutoDistributedModelForCausalLM.from_pretrained(
        llama_dir, swarm.initial_peers, options=options, active_adapter="missing"
    )
    try:
        with pytest.raises(SwarmUnavailable, match="with adapter 'missing'"):
            model.generate(PROMPT, max_new_tokens=2)
    finally:
        model.shutdown()
    with pytest.raises(AdapterError, match="adapter name"):
        ClientOptions(active_adapter="../etc")


@pytest.mark.swarm
def test_the_memory_budget_counts_the_adapters(swarm_with_adapters, llama_dir, adapters):
    _, online = swarm_with_adapters
    span, _ = load_span(llama_dir, 0, 3)
    loaded = attach_adapters(
        span, [AdapterSource("one", adapters["one"]), AdapterSource("two", adapters["two"])]
    )
    info = online["a"]
    assert loaded.total_bytes > 0 and info.block_bytes == span.block_bytes
    assert info.memory_bytes - 3 * info.block_bytes - info.cache_bytes_left == loaded.total_bytes


def _hostile(adapter_dir, tmp_path, name: str):
    """A copy of a good adapter, spoiled in one way."""
    target = tmp_path / name
    target.mkdir()
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    weights = load_file(adapter_dir / "adapter_model.safetensors")
    if name == "wrong-shape":
        key = next(key for key in weights if "lora_A" in key)
        weights[key] = torch.zeros(weights[key].shape[0], weights[key].shape[1] + 1)
    elif name == "huge-rank-config":
        config["r"] = 1 << 20
    elif name == "huge-rank-tensors":
        for key in list(weights):
            rows, columns = weights[key].shape
            weights[key] = torch.zeros(1024, columns) if "lora_A" in key else torch.zeros(rows, 1024)
    elif name == "nan":
        key = next(iter(weights))
        weights[key] = torch.full_like(weights[key], math.nan)
    elif name == "outside-blocks":
        weights["base_model.model.lm_head.lora_A.weight"] = torch.zeros(4, 64)
    elif name == "modules-to-save":
        config["modules_to_save"] = ["lm_head"]
    if name == "link-outside":
        outside = tmp_path / "elsewhere.safetensors"
        save_file(weights, outside)
        (target / "adapter_model.safetensors").symlink_to(outside)
    elif name == "pickle-only":
        torch.save(weights, target / "adapter_model.bin")
    else:
        save_file(weights, target / "adapter_model.safetensors")
    (target / "adapter_config.json").write_text(json.dumps(config))
    return target


HOSTILE = {
    "wrong-shape": "has shape",
    "huge-rank-config": "rank r=1048576",
    "huge-rank-tensors": "rank 1024",
    "nan": "NaN",
    "outside-blocks": "not a LoRA factor of a linear layer inside a transformer block",
    "modules-to-save": "modules_to_save",
    "link-outside": "leads outside the adapter's directory",
    "pickle-only": "pickled .bin adapters are not loaded",
}


@pytest.mark.swarm
def test_hostile_adapter_directories_are_refused_at_start_up(llama_dir, adapters, tmp_path):
    span, _ = load_span(llama_dir, 0, 2)
    for name, message in HOSTILE.items():
        bad = _hostile(adapters["one"], tmp_path, name)
        with pytest.raises(AdapterError, match=message):
            attach_adapters(span, [AdapterSource("good", adapters["one"]), AdapterSource(name, bad)])
        assert span.adapters is None  # all checked before anything is injected
    # a real server: exits at start-up with the reason, exit code 2 (a configuration error)
    bad = tmp_path / "wrong-shape"
    argv = server_argv(llama_dir, [_absent_peer()], "0:2", "1GB", "hostile", "", "--adapters", str(bad))
    finished = subprocess.run(argv, capture_output=True, text=True, env=CHILD_ENV, timeout=120)
    assert finished.returncode == 2, finished.stderr[-2000:]
    assert "adapter 'wrong-shape'" in finished.stderr and "has shape" in finished.stderr


def _absent_peer() -> str:
    """Refused adapters stop the server before it needs any peer: a peer that is not there will do."""
    return "/ip4/127.0.0.1/tcp/9/p2p/QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"


def _experts_adapter(out_dir, num_blocks: int, hidden: int, intermediate: int, experts: int):
    """A LoRA adapter of Mixtral's experts (their gate projections `w1`) and of one attention layer,
    written as peft writes one, with random factors (no transformers version is needed to make it)."""
    generator = torch.Generator().manual_seed(3)
    rank, tensors = 4, {}
    for block in range(num_blocks):
        layers = {f"block_sparse_moe.experts.{e}.w1": (hidden, intermediate) for e in range(experts)}
        layers["self_attn.q_proj"] = (hidden, hidden)
        for path, (inputs, outputs) in layers.items():
            key = f"base_model.model.model.layers.{block}.{path}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, inputs, generator=generator) * 0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(outputs, rank, generator=generator) * 0.5
    out_dir.mkdir()
    save_file(tensors, str(out_dir / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 8,
              "target_modules": ["w1", "q_proj"], "lora_dropout": 0.0, "bias": "none"}  # fmt: skip
    (out_dir / "adapter_config.json").write_text(json.dumps(config))
    return out_dir


def test_an_adapter_of_a_mixtures_experts_is_refused_by_name(tmp_path):
    """peft chooses each row's adapter by batch row, but an expert sees the tokens routed to it
    gathered across rows (and transformers 5 fuses experts into 3-D weights): an adapter of experts
    is refused at start-up on either transformers version, naming the layer, before anything is
    injected; the same adapter without its expert factors is served."""
    from llm_swarm.swarm.models.tiny import TinyModelSpec, build_tiny_model

    spec = TinyModelSpec(family="mixtral", num_layers=2, num_kv_heads=2)
    model_dir = build_tiny_model(tmp_path / "mixtral", spec)
    config = AutoModelForCausalLM.from_pretrained(model_dir).config
    adapter_dir = _experts_adapter(
        tmp_path / "experts", 2, config.hidden_size, config.intermediate_size, config.num_local_experts
    )
    span, _ = load_span(model_dir, 0, 1)
    with pytest.raises(AdapterError, match=r"'block_sparse_moe\.experts\.0\.w1' adapts an expert"):
        attach_adapters(span, [AdapterSource("experts", adapter_dir)])
    assert span.adapters is None
    weights = adapter_dir / "adapter_model.safetensors"
    save_file({key: value for key, value in load_file(weights).items() if "experts" not in key}, str(weights))
    attach_adapters(span, [AdapterSource("attention", adapter_dir)])
    assert span.adapters is not None and span.adapters.names == ("attention",)
