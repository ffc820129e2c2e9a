"""The draft-length cost model of speculative decoding, and the pure pieces of rewinding
and of replaying a history."""

from __future__ import annotations

import pytest
import torch

from llm_swarm.client.replay import replay_groups, replay_tensors, session_mask
from llm_swarm.client.speculation.draft_length import (
    DraftLength,
    DraftLengthOptions,
    best_draft_length,
    expected_tokens,
)
from llm_swarm.client.stream import StepInput, catch_up_input
from llm_swarm.swarm.linear_fit import LinearCost

ROUND_TRIP = LinearCost(fixed=0.150, per_unit=0.0005)  # three 50 ms hops; verifying a token costs little
CHEAP_DRAFT = LinearCost(fixed=0.0, per_unit=0.002)


def test_expected_tokens_counts_the_targets_own_token():
    assert expected_tokens(0.0, 5) == 1.0
    assert expected_tokens(1.0, 5) == 6.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)


def test_the_best_draft_length_follows_acceptance_and_costs():
    assert best_draft_length(0.99, ROUND_TRIP, CHEAP_DRAFT, 16) == 16  # long drafts pay over 150 ms
    assert best_draft_length(0.0, ROUND_TRIP, CHEAP_DRAFT, 16) == 0  # nothing is ever accepted
    middling = best_draft_length(0.6, ROUND_TRIP, CHEAP_DRAFT, 16)
    assert 2 <= middling < 16
    # on loopback the round trip is nearly free, so a draft as slow as the target never pays
    loopback = LinearCost(fixed=0.002, per_unit=0.0005)
    assert best_draft_length(0.6, loopback, LinearCost(0.0, 0.003), 16) == 0


def _observe_steps(draft_length: DraftLength, rounds: int = 20) -> None:
    for tokens in (1, 4, 9, 1, 6):
        draft_length.observe_step(tokens, ROUND_TRIP(tokens))
    draft_length.observe_draft(4, CHEAP_DRAFT(4))


def test_a_draft_that_never_agrees_is_turned_off_and_probed_ever_more_rarely():
    draft_length = DraftLength(DraftLengthOptions())
    _observe_steps(draft_length)
    choices = []
    for _ in range(200):
        k = draft_length.choose()
        choices.append(k)
        draft_length.observe_round(k, 0)
    assert choices[0] == DraftLengthOptions().first_draft
    tail = choices[100:]
    assert max(tail) == 1 and tail.count(1) <= 3  # probes only, with a backoff
    assert choices[:30].count(0) > 0  # off within the first 30 rounds


def test_a_perfect_draft_grows_to_the_longest_draft_and_a_limit_caps_it():
    draft_length = DraftLength(DraftLengthOptions(max_draft=12))
    _observe_steps(draft_length)
    for _ in range(10):
        k = draft_length.choose()
        draft_length.observe_round(k, k)
    assert draft_length.choose() == 12
    assert draft_length.choose(limit=3) == 3
    assert draft_length.choose(limit=0) == 0
    assert draft_length.token_acceptance == 1.0


def test_a_fixed_draft_length_is_kept():
    draft_length = DraftLength(DraftLengthOptions(adaptive=False, max_draft=5, first_draft=5))
    for _ in range(5):
        draft_length.observe_round(5, 0)
    assert draft_length.choose() == 5


def test_options_are_validated():
    with pytest.raises(ValueError):
        DraftLengthOptions(max_draft=0)
    with pytest.raises(ValueError):
        DraftLengthOptions(initial_acceptance=1.0)
    with pytest.raises(ValueError):
        DraftLengthOptions(memory=0.0)


def _sent(position: int, width: int, mark: float) -> StepInput:
    return StepInput(torch.full((1, width, 2), mark), position)


def test_catch_up_uses_what_each_step_left_valid_after_rewinds():
    # prefill [0, 4), a verification [4, 9) rewound to 6, then a step [6, 8)
    history = [_sent(0, 4, 1.0), _sent(4, 5, 2.0), _sent(6, 2, 3.0)]
    caught = catch_up_input(history, 0)
    assert caught.position == 0
    assert caught.hidden[0, :, 0].tolist() == [1, 1, 1, 1, 2, 2, 3, 3]
    from_five = catch_up_input(history, 5)
    assert from_five.position == 5 and from_five.hidden[0, :, 0].tolist() == [2, 3, 3]
    assert catch_up_input(history, 8) is None


def test_replay_groups_split_by_tokens_and_refuse_masks_they_cannot_carry():
    history = [_sent(0, 4, 1.0), _sent(4, 5, 2.0), _sent(6, 2, 3.0), _sent(8, 1, 4.0)]
    groups = replay_groups(history, max_tokens=8)
    assert [[sent.position for sent in group] for group in groups] == [[0], [4, 6, 8]]
    prompted = StepInput(torch.zeros(1, 1, 2), 4, prompts=torch.zeros(1))
    assert replay_groups([history[0], prompted], 8) is None  # deep prompts: replayed step by step
    # masks: a later step excluded position 1 (a rejected draft): the replay's session mask says so
    masked = [
        StepInput(torch.zeros(1, 2, 2), 0, torch.tensor([[1, 1]])),
        StepInput(torch.zeros(1, 1, 2), 2, torch.tensor([[1, 0, 1]])),
    ]
    assert session_mask(masked).tolist() == [[1, 0, 1]]
    tensors, with_masks, reordered = replay_tensors(masked)
    assert with_masks and not reordered
    assert tensors[0].tolist() == [[0, 2, 0, 1], [2, 1, 0, 1]]
    assert tensors[2].long().tolist() == [[1, 1, 1]] and tensors[3].long().tolist() == [[1, 0, 1]]
    # a mask that changed below a later step's position in another way cannot travel in one replay
    odd = [masked[1], StepInput(torch.zeros(1, 1, 2), 3, torch.tensor([[1, 1, 1, 1]]))]
    assert session_mask(odd) is None and replay_groups(odd, 8) is None


def test_continuation_tells_the_two_conventions_apart_and_refuses_what_fits_neither():
    from llm_swarm.client.continuation import continuation, mask_after

    last = torch.tensor([[0, 5, 6, 7]])
    last_mask = torch.tensor([[0, 1, 1, 1]])
    first = continuation(torch.tensor([[5, 6]]), None, None, None)
    assert first.returned_from == 0 and first.attention_mask is None
    with pytest.raises(ValueError, match="generate\\(None\\) continues"):
        continuation(None, None, None, None)
    whole = continuation(torch.cat([last, torch.tensor([[9]])], 1), None, last, last_mask)
    assert whole.returned_from == 0 and whole.attention_mask.tolist() == [[0, 1, 1, 1, 1]]
    petals = continuation(None, None, last, last_mask)
    assert torch.equal(petals.input_ids, last) and petals.returned_from == 4
    turn = continuation(torch.tensor([[8, 9]]), torch.tensor([[1, 1]]), last, last_mask)
    assert turn.input_ids.tolist() == [[0, 5, 6, 7, 8, 9]] and turn.attention_mask.tolist() == [
        [0, 1, 1, 1, 1, 1]
    ]
    with pytest.raises(ValueError, match="must have 1 rows"):
        continuation(torch.tensor([[8], [9]]), None, last, last_mask)
    with pytest.raises(ValueError, match="attention_mask covers 3 positions"):
        continuation(torch.tensor([[8, 9]]), torch.ones(1, 3, dtype=torch.long), last, last_mask)
    assert mask_after(torch.zeros(1, 6), torch.tensor([[0, 1, 1, 1]]), 4).tolist() == [[0, 1, 1, 1, 1, 1]]
    assert mask_after(torch.zeros(1, 6), None, 4) is None
