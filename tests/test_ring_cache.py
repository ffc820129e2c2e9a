"""A sliding-window block's ring: what a session of a Mistral span computes with blocks that keep only
`window - 1 + REWIND_RESERVE` positions equals what it computes with the whole cache kept and masked,
through decode steps, chunks longer than the reserve, rewinds, beam reorders and padded batches; a
rewind deeper than the reserve is refused by name; hand-offs read and write positions wherever their
slots are; the memory a session reserves is what its cache allocates, and what readers of the
records count for a session (routing, hand-off pricing, the scheduler's `s_c`) is its rings."""

from __future__ import annotations

import json

import pytest
import torch

from llm_swarm.client.handoff_cost import move_costs
from llm_swarm.scheduler.service.view import ModelShape
from llm_swarm.swarm.cost import REWIND_RESERVE
from llm_swarm.swarm.model_limits import ModelLimits
from llm_swarm.swarm.models import load_span
from llm_swarm.swarm.models.cache import SpanCache
from llm_swarm.swarm.models.tiny import TinyModelSpec, build_tiny_model
from llm_swarm.swarm.server_info import ServerInfo
from tests.test_record_validation import server_record

WINDOW = 5
RING = WINDOW - 1 + REWIND_RESERVE
MAX_LENGTH = 400


@pytest.fixture(scope="module")
def span(tmp_path_factory):
    model_dir = build_tiny_model(
        tmp_path_factory.mktemp("ring") / "mistral",
        TinyModelSpec(family="mistral", num_layers=2, num_kv_heads=2),
    )
    config = json.loads((model_dir / "config.json").read_text())
    config["sliding_window"] = WINDOW
    (model_dir / "config.json").write_text(json.dumps(config))
    return load_span(model_dir, 0, 2)[0]


def whole_cache(span, batch_size: int) -> SpanCache:
    """The same session's cache with every position kept (the window only in the mask)."""
    layout = span.cache_layout
    return SpanCache(
        2, batch_size, layout.heads, layout.key_dim, MAX_LENGTH, span.dtype, value_dim=layout.value_dim
    )


def run_both(span, ring: SpanCache, whole: SpanCache, hidden: torch.Tensor, position: int, mask=None):
    got = span(hidden, ring, position, mask)
    expected = span(hidden, whole, position, mask)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_a_ring_computes_what_the_whole_cache_computes(span):
    """Steps that cross the ring in every way it can be crossed: decode steps one by one past its end,
    a chunk longer than the reserve (its queries see the kept keys and each other), a speculative
    round (a draft written, then rewound to its accepted part), a rewind of exactly the reserve once
    the ring has wrapped, and beam search's reorders."""
    generator = torch.Generator().manual_seed(0)
    ring, whole = span.new_cache(3, MAX_LENGTH), whole_cache(span, 3)
    assert [tensor.shape[2] for tensor in ring.keys] == [RING, RING]

    def tokens(count: int) -> torch.Tensor:
        return torch.randn(3, count, span.hidden_size, generator=generator)

    run_both(span, ring, whole, tokens(10), 0)
    for position in range(10, RING + 6):  # past the ring, one token at a time
        run_both(span, ring, whole, tokens(1), position)
    length = ring.length
    run_both(span, ring, whole, tokens(100), length)  # longer than the reserve and the ring
    length = ring.length
    run_both(span, ring, whole, tokens(6), length)  # a draft of 6 ...
    run_both(span, ring, whole, tokens(1), length + 2)  # ... of which 2 were accepted
    assert ring.written == ring.length + 3  # the rejected drafts' slots hold newer keys now
    run_both(span, ring, whole, tokens(1), ring.written - REWIND_RESERVE)  # the deepest rewind it allows
    hypotheses = torch.tensor([2, 0, 0])
    ring.reorder(hypotheses)
    whole.reorder(hypotheses)
    run_both(span, ring, whole, tokens(1), ring.length)


def test_a_padded_batch_past_the_ring(span):
    generator = torch.Generator().manual_seed(1)
    ring, whole = span.new_cache(2, MAX_LENGTH), whole_cache(span, 2)
    mask = torch.ones(2, 200, dtype=torch.long)
    mask[1, :9] = 0  # the second sequence is left-padded
    run_both(span, ring, whole, torch.randn(2, 12, span.hidden_size, generator=generator), 0, mask[:, :12])
    for position in range(12, 200, 17):
        count = min(17, 200 - position)
        hidden = torch.randn(2, count, span.hidden_size, generator=generator)
        run_both(span, ring, whole, hidden, position, mask[:, : position + count])


def test_a_rewind_deeper_than_the_reserve_is_refused_by_name(span):
    cache = span.new_cache(1, MAX_LENGTH)
    span(torch.randn(1, RING + 30, span.hidden_size), cache, 0)
    position = cache.written - REWIND_RESERVE - 1
    assert "rewind at most" in cache.rewind_error(position)
    with pytest.raises(ValueError, match=f"keeps only the last {RING} positions"):
        span(torch.randn(1, 1, span.hidden_size), cache, position)
    assert cache.rewind_error(cache.written - REWIND_RESERVE) is None
    short = span.new_cache(1, MAX_LENGTH)
    span(torch.randn(1, RING, span.hidden_size), short, 0)
    assert short.rewind_error(0) is None  # nothing has left a ring that never wrapped


def test_hand_offs_read_and_write_positions_across_the_wrap(span):
    """What a hand-off moves of a wrapped ring (its kept positions, read in position order and written
    into another session's ring) continues exactly like the original."""
    generator = torch.Generator().manual_seed(2)
    source, whole = span.new_cache(1, MAX_LENGTH), whole_cache(span, 1)
    run_both(span, source, whole, torch.randn(1, RING + 23, span.hidden_size, generator=generator), 0)
    target = span.new_cache(1, MAX_LENGTH)
    for block in range(source.num_blocks):
        first = source.oldest_kept(block)
        assert first == source.length - RING
        keys, values = source.read(block, first, source.length)
        torch.testing.assert_close(keys, whole.keys[block][:, :, first : source.length])
        target.write(block, first, keys, values)
    target.length = source.length
    with pytest.raises(ValueError, match="holds positions"):
        source.read(0, first - 1, source.length)
    token = torch.randn(1, 1, span.hidden_size, generator=generator)
    torch.testing.assert_close(span(token, target, target.length), span(token, source, source.length))


def test_a_session_reserves_what_its_ring_allocates(span):
    for max_length in (3, RING, MAX_LENGTH, 100_000):
        with torch.device("meta"):
            cache = span.new_cache(2, max_length)
        assert span.session_cache_bytes(2, max_length, 0, 2) == cache.nbytes
    assert span.session_cache_bytes(1, 100_000, 0, 2) == span.cache_bytes(RING) * 2


def test_readers_count_a_sliding_blocks_cache_as_its_ring(span):
    """What clients, the scheduler and a server's announced slots count for a session follows the
    rings its blocks keep, from the reader's own config: routing, hand-off pricing and `s_c`."""
    limits, shape = ModelLimits.from_config(span.config), ModelShape.from_config(span.config)
    assert limits.block_windows == shape.block_windows == (WINDOW, WINDOW)
    for tokens in (3, RING, MAX_LENGTH):
        kept = span.session_cache_bytes(1, tokens, 0, 2) // span.cache_bytes(1)
        assert limits.cached_positions(0, 2, tokens) == kept == 2 * min(tokens, RING)
        assert shape.cache_tokens_per_block(tokens) == min(tokens, RING)
    # a hand-off of a session past the ring moves the rings, not every position it saw
    server = ServerInfo.from_wire(server_record())
    kept = limits.cached_positions(0, 2, MAX_LENGTH)
    links = {"rtt_source": 0.0, "rtt_target": 0.0, "uplink_bytes_per_s": 1e6, "link_bytes_per_s": 1e6}
    session = {"tokens": MAX_LENGTH, "batch_size": 1, "hidden_size": 64, "blocks": 2, "kept_positions": kept}
    costs = move_costs(**session, source=server, target=server, **links)
    assert costs.handoff_seconds == pytest.approx(2 * RING * server.cache_token_bytes / 1e6)


def test_batched_decode_steps_past_the_ring_equal_steps_alone(span):
    """One batched forward over sessions inside the ring, past it with a padded batch, and past it
    just after a rewind (slots holding newer keys than the step sees): each equals its step alone."""
    generator = torch.Generator().manual_seed(2)
    padding = torch.ones(2, RING + 31, dtype=torch.long)
    padding[0, :7] = 0
    sessions = [(1, 10, None, 0), (2, RING + 30, padding, 0), (1, RING + 40, None, 3)]
    alone, together = [], []
    for batch_size, length, mask, rewind in sessions:
        prefix = torch.randn(batch_size, length, span.hidden_size, generator=generator)
        token = torch.randn(batch_size, 1, span.hidden_size, generator=generator)
        prefix_mask = mask[:, :length] if mask is not None else None
        step_mask = mask[:, : length - rewind + 1] if mask is not None else None
        for destination in (alone, together):
            cache = span.new_cache(batch_size, MAX_LENGTH)
            span(prefix, cache, 0, prefix_mask)
            destination.append((token, cache, length - rewind, step_mask))
    expected = [span(*step) for step in alone]
    for output, expected_output in zip(span.forward_batch(together), expected, strict=True):
        torch.testing.assert_close(output, expected_output, rtol=1e-5, atol=1e-5)
    assert all(cache.length == length + 1 for (_, cache, length, _) in together)
