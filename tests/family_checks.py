"""Checks every model family's tests make the same way (`test_llama_like_families.py`,
`test_falcon_family.py`): in-process spans and clients of real servers generate what local
transformers generates, a session survives its server being killed, and a span loads only the
shards that hold its blocks."""

from __future__ import annotations

import json
import signal
import threading
from pathlib import Path

import torch
from transformers import AutoTokenizer

from llm_swarm.client.backend import LocalSpans
from llm_swarm.client.model import DistributedModelForCausalLM
from llm_swarm.swarm.models import load_span

PROMPT = torch.tensor([[5, 17, 99, 200, 33, 41, 7]])
REPEATING_PROMPT = torch.tensor([[5, 17, 99, 200, 33, 41, 7, 5, 17, 99]])  # prompt lookup finds drafts
PADDED_TEXTS = ["A cat sat on a mat", "one two"]


def assert_spans_generate_like_transformers(
    model_dir: Path, reference, layers: int, new_tokens: int, padded_new_tokens: int
):
    """Spans `[0, 1)` and `[1, layers)` in process: greedy and beam search, then a left-padded batch,
    each token for token what `reference` (local transformers) generates."""
    spans = [load_span(model_dir, 0, 1)[0], load_span(model_dir, 1, layers)[0]]
    model = DistributedModelForCausalLM.from_local_parts(model_dir, LocalSpans(spans))
    assert_generates_like_transformers(model, reference, model_dir, new_tokens, padded_new_tokens)


def assert_generates_like_transformers(
    model, reference, model_dir: Path, new_tokens: int, padded_new_tokens: int, speculative: bool = False
):
    """`model` (in-process spans or a client of real servers): greedy and beam search, a left-padded
    batch and, if `speculative`, prompt lookup and an assistant (whose rejected drafts the caches
    rewind past), each token for token what `reference` (local transformers) generates."""
    for options in ({"do_sample": False}, {"do_sample": False, "num_beams": 3}):
        expected = reference.generate(PROMPT, max_new_tokens=new_tokens, **options)
        assert torch.equal(model.generate(PROMPT, max_new_tokens=new_tokens, **options), expected), options
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    batch = tokenizer(PADDED_TEXTS, return_tensors="pt", padding=True, padding_side="left")
    assert not batch["attention_mask"].all()  # the batch is padded: positions count without it
    expected = reference.generate(**batch, max_new_tokens=padded_new_tokens, do_sample=False)
    assert torch.equal(model.generate(**batch, max_new_tokens=padded_new_tokens, do_sample=False), expected)
    if not speculative:
        return
    expected = reference.generate(REPEATING_PROMPT, max_new_tokens=new_tokens, do_sample=False)
    for options in ({"prompt_lookup_num_tokens": 3}, {"assistant_model": reference}):
        output = model.generate(REPEATING_PROMPT, max_new_tokens=new_tokens, do_sample=False, **options)
        assert torch.equal(output, expected), options


def assert_concurrent_sessions_equal_each_alone(
    model, reference, prompts: list[torch.Tensor], new: int
) -> None:
    """Greedy generations started at once from threads (their decode steps batch on the servers) each
    equal local transformers' run of that prompt alone."""
    results: dict[int, torch.Tensor] = {}
    barrier = threading.Barrier(len(prompts))

    def run(k: int) -> None:
        barrier.wait(timeout=30)
        results[k] = model.generate(prompts[k], max_new_tokens=new, do_sample=False)

    threads = [threading.Thread(target=run, args=(k,)) for k in range(len(prompts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    for k, prompt in enumerate(prompts):
        expected = reference.generate(prompt, max_new_tokens=new, do_sample=False)
        assert torch.equal(results[k], expected), k


def assert_failover_mid_generation_is_exact(swarm, model, reference) -> None:
    """The first server of a session's chain is killed (SIGKILL) between two generate() calls: the
    session goes on elsewhere and the tokens stay local transformers'."""
    expected = reference.generate(PROMPT, max_new_tokens=16, do_sample=False)
    with model.inference_session(max_length=PROMPT.shape[1] + 16) as session:
        first = model.generate(PROMPT, max_new_tokens=8, do_sample=False, session=session)
        victim = session.blocks.streams[0].hop.peer_id
        swarm.stop(model.backend.connection.roster.known[victim].public_name, signal.SIGKILL)
        rest = model.generate(None, max_new_tokens=8, do_sample=False)
        assert victim not in [stream.hop.peer_id for stream in session.blocks.streams]
    assert torch.equal(torch.cat([first, rest], dim=1), expected)


def assert_a_span_loads_only_its_own_shards(model_dir: Path, block_prefix: str):
    """Block 1 alone opens only the shards holding tensors named `{block_prefix}1.`; returns the span."""
    weight_map = json.loads((model_dir / "model.safetensors.index.json").read_text())["weight_map"]
    expected = {file for name, file in weight_map.items() if name.startswith(f"{block_prefix}1.")}
    span, files = load_span(model_dir, 1, 2)
    assert set(files) == expected and len(expected) < len(set(weight_map.values()))
    assert span.num_blocks == 1
    return span
