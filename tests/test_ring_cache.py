"""A sliding-window block's ring: what a session of a Mistral span computes with blocks that keep only
`window - 1 + REWIND_RESERVE` positions equals what it computes with the whole cache kept and masked,
through decode steps, chunks longer than the reserve, rewinds, beam reorders and padded batches; a
rewind deeper than the reserve is refused by name; hand-offs read and write positions wherever their
slots are; the memory a session reserves is what its cache allocates."""

from __future__ import annotations

import json

import pytest
import torch

from llm_swarm.swarm.models import load_span
from llm_swarm.swarm.models.cache import REWIND_RESERVE, SpanCache
from llm_swarm.swarm.models.tiny import TinyModelSpec, build_tiny_model

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
