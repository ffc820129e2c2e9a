"""Captured decode steps (swarm.models.decode_graphs): the static computation a CUDA graph records
equals eager steps, for one session, a batch of sessions at different lengths, a padded batch, and
across the attention window's doublings; on a GPU, replayed graphs equal eager steps too.

On the CPU the static computation runs eagerly (`capture=False`): the masks, positions and in-place
cache writes the graph replays are checked there; capture and replay themselves need CUDA.
"""

from __future__ import annotations

import pytest
import torch

from llm_swarm.swarm.models import load_span
from llm_swarm.swarm.models.decode_graphs import (
    MAX_CAPTURES_PER_SESSION,
    MIN_WIDTH,
    DecodeGraphs,
    window_width,
)
from llm_swarm.swarm.models.family import family_for
from llm_swarm.swarm.models.tiny import TinyModelSpec, build_tiny_model

CUDA = torch.cuda.is_available()


def prefilled(span, prompt: torch.Tensor, max_length: int, mask: torch.Tensor | None = None):
    cache = span.new_cache(prompt.shape[0], max_length)
    span(prompt, cache, 0, mask)
    return cache


def run_both(span, graphs: DecodeGraphs, sessions, steps: int, generator) -> tuple[float, int]:
    """Decode `steps` tokens for every session twice, eagerly and through `graphs`, each on its own
    copy of the caches; returns the largest difference of outputs and caches, and graph answers."""
    worst, answered = 0.0, 0
    for _ in range(steps):
        batch = []
        for session in sessions:
            rows = session["eager"].batch_size
            token = torch.randn(rows, 1, span.hidden_size, generator=generator).to(span.dtype)
            mask = session.get("mask")
            if mask is not None:
                mask = torch.cat([mask, torch.ones(rows, 1)], dim=1)
                session["mask"] = mask
            batch.append((token, session, mask))
        expected = [span(token, s["eager"], s["eager"].length, mask) for token, s, mask in batch]
        steps_in = [(token, s["graph"], s["graph"].length, mask) for token, s, mask in batch]
        for _, cache, position, _ in steps_in:
            cache.begin_step(position, 1)
        outputs = graphs.run(steps_in)
        if outputs is None:  # not captured yet: eager, as the engine does
            outputs = span.forward_batch(steps_in)
        else:
            answered += 1
        for (_, s, mask), got, want in zip(batch, outputs, expected, strict=True):
            real = mask[:, -1].bool() if mask is not None else slice(None)
            worst = max(worst, (got[real] - want[real]).abs().max().item())
            assert s["graph"].length == s["eager"].length
    for session in sessions:
        length = session["eager"].length
        eager, graph = session["eager"], session["graph"]
        for a, b in zip(eager.keys + eager.values, graph.keys + graph.values, strict=True):
            worst = max(worst, (a[:, :, :length] - b[:, :, :length]).abs().max().item())
    return worst, answered


def make_sessions(span, lengths, batches, max_length, generator, padded_index=None):
    sessions = []
    for index, (length, rows) in enumerate(zip(lengths, batches, strict=True)):
        prompt = torch.randn(rows, length, span.hidden_size, generator=generator).to(span.dtype)
        mask = None
        if index == padded_index:
            mask = torch.ones(rows, length)
            mask[1, :3] = 0  # the second row is left-padded
        sessions.append(
            {
                "eager": prefilled(span, prompt, max_length, mask),
                "graph": prefilled(span, prompt, max_length, mask),
                "mask": mask,
            }
        )
    return sessions


@pytest.fixture(scope="module")
def llama_span(llama_dir):
    span, _ = load_span(llama_dir, 0, 6)
    return span


def test_window_widths_double_and_stop_at_the_cache():
    assert window_width(1, 2048) == MIN_WIDTH
    assert window_width(MIN_WIDTH + 1, 2048) == 2 * MIN_WIDTH
    assert window_width(300, 2048) == 512
    assert window_width(300, 400) == 400


def test_static_steps_equal_eager_ones_alone_batched_and_padded(llama_span):
    """One session across a window doubling (60 -> 70 tokens crosses 64), and three sessions of
    different lengths in one batch, one of them a padded two-row batch."""
    span = llama_span
    generator = torch.Generator().manual_seed(0)
    graphs = DecodeGraphs(span, capture=False)
    alone = make_sessions(span, [58], [1], 160, generator)
    worst, answered = run_both(span, graphs, alone, 10, generator)
    assert answered == 10 and worst <= 1e-5
    several = make_sessions(span, [5, 70, 12], [1, 1, 2], 200, generator, padded_index=2)
    worst, answered = run_both(span, graphs, several, 6, generator)
    assert answered == 6 and worst <= 1e-5
    assert graphs.num_graphs >= 3  # 64 and 128 windows alone, then the batch
    for session in alone + several:
        graphs.forget(session["graph"])
    assert graphs.num_graphs == 0


def test_a_rewound_session_overwrites_what_it_wrote(llama_span):
    """Speculative decoding and retries step back: a step at an earlier position must see only the
    keys before it, whatever the cache held beyond."""
    span = llama_span
    generator = torch.Generator().manual_seed(1)
    graphs = DecodeGraphs(span, capture=False)
    prompt = torch.randn(1, 20, span.hidden_size, generator=generator)
    eager, graph = prefilled(span, prompt, 64), prefilled(span, prompt, 64)
    for cache in (eager, graph):  # two decode steps, then rewind to position 20
        for position in (20, 21):
            token = torch.randn(1, 1, span.hidden_size, generator=torch.Generator().manual_seed(position))
            span(token, cache, position)
    token = torch.randn(1, 1, span.hidden_size, generator=generator)
    eager.length = graph.length = 21  # what a rewind leaves: positions >= 21 are stale
    want = span(token, eager, 20)
    graph.begin_step(20, 1)
    (got,) = graphs.run([(token, graph, 20, None)])
    assert (got - want).abs().max().item() <= 1e-5 and graph.length == 21


def test_drafts_of_several_tokens_are_verified_from_graphs_and_rewound(llama_span):
    """Speculative decoding's verification step: four draft tokens at once, after which the client
    keeps some and the next step starts where it rewound to; a padded two-row batch too."""
    span = llama_span
    generator = torch.Generator().manual_seed(4)
    graphs = DecodeGraphs(span, capture=False)
    for rows, mask in ((1, None), (2, torch.tensor([[1.0] * 30, [0.0] * 3 + [1.0] * 27]))):
        prompt = torch.randn(rows, 30, span.hidden_size, generator=generator)
        eager, graph = prefilled(span, prompt, 128, mask), prefilled(span, prompt, 128, mask)
        position = 30
        for kept in (2, 4, 1, 3):
            draft = torch.randn(rows, 4, span.hidden_size, generator=generator)
            step_mask = None if mask is None else torch.ones(rows, position + 4)
            if step_mask is not None:
                step_mask[:, :30] = mask
            want = span(draft, eager, position, step_mask)
            graph.begin_step(position, 4)
            (got,) = graphs.run([(draft, graph, position, step_mask)])
            assert (got - want).abs().max().item() <= 1e-5
            position += kept  # the rest of the draft was rejected: the next step overwrites it
            eager.length = graph.length = position
    assert graphs.num_graphs >= 2


def test_one_session_cannot_make_the_server_capture_without_end(llama_span):
    """A client cycling its draft length would cause a capture per length: past its budget its steps
    run eagerly (still exact), and other sessions' graphs are not evicted for it."""
    span = llama_span
    generator = torch.Generator().manual_seed(5)
    graphs = DecodeGraphs(span, capture=False)
    honest = prefilled(span, torch.randn(1, 8, span.hidden_size, generator=generator), 64)
    honest.begin_step(8, 1)
    assert graphs.run([(torch.randn(1, 1, span.hidden_size), honest, 8, None)]) is not None
    cycler = prefilled(span, torch.randn(1, 8, span.hidden_size, generator=generator), 64)
    answered = 0
    for tokens in list(range(1, 17)) * 2:
        cycler.begin_step(8, tokens)
        outputs = graphs.run([(torch.randn(1, tokens, span.hidden_size), cycler, 8, None)])
        answered += outputs is not None
        cycler.length = 8
    # the first 12 lengths captured and replayed the second time round, the other 4 eager both times
    assert answered == 2 * MAX_CAPTURES_PER_SESSION
    assert sum(cycler.serial in key[1] for key in graphs._graphs) == MAX_CAPTURES_PER_SESSION
    assert any(honest.serial in key[1] for key in graphs._graphs)


def test_which_spans_run_from_graphs(tmp_path, llama_span, bloom_dir):
    assert DecodeGraphs.supported(llama_span)
    bloom, _ = load_span(bloom_dir, 0, 2)
    assert not DecodeGraphs.supported(bloom)  # ALiBi from the mask: eager
    spec = TinyModelSpec(family="mixtral", num_layers=2)
    config = spec.config()
    assert not family_for(config).decode_graphs  # experts chosen by a host-side nonzero()
    prompt = torch.zeros(1, 17, llama_span.hidden_size)  # longer than a draft: a prefill, eager
    graphs = DecodeGraphs(llama_span, capture=False)
    assert graphs.run([(prompt, llama_span.new_cache(1, 32), 0, None)]) is None
    mixed = [(torch.zeros(1, n, llama_span.hidden_size), llama_span.new_cache(1, 8), 0, None) for n in (1, 2)]
    assert graphs.run(mixed) is None  # one captured step runs one number of tokens


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_replayed_graphs_equal_eager_steps_on_cuda(tmp_path, dtype):
    """On a GPU: captured at a key's second step, replayed after; every answer equals eager's."""
    model = build_tiny_model(tmp_path / "m", TinyModelSpec(family="llama", num_layers=4, num_kv_heads=2))
    span, _ = load_span(model, 0, 4, dtype=dtype, device="cuda")
    generator = torch.Generator().manual_seed(2)
    graphs = DecodeGraphs(span)
    sessions = make_sessions(span, [30, 9, 12], [1, 1, 2], 160, generator, padded_index=2)
    worst, answered = run_both(span, graphs, sessions[:1], 40, generator)
    assert graphs.captures >= 1 and graphs.replays >= 30 and answered >= 38
    assert worst <= (1e-4 if dtype == "float32" else 2e-2)
    worst, answered = run_both(span, graphs, sessions, 8, generator)
    assert answered >= 7 and worst <= (1e-4 if dtype == "float32" else 2e-2)
    replays = graphs.replays
    eager, graph = sessions[0]["eager"], sessions[0]["graph"]  # drafts of 4 tokens, 2 kept each time
    for _ in range(6):
        position = eager.length
        draft = torch.randn(1, 4, span.hidden_size, generator=generator).to(span.dtype)
        want = span(draft, eager, position)
        graph.begin_step(position, 4)
        outputs = graphs.run([(draft, graph, position, None)])
        got = outputs[0] if outputs is not None else span(draft, graph, position)  # first: eager
        assert (got - want).abs().max().item() <= (1e-4 if dtype == "float32" else 2e-2)
        eager.length = graph.length = position + 2
    assert graphs.replays >= replays + 4 and graphs.capture_failures == 0


@pytest.mark.swarm
@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a GPU")
def test_servers_on_a_gpu_generate_what_transformers_does(swarm, llama_dir):
    """Two real server processes on the GPU, decoding from CUDA graphs, one padded batch and one
    prompt: greedy tokens equal local transformers' on the CPU."""
    from transformers import AutoModelForCausalLM

    from llm_swarm.client import AutoDistributedModelForCausalLM
    from llm_swarm.swarm.dht_keys import default_prefix

    prefix = default_prefix(str(llama_dir))
    for name, blocks in (("a", "0:3"), ("b", "3:6")):
        swarm.start_server(name, llama_dir, blocks, "1GB", "--device", "cuda", "--dtype", "float32")
    swarm.wait_online(prefix, 6, ["a", "b"])
    local = AutoModelForCausalLM.from_pretrained(llama_dir)
    model = AutoDistributedModelForCausalLM.from_pretrained(llama_dir, swarm.initial_peers)
    try:
        prompts = torch.tensor([[5, 17, 99, 200, 33, 41, 7], [0, 0, 9, 8, 7, 6, 5]])
        mask = torch.tensor([[1] * 7, [0, 0, 1, 1, 1, 1, 1]])
        for ids, attention in ((prompts[:1], mask[:1]), (prompts, mask)):
            want = local.generate(ids, attention_mask=attention, max_new_tokens=40, do_sample=False)
            got = model.generate(ids, attention_mask=attention, max_new_tokens=40, do_sample=False)
            assert torch.equal(got, want)
    finally:
        model.shutdown()
    assert "replay CUDA graphs" in swarm.log("a")
