"""`transformers`' candidate generators (assistant model, prompt lookup) with our draft length.

`transformers` drafts with a `CandidateGenerator` and verifies in `_assisted_decoding`; the model
asks for the generator through `GenerationMixin._get_candidate_generator`, which
`DistributedModelForCausalLM` overrides to wrap what transformers built in `AdaptiveCandidates`.
Before each round the wrapper sets the draft length that `DraftLength` chooses from the session's
measured round trips, draft times and acceptance; a length of 0 skips drafting (plain decoding
through the same loop: the verification step then carries one token). The drafts themselves, and
which are accepted (greedy matching or speculative sampling), stay transformers' own code.
"""

from __future__ import annotations

import time

import torch
from transformers.generation.candidate_generator import CandidateGenerator

from llm_swarm.client.speculation.draft_length import DraftLength


class AdaptiveCandidates(CandidateGenerator):
    """Wraps a candidate generator that drafts `num_assistant_tokens` (assistant) or
    `num_output_tokens` (prompt lookup) tokens per round, and sets that number every round."""

    def __init__(self, inner: CandidateGenerator, draft_length: DraftLength, max_length: int):
        self.inner = inner
        self.draft_length = draft_length
        self.max_length = max_length  # generate()'s: drafts never reach past it
        self._length_attribute = (
            "num_assistant_tokens" if hasattr(inner, "num_assistant_tokens") else ("num_output_tokens")
        )
        self._drafted = 0
        # transformers stops an assistant's draft early once its confidence falls below a threshold;
        # here the cost model decides the length, so the assistant drafts all `k` tokens
        config = getattr(inner, "generation_config", None)
        if config is not None and getattr(config, "assistant_confidence_threshold", None):
            config.assistant_confidence_threshold = None

    def get_candidates(self, input_ids: torch.LongTensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        # the verified sequence must stay within max_length: the target adds one token after the drafts
        room = self.max_length - input_ids.shape[1] - 1
        k = self.draft_length.choose(limit=room)
        self._drafted = 0
        if k == 0:
            return input_ids, None
        setattr(self.inner, self._length_attribute, k)
        started = time.perf_counter()
        candidates, logits = self.inner.get_candidates(input_ids)
        self._drafted = candidates.shape[1] - input_ids.shape[1]
        self.draft_length.observe_draft(self._drafted, time.perf_counter() - started)
        return candidates, logits

    def update_candidate_strategy(
        self, input_ids: torch.LongTensor, scores: torch.FloatTensor, num_matches: int
    ) -> None:
        if self._drafted:  # transformers' own bookkeeping (e.g. the assistant's confidence threshold)
            self.inner.update_candidate_strategy(input_ids, scores, num_matches)
        self.draft_length.observe_round(self._drafted, int(num_matches))
