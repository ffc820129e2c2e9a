"""Iteration-level batching: concurrent sessions' decode steps run as one forward.

Batched results must equal unbatched ones (same tokens; outputs within 1e-5 in float32), a failing
step must fail alone, and the pure prefill-vs-decode rule must do what Pang et al.'s heuristic says.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass

import pytest
import torch
from transformers import AutoTokenizer

from llm_swarm.server.engine import BatchingEngine, EngineStats
from llm_swarm.swarm.models import load_client_parts, load_span
from llm_swarm.swarm.models.cache import BatchedStepCache
from llm_swarm.swarm.step_scheduler import (
    Action,
    CostModel,
    LinearCost,
    LinearFit,
    QueueView,
    SchedulerPolicy,
    decide,
)
from tests.conftest import NUM_BLOCKS

NEW_TOKENS = 12
# how a session covers the span's blocks: the whole span, or two caches on two sub-ranges (as when
# a client's chain enters or leaves this server mid-span); different ranges batch separately
RANGES = [[(0, NUM_BLOCKS)], [(0, 3), (3, NUM_BLOCKS)], [(0, 2), (2, NUM_BLOCKS)]]


@dataclass
class SessionSpec:
    prompt: torch.Tensor  # [batch, length]
    padding_mask: torch.Tensor | None  # [batch, length] for a left-padded batch
    ranges: list[tuple[int, int]]


def session_specs(count: int = 16) -> list[SessionSpec]:
    generator = torch.Generator().manual_seed(10)
    specs = []
    for index in range(count):
        length = 2 + (index * 5) % 13  # mixed prompt lengths, 2..14
        batch = 2 if index in (5, 11) else 1
        prompt = torch.randint(4, 500, (batch, length), generator=generator)
        mask = None
        if batch > 1:  # a padded batch: the second row is shorter, padded on the left
            mask = torch.ones(batch, length)
            mask[1, : length // 2] = 0
            prompt[1, : length // 2] = 0
        specs.append(SessionSpec(prompt, mask, RANGES[index % len(RANGES)]))
    return specs


async def generate(span, client, spec: SessionSpec, step) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Greedy decoding of one session, every span call going through `step`; returns the new tokens
    and the last span output of every step."""
    batch, length = spec.prompt.shape
    caches = [span.new_cache(batch, length + NEW_TOKENS + 1, first, last) for first, last in spec.ranges]
    new, position, mask = spec.prompt, 0, spec.padding_mask
    tokens, outputs = [], []
    for _ in range(NEW_TOKENS + 1):
        hidden = client.embed_tokens(new)
        step_mask = None if mask is None else mask[:, : position + new.shape[1]]
        for cache in caches:
            hidden = await step(cache, hidden, position, step_mask)
        outputs.append(hidden[:, -1].clone())
        position += new.shape[1]
        new = client.logits(hidden[:, -1:]).argmax(-1)
        tokens.append(new)
        if mask is not None:
            mask = torch.cat([mask, torch.ones(batch, 1)], dim=1)
    return torch.cat(tokens, dim=1), outputs


def run_against_sequential(span, client, specs: list[SessionSpec], engine: BatchingEngine) -> EngineStats:
    """Every session of `specs` alone and whole (the reference), then all at once through `engine`:
    the tokens must be equal and the outputs within 1e-5. Returns the engine's counters."""

    async def alone(cache, hidden, position, mask):
        return span(hidden, cache, position, mask)

    async def sequential():
        return [await generate(span, client, spec, alone) for spec in specs]

    expected = asyncio.run(sequential())

    async def through_engine(cache, hidden, position, mask):
        return await engine.run(span, cache, hidden, position, mask)

    async def concurrent():
        return await asyncio.gather(*(generate(span, client, spec, through_engine) for spec in specs))

    try:
        results = asyncio.run(concurrent())
    finally:
        engine.shutdown(wait=True)
    for index, ((tokens, outputs), (want_tokens, want_outputs)) in enumerate(
        zip(results, expected, strict=True)
    ):
        assert torch.equal(tokens, want_tokens), index
        worst = max((a - b).abs().max().item() for a, b in zip(outputs, want_outputs, strict=True))
        assert worst <= 1e-5, (index, worst)
    return engine.stats


@pytest.fixture(scope="module")
def span_and_client(model_dir):
    return load_span(model_dir, 0, NUM_BLOCKS)[0], load_client_parts(model_dir)


def test_sixteen_concurrent_sessions_match_sequential_runs(span_and_client):
    span, client = span_and_client
    stats = run_against_sequential(span, client, session_specs(16), BatchingEngine(batch_wait=0.005))
    # the sessions really were batched: far fewer decode iterations than decode steps (each block
    # range is its own batch: at most 6 of the 16 sessions share one)
    assert stats.max_batch >= 5, stats.summary()
    assert stats.decode_iterations * 3 <= stats.decode_steps, stats.summary()
    assert stats.fallbacks == 0


def test_chunked_prefills_between_other_sessions_decodes_equal_whole_prefills(span_and_client):
    """`--prefill-chunk`: prompts of 2..14 tokens (padded batches among them) run in chunks of 3,
    interleaved with the other sessions' decode steps; outputs equal whole prefills run alone."""
    span, client = span_and_client
    specs = session_specs(16)
    stats = run_against_sequential(span, client, specs, BatchingEngine(batch_wait=0.005, prefill_chunk=3))
    chunks = sum(
        len(spec.ranges) * -(-spec.prompt.shape[1] // 3) for spec in specs if spec.prompt.shape[1] > 3
    )
    assert stats.prefill_chunks == chunks, stats.summary()  # every chunk of every long prompt ran, per cache
    assert stats.decode_iterations > 0


def test_batched_decode_reads_caches_in_place_and_matches_replayed_caches(span_and_client, monkeypatch):
    """A batched decode step hands attention views of each session's own cache (same
    storage, nothing gathered), for mixed lengths and a padded session; a session whose cache was
    rebuilt by a failover replay (its history as one prefill into a fresh cache) decodes in the batch
    exactly as the original does alone."""
    span, _client = span_and_client
    generator = torch.Generator().manual_seed(3)
    lengths, batches = [3, 9, 1, 14], [1, 1, 2, 1]
    prompts = [
        torch.randn(b, n, span.hidden_size, generator=generator)
        for n, b in zip(lengths, batches, strict=True)
    ]
    padding = torch.ones(2, lengths[2] + 1)
    padding[1, 0] = 0  # session 2's second row is padding at its first position
    caches, replayed = [], []
    for index, prompt in enumerate(prompts):
        mask = padding[:, : lengths[index]] if index == 2 else None
        cache = span.new_cache(prompt.shape[0], 32)
        for position in range(prompt.shape[1]):  # step by step, as decoding wrote it
            span(
                prompt[:, position : position + 1],
                cache,
                position,
                None if mask is None else mask[:, : position + 1],
            )
        caches.append(cache)
        rebuilt = span.new_cache(prompt.shape[0], 32)
        span(prompt, rebuilt, 0, mask)  # the replacement server's replay: one prefill
        replayed.append(rebuilt)
    new_tokens = [torch.randn(b, 1, span.hidden_size, generator=generator) for b in batches]
    masks = [padding if index == 2 else None for index in range(len(prompts))]

    storages: list[tuple[int, int]] = []
    original_update = BatchedStepCache.update

    def watching_update(self, key_states, value_states, layer_idx, *args, **kwargs):
        keys, values = original_update(self, key_states, value_states, layer_idx, *args, **kwargs)
        for view, cache in zip(keys.sessions, self.caches, strict=True):
            layer = layer_idx - self.block_offset
            storages.append((view.keys.data_ptr(), cache.keys[layer].data_ptr()))
            storages.append((view.values.data_ptr(), cache.values[layer].data_ptr()))
        return keys, values

    monkeypatch.setattr(BatchedStepCache, "update", watching_update)
    batched = span.forward_batch(
        [
            (token, cache, lengths[i], masks[i])
            for i, (token, cache) in enumerate(zip(new_tokens, replayed, strict=True))
        ]
    )
    assert storages and all(view == cache for view, cache in storages)  # views, not copies
    for index, (token, cache) in enumerate(zip(new_tokens, caches, strict=True)):
        alone = span(token, cache, lengths[index], masks[index])
        worst = (
            (batched[index] - alone)[masks[index][:, -1:].bool() if masks[index] is not None else ...]
            .abs()
            .max()
        )
        assert worst.item() <= 1e-5, (index, worst.item())


def test_a_failing_step_does_not_poison_its_batch(span_and_client):
    span, client = span_and_client
    generator = torch.Generator().manual_seed(3)
    caches, steps = [], []
    for index in range(6):
        length = 3 + index
        cache = span.new_cache(1, length + 2 if index != 2 else length)  # session 2 is full
        span(torch.randn(1, length, span.hidden_size, generator=generator), cache, 0)
        caches.append(cache)
        steps.append((torch.randn(1, 1, span.hidden_size, generator=generator), length))
    # session 4 sends a step that breaks the batched forward itself (a hidden size the span
    # does not have); validation in the handler would refuse it, here it forces the fallback
    bad_hidden = torch.randn(1, 1, span.hidden_size + 1, generator=generator)

    def reference(index):
        cache = caches[index]
        clone = span.new_cache(1, cache.max_length)
        for layer in range(cache.num_blocks):
            clone.keys[layer].copy_(cache.keys[layer])
            clone.values[layer].copy_(cache.values[layer])
        clone.length = cache.length
        hidden, position = steps[index]
        return span(hidden, clone, position)

    expected = {index: reference(index) for index in (0, 1, 3, 5)}
    # the batch starts only once all six steps are queued: a long window, a full batch of six rows
    engine = BatchingEngine(batch_wait=10.0, max_batch_rows=6, active_horizon=0.1)
    try:
        futures = []
        for index, (hidden, position) in enumerate(steps):
            futures.append(engine.submit(span, caches[index], bad_hidden if index == 4 else hidden, position))
        for index in (0, 1, 3, 5):
            assert (futures[index].result(timeout=30) - expected[index]).abs().max().item() <= 1e-5
        with pytest.raises(ValueError, match="max_length"):
            futures[2].result(timeout=30)
        with pytest.raises(RuntimeError):
            futures[4].result(timeout=30)
        # the engine keeps serving afterwards (once the batch's sessions count as gone, a lone step
        # does not wait for them)
        time.sleep(engine.active_horizon + 0.05)
        hidden, position = torch.randn(1, 1, span.hidden_size, generator=generator), caches[0].length
        assert engine.submit(span, caches[0], hidden, position).result(timeout=30).shape == hidden.shape
    finally:
        engine.shutdown(wait=True)
    assert engine.stats.fallbacks == 1
    assert engine.stats.max_batch == 6


def test_shutdown_cancels_waiting_steps(span_and_client):
    span, _client = span_and_client
    engine = BatchingEngine(batch_wait=10.0)
    cache = span.new_cache(1, 8)
    future = engine.submit(span, cache, torch.randn(1, 1, span.hidden_size), 0)
    engine.shutdown(wait=True)
    assert future.cancelled()
    assert engine.submit(span, cache, torch.randn(1, 1, span.hidden_size), 0).cancelled()


def test_an_ended_session_is_not_waited_for(span_and_client):
    """A client's next session on the same blocks runs at once: the engine forgets the one that
    ended instead of waiting for its steps (here: a window that would otherwise never close)."""
    span, _client = span_and_client
    engine = BatchingEngine(batch_wait=1e6, active_horizon=1e6)
    try:
        first, second = span.new_cache(1, 8), span.new_cache(1, 8)
        step = lambda cache: engine.submit(span, cache, torch.randn(1, 1, span.hidden_size), 0)  # noqa: E731
        step(first).result(timeout=30)  # the only session decoding lately: runs without waiting
        engine.forget(first)
        assert step(second).result(timeout=30).shape == (1, 1, span.hidden_size)
    finally:
        engine.shutdown(wait=True)


def test_a_lone_cheap_session_decodes_on_its_loop_and_others_still_batch(span_and_client):
    """A session decoding alone, once its measured steps are cheap, runs them on the caller's loop
    (no thread hand-off), with outputs equal to the span's own, and errors raised as before; as soon
    as a second session decodes on the same blocks, steps go back to the compute thread and batch."""
    span, _client = span_and_client
    generator = torch.Generator().manual_seed(5)
    engine = BatchingEngine(batch_wait=0.05, active_horizon=30.0, inline_below=10.0)
    first, reference = span.new_cache(1, 16), span.new_cache(1, 16)
    tokens = torch.randn(1, 8, span.hidden_size, generator=generator)

    async def decode_alone() -> None:
        for position in range(4):
            token = tokens[:, position : position + 1]
            output = await engine.run(span, first, token, position)
            assert torch.equal(output, span(token, reference, position))
        with pytest.raises(ValueError, match="position"):  # a step the cache refuses fails as before
            await engine.run(span, first, tokens[:, :1], 9)

    async def decode_together() -> None:
        second = span.new_cache(1, 16)
        await engine.run(span, second, tokens[:, :1], 0)  # joins while the first is still decoding
        steps = [engine.run(span, cache, tokens[:, 5:6], cache.length) for cache in (first, second)]
        await asyncio.gather(*steps)

    try:
        asyncio.run(decode_alone())
        assert engine.stats.decisions.get("inline") == 4, engine.stats.decisions  # the first step measured
        inline = engine.stats.decisions["inline"]
        asyncio.run(decode_together())
        assert engine.stats.decisions["inline"] == inline, engine.stats.decisions
        assert engine.stats.max_batch == 2, engine.stats.summary()
    finally:
        engine.shutdown(wait=True)


# --- the pure prefill/decode rule, on hand-computed cases ------------------------------------------
POLICY = SchedulerPolicy(
    batch_wait=0.002, max_batch_rows=16, max_prefill_skips=4, max_prefill_wait=0.5, max_decode_wait=0.5
)
# decode: 10 ms per iteration + 1 ms per row; prefill: 5 ms + 0.5 ms per token
COSTS = CostModel(decode=LinearCost(0.010, 0.001), prefill=LinearCost(0.005, 0.0005))


def view(
    now=1.0,
    rows=0,
    decode_at=None,
    tokens=0,
    prefill_at=None,
    skips=0,
    expected=0,
    ahead=(),
    started=False,
) -> QueueView:
    """`ahead`: tokens each waiting decode session (one row each) may still decode; () = unknown."""
    return QueueView(
        now=now,
        decode_rows=rows,
        decode_oldest=decode_at,
        decode_sessions=rows,
        decode_expected=expected,
        prefill_tokens=tokens,
        prefill_oldest=prefill_at,
        prefill_skips=skips,
        decode_ahead_max=max(ahead, default=0),
        decode_ahead_rows=sum(ahead),
        prefill_started=started,
    )


def test_rule_nothing_or_one_kind_waiting():
    assert decide(view(), COSTS, POLICY).action is Action.IDLE
    assert decide(view(tokens=500, prefill_at=0.9), COSTS, POLICY).action is Action.PREFILL
    # a lone decode step waits for the rest of its 2 ms window: 0.5 ms arrived, 1.5 ms to go
    waiting = decide(view(now=1.0005, rows=3, decode_at=1.0), COSTS, POLICY)
    assert waiting.action is Action.WAIT and waiting.wait == pytest.approx(0.0015)
    assert decide(view(now=1.002, rows=3, decode_at=1.0), COSTS, POLICY).action is Action.DECODE
    # a full batch does not wait for the window
    assert decide(view(now=1.0, rows=16, decode_at=1.0), COSTS, POLICY).action is Action.DECODE
    # nor does a batch that already holds every session decoding lately (here: 3 of 3)
    assert decide(view(now=1.0, rows=3, decode_at=1.0, expected=3), COSTS, POLICY).action is Action.DECODE
    assert decide(view(now=1.0, rows=3, decode_at=1.0, expected=4), COSTS, POLICY).action is Action.WAIT


def test_rule_compares_prefill_cost_with_waiting_decode_time():
    # 8 decode rows: C_d = 10 + 8 = 18 ms. A 20-token prefill: C_p = 5 + 10 = 15 ms < 18: prefill now
    cheap = decide(view(now=1.003, rows=8, decode_at=1.0, tokens=20, prefill_at=1.0), COSTS, POLICY)
    assert (cheap.action, cheap.rule) == (Action.PREFILL, "prefill-cheaper")
    # a 40-token prefill: C_p = 25 ms >= 18 ms: keep decoding
    dear = decide(view(now=1.003, rows=8, decode_at=1.0, tokens=40, prefill_at=1.0), COSTS, POLICY)
    assert dear.action is Action.DECODE
    # the boundary: 26 tokens make C_p = 18 ms = C_d, which is not below: decode
    edge = decide(view(now=1.003, rows=8, decode_at=1.0, tokens=26, prefill_at=1.0), COSTS, POLICY)
    assert edge.action is Action.DECODE
    # 16 rows make C_d = 26 ms > 25 ms: the same 40-token prefill now goes first
    more = decide(view(now=1.003, rows=16, decode_at=1.0, tokens=40, prefill_at=1.0), COSTS, POLICY)
    assert more.action is Action.PREFILL
    # keeping on decoding still lets the batch window fill
    filling = decide(view(now=1.001, rows=8, decode_at=1.0, tokens=40, prefill_at=1.0), COSTS, POLICY)
    assert filling.action is Action.WAIT


def test_rule_counts_the_decode_work_still_ahead():
    # 8 sessions with 3 tokens to go: C_d = 10 ms * 3 iterations + 1 ms * 24 row-tokens = 54 ms
    ahead = dict(now=1.003, rows=8, decode_at=1.0, prefill_at=1.0, ahead=(3,) * 8)
    assert decide(view(tokens=96, **ahead), COSTS, POLICY).action is Action.PREFILL  # C_p 53 ms
    assert decide(view(tokens=98, **ahead), COSTS, POLICY).action is Action.DECODE  # C_p 54 ms
    # uneven sessions: 4 iterations while the longest lasts, 1+1+2+4 = 8 row-tokens: C_d = 48 ms
    uneven = dict(now=1.003, rows=4, decode_at=1.0, prefill_at=1.0, ahead=(1, 1, 2, 4))
    assert decide(view(tokens=85, **uneven), COSTS, POLICY).action is Action.PREFILL  # C_p 47.5 ms
    assert decide(view(tokens=86, **uneven), COSTS, POLICY).action is Action.DECODE  # C_p 48 ms
    # decoders about to finish (1 token each): C_d = 18 ms, one iteration; the prefill waits
    ending = dict(now=1.003, rows=8, decode_at=1.0, prefill_at=1.0, ahead=(1,) * 8)
    assert decide(view(tokens=40, **ending), COSTS, POLICY).action is Action.DECODE


def test_rule_caps_keep_either_side_from_starving():
    dear = dict(rows=8, decode_at=1.0, tokens=400, prefill_at=1.0)  # C_p = 205 ms >> C_d = 18 ms
    assert decide(view(now=1.003, skips=3, **dear), COSTS, POLICY).action is Action.DECODE
    skipped = decide(view(now=1.003, skips=4, **dear), COSTS, POLICY)
    assert (skipped.action, skipped.rule) == (Action.PREFILL, "prefill-skips-cap")
    waited = decide(view(now=1.5, **{**dear, "decode_at": 1.49}), COSTS, POLICY)
    assert (waited.action, waited.rule) == (Action.PREFILL, "prefill-wait-cap")
    # cheap prefills keep winning, until the oldest decode step has waited max_decode_wait
    cheap = dict(rows=8, tokens=2, prefill_at=1.4)
    assert decide(view(now=1.45, decode_at=1.0, **cheap), COSTS, POLICY).action is Action.PREFILL
    assert decide(view(now=1.5, decode_at=1.0, **cheap), COSTS, POLICY).action is Action.DECODE


def test_rule_alternates_a_started_chunked_prefill_with_decoding():
    """After its first chunk, a chunked prefill's chunks alternate with decode iterations: a waiting
    decode batch goes first (even though one chunk is "cheaper than the decoding ahead"), and the
    next chunk goes as soon as one decode iteration has run."""
    chunk = dict(tokens=20, prefill_at=1.0, started=True)  # C_p 15 ms < C_d: would win if not started
    assert decide(view(now=1.003, rows=8, decode_at=1.0, **chunk), COSTS, POLICY).action is Action.DECODE
    # the decode batch's window still applies
    filling = decide(view(now=1.001, rows=8, decode_at=1.0, **chunk), COSTS, POLICY)
    assert filling.action is Action.WAIT
    turn = decide(view(now=1.003, rows=8, decode_at=1.0, skips=1, **chunk), COSTS, POLICY)
    assert (turn.action, turn.rule) == (Action.PREFILL, "chunk-turn")
    assert decide(view(now=1.003, **chunk), COSTS, POLICY).action is Action.PREFILL  # nobody decodes
    # a prefill that has not started is inserted by the cost rule, as before
    fresh = decide(view(now=1.003, rows=8, decode_at=1.0, tokens=20, prefill_at=1.0), COSTS, POLICY)
    assert (fresh.action, fresh.rule) == (Action.PREFILL, "prefill-cheaper")


def test_linear_fit_learns_costs():
    fit = LinearFit(LinearCost(0.0, 1e-3))
    for units in (1, 4, 16, 64, 2, 8):
        fit.observe(units, 0.010 + 0.0005 * units)
    learned = fit.cost()
    assert learned(16) == pytest.approx(0.018, rel=0.02)
    assert learned(64) == pytest.approx(0.042, rel=0.02)
    # every run of the same size: the fit still predicts that size well
    same = LinearFit(LinearCost(0.0, 1e-3))
    for _ in range(50):
        same.observe(16, 0.008)
    assert same.cost()(16) == pytest.approx(0.008, rel=0.05)


# --- through a real server process --------------------------------------------------------------
PROMPTS = [
    "The quick brown fox jumps over the lazy dog",
    "Once upon a time",
    "Paris",
    "one two three four five six",
    "A swarm of volunteer servers",
    "It learned",
    "numbers: one two",
    "Tokyo, Nairobi, Lima",
]


@pytest.mark.swarm
def test_eight_concurrent_clients_through_a_batching_server(llama_dir, tmp_path, local_reference):
    from harness.local_swarm import LocalSwarm, prometheus_sample
    from llm_swarm.client import AutoDistributedModelForCausalLM
    from llm_swarm.swarm.dht_keys import default_prefix

    tokenizer = AutoTokenizer.from_pretrained(llama_dir)
    reference = local_reference(llama_dir)[0]
    prompts = [tokenizer(text, return_tensors="pt").input_ids for text in PROMPTS]
    expected = [reference.generate(p, max_new_tokens=16, do_sample=False) for p in prompts]
    swarm = LocalSwarm(tmp_path)
    clients = []
    try:
        swarm.start_dht()
        swarm.start_server(
            "batching", llama_dir, f"0:{NUM_BLOCKS}", "1GB", "--batch-wait-ms", "5", "--metrics-port", "0"
        )
        swarm.wait_online(default_prefix(str(llama_dir)), NUM_BLOCKS, ["batching"])
        clients = [
            AutoDistributedModelForCausalLM.from_pretrained(llama_dir, initial_peers=swarm.initial_peers)
            for _ in range(2)
        ]
        results: dict[int, torch.Tensor] = {}
        errors: list[BaseException] = []
        barrier = threading.Barrier(len(prompts))

        def run(index: int) -> None:
            try:
                barrier.wait(timeout=60)
                client = clients[index % 2]
                results[index] = client.generate(prompts[index], max_new_tokens=16, do_sample=False)
            except BaseException as error:  # reported below
                errors.append(error)

        threads = [threading.Thread(target=run, args=(index,)) for index in range(len(prompts))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
        assert not errors, errors
        for index, want in enumerate(expected):
            assert torch.equal(results[index], want), index
        # 120 decode steps at several loads: the server announces what each decoding session adds
        swarm.wait_for(
            default_prefix(str(llama_dir)),
            NUM_BLOCKS,
            lambda online: online["batching"].tau_per_session is not None,
            30,
        )
        metrics = swarm.metrics("batching")
    finally:
        for client in clients:
            client.shutdown()
        leaked = swarm.close()
    assert not leaked
    iterations = prometheus_sample(metrics, "swarm_server_decode_batch_steps_count")
    alone = prometheus_sample(metrics, "swarm_server_decode_batch_steps_bucket", 'le="1.0"')
    assert iterations > alone, (iterations, alone)  # some decode iteration ran several sessions' steps
    assert prometheus_sample(metrics, "swarm_server_tau_per_session_seconds") >= 0.0
