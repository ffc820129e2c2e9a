"""Greedy speculative decoding for a batch of sequences, each accepting its own number of drafts.

`transformers`' assisted generation handles one sequence. Here every row of a batch is drafted for
(by a local assistant model, or by prompt lookup in the row's own text) and the drafts of all rows
are verified in one session step. Row `r` accepts the `m_r` leading drafts that equal the target's
greedy choices, plus the target's own next token. The session then continues from the position after
the longest accepted run, `M = max m_r`: rows that accepted fewer leave `M - m_r` positions that hold
rejected drafts, which are masked out for every later step (attention skips them, and positions
are counted over real tokens only, as with left padding), so each row's tokens are exactly what
greedy decoding gives it alone. Nothing is resent: the session is rewound to the new position
(`InferenceSession.rewind`) and the next step carries the masks.

Only greedy search is supported here (the output equals `generate(do_sample=False)` of the same
padded batch); rows that finish (EOS) are padded with `pad_token_id` as transformers does.
"""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass

import torch
from transformers import GenerationConfig
from transformers.cache_utils import DynamicCache
from transformers.generation.candidate_generator import PromptLookupCandidateGenerator

from llm_swarm.client.speculation.draft_length import DraftLength
from llm_swarm.swarm.errors import SwarmUserError
from llm_swarm.swarm.transformers_compat import GENERATE_CACHE_ARGUMENT

# generation settings that would add logits processors, which this loop does not apply
_UNSUPPORTED = {
    "repetition_penalty": 1.0,
    "no_repeat_ngram_size": 0,
    "encoder_no_repeat_ngram_size": 0,
    "bad_words_ids": None,
    "min_length": 0,
    "min_new_tokens": None,
    "suppress_tokens": None,
    "begin_suppress_tokens": None,
    "forced_bos_token_id": None,
    "forced_eos_token_id": None,
    "sequence_bias": None,
    "num_beams": 1,
    "num_return_sequences": 1,
}


def check_batched_config(config: GenerationConfig) -> None:
    """Refuse the settings batched speculation cannot honour, naming them."""
    if config.do_sample:
        raise SwarmUserError(
            "speculative decoding of a batch (more than one sequence) supports greedy search only: "
            "pass do_sample=False, or generate one sequence at a time to sample"
        )
    wrong = [
        name
        for name, neutral in _UNSUPPORTED.items()
        if getattr(config, name, neutral) not in (neutral, None if neutral == 0 else neutral)
    ]
    if wrong:
        raise SwarmUserError(
            "speculative decoding of a batch does not support " + ", ".join(sorted(wrong)) + "; "
            "generate one sequence at a time for them"
        )


@dataclass
class BatchState:
    """The batch's token layout by position: what the session processed, and its masks."""

    ids: torch.Tensor  # [batch, processed positions]: token ids, rejected drafts included
    mask: torch.Tensor  # [batch, processed positions]: 1 real, 0 padding or a rejected draft
    pending: torch.Tensor  # [batch]: each row's newest token, not processed yet
    generated: list[list[int]]  # per row: tokens produced so far
    finished: list[bool]


class AssistantDrafter:
    """Greedy drafts from a local `transformers` model that keeps its own cache of the layout."""

    def __init__(self, assistant):
        self.model = assistant
        self.cache = DynamicCache()
        self.seen = 0  # layout positions in the assistant's cache
        self._takes_positions = "position_ids" in inspect.signature(assistant.forward).parameters

    @torch.inference_mode()
    def draft(self, state: BatchState, k: int) -> torch.Tensor:
        """`[batch, k]` drafts continuing every row's layout (rejected positions masked)."""
        device = self.model.device
        self.seen = min(self.seen, state.ids.shape[1])
        surplus = self.cache.get_seq_length() - self.seen
        if surplus > 0:  # a negative count drops that many in every version (5.x refuses lengths)
            self.cache.crop(-surplus)
        ids = torch.cat([state.ids[:, self.seen :], state.pending[:, None]], dim=1)
        mask = torch.cat([state.mask, torch.ones_like(state.mask[:, :1])], dim=1)
        drafts = []
        for _ in range(k):
            logits = self._forward(ids, mask, device)
            token = logits[:, -1].argmax(-1).cpu()
            drafts.append(token)
            ids = token[:, None]
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        return torch.stack(drafts, dim=1)

    def _forward(self, ids: torch.Tensor, mask: torch.Tensor, device) -> torch.Tensor:
        kwargs = {}
        if self._takes_positions:  # transformers' rule for padded batches: count real tokens only
            positions = mask.long().cumsum(-1) - 1
            positions.masked_fill_(mask == 0, 1)
            kwargs["position_ids"] = positions[:, -ids.shape[1] :].to(device)
        output = self.model(
            input_ids=ids.to(device),
            attention_mask=mask.to(device),
            **{GENERATE_CACHE_ARGUMENT: self.cache},
            use_cache=True,
            **kwargs,
        )
        self.seen += ids.shape[1]
        return output.logits.float()


class LookupDrafter:
    """Prompt lookup (transformers' n-gram matcher) run on each row's own text."""

    def __init__(self, max_ngram: int, eos_token_id: torch.Tensor | None):
        self.max_ngram = max_ngram
        self.eos_token_id = eos_token_id

    def draft(self, state: BatchState, k: int, prompts: list[torch.Tensor]) -> torch.Tensor:
        rows = []
        for row in range(len(state.generated)):
            text = torch.cat([prompts[row], torch.tensor(state.generated[row], dtype=torch.long)])[None]
            matcher = PromptLookupCandidateGenerator(
                eos_token_id=self.eos_token_id,
                num_output_tokens=k,
                max_matching_ngram_size=self.max_ngram,
                max_length=text.shape[1] + k + 1,
            )
            candidates, _ = matcher.get_candidates(text)
            rows.append(candidates[0, text.shape[1] :])
        width = max((len(found) for found in rows), default=0)
        drafts = torch.zeros(len(rows), width, dtype=torch.long)
        for row, found in enumerate(rows):  # a row with fewer candidates repeats its last one: greedy
            if len(found):  # acceptance is by equality, so filler is just a draft that rarely matches
                drafts[row, : len(found)] = found
                drafts[row, len(found) :] = found[-1]
        return drafts


def accepted_counts(drafts: torch.Tensor, chosen: torch.Tensor) -> list[int]:
    """Per row: how many leading drafts equal the target's greedy choices (`chosen[:, :k]`)."""
    k = drafts.shape[1]
    matches = (drafts == chosen[:, :k]).long()
    return [int(n) for n in matches.cumprod(dim=1).sum(dim=1)]


class BatchedSpeculation:
    """One batched greedy generation with drafts; see the module docstring."""

    def __init__(self, model, session, draft_length: DraftLength, *, assistant=None, lookup_ngram: int = 0):
        if (assistant is None) == (lookup_ngram <= 0):
            raise ValueError("batched speculation needs exactly one of an assistant model and prompt lookup")
        self.model, self.session, self.draft_length = model, session, draft_length
        self.assistant = AssistantDrafter(assistant) if assistant is not None else None
        self.lookup = LookupDrafter(lookup_ngram, None) if assistant is None else None

    @torch.inference_mode()
    def generate(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        max_new_tokens: int,
        eos_token_ids: set[int],
        pad_token_id: int,
    ) -> torch.Tensor:
        batch = input_ids.shape[0]
        mask = attention_mask.long().cpu() if attention_mask is not None else torch.ones_like(input_ids)
        prompts = [input_ids[row][mask[row].bool()].cpu() for row in range(batch)]
        if self.lookup is not None:
            self.lookup.eos_token_id = torch.tensor(sorted(eos_token_ids)) if eos_token_ids else None
        offset = self.session.position - self.session.token_ids.shape[1]  # an embedded prefix
        known = self.session.token_ids.shape[1]
        if known and not torch.equal(input_ids[:, :known].cpu(), self.session.token_ids):
            raise SwarmUserError("input_ids must start with the tokens this inference session has processed")
        # the prompt (what the session has not processed of it) as one step
        logits = self._step(input_ids.cpu(), mask)
        first = logits[:, -1].argmax(-1)
        state = BatchState(input_ids.cpu(), mask, first, [[] for _ in range(batch)], [False] * batch)
        self._emit(state, [[int(token)] for token in first], max_new_tokens, eos_token_ids)
        while not all(state.finished):
            still = [len(state.generated[r]) for r in range(batch) if not state.finished[r]]
            room = self.session.max_length - self.session.position
            need = max_new_tokens - min(still)  # tokens the slowest row still needs
            # leave room to finish with plain steps: each round advances every row by >= 1 token
            k = self.draft_length.choose(limit=min(max_new_tokens - min(still) - 1, room - need))
            drafts = self._draft(state, k, prompts)
            k = drafts.shape[1]
            verify_ids = torch.cat([state.pending[:, None], drafts], dim=1)
            step_mask = torch.cat([state.mask, torch.ones_like(verify_ids)], dim=1)
            logits = self._step(torch.cat([state.ids, verify_ids], dim=1), step_mask)
            chosen = logits.argmax(-1)  # [batch, k + 1]
            counts = accepted_counts(drafts, chosen)
            live = [r for r in range(batch) if not state.finished[r]]
            for r in live:
                self.draft_length.observe_round(k, counts[r])
            longest = max(counts[r] for r in live)
            new_tokens = [
                drafts[r, : counts[r]].tolist() + [int(chosen[r, counts[r]])] if not state.finished[r] else []
                for r in range(batch)
            ]
            # keep positions up to the longest accepted run; shorter rows' rejected drafts are masked
            kept = state.ids.shape[1] + longest + 1
            row_mask = torch.zeros(batch, longest + 1, dtype=torch.long)
            for r in range(batch):
                row_mask[r, : min(counts[r], longest) + 1] = 1
            state.ids = torch.cat([state.ids, verify_ids[:, : longest + 1]], dim=1)
            state.mask = torch.cat([state.mask, row_mask], dim=1)
            state.pending = torch.tensor(
                [new_tokens[r][-1] if new_tokens[r] else int(state.pending[r]) for r in range(batch)]
            )
            self.session.rewind(offset + kept)
            prefix = torch.ones(batch, offset, dtype=torch.long)
            self.session.exclude_positions(torch.cat([prefix, state.mask], dim=1))
            self._emit(state, new_tokens, max_new_tokens, eos_token_ids)
        return self._output(input_ids.cpu(), state, pad_token_id).to(input_ids.device)

    def _draft(self, state: BatchState, k: int, prompts: list[torch.Tensor]) -> torch.Tensor:
        if k == 0:
            return torch.zeros(len(state.generated), 0, dtype=torch.long)
        started = time.perf_counter()
        if self.assistant is not None:
            drafts = self.assistant.draft(state, k)
        else:
            drafts = self.lookup.draft(state, k, prompts)
        self.draft_length.observe_draft(drafts.shape[1], time.perf_counter() - started)
        return drafts

    def _step(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The session's logits for the positions of `ids` it has not processed (the model's forward
        records the step's time in `session.step_costs`, which the cost model reads)."""
        return self.model._forward_in(self.session, ids, mask).logits

    @staticmethod
    def _emit(state: BatchState, new_tokens: list[list[int]], limit: int, eos: set[int]) -> None:
        for row, tokens in enumerate(new_tokens):
            if state.finished[row]:
                continue
            for token in tokens:
                state.generated[row].append(token)
                if token in eos or len(state.generated[row]) >= limit:
                    state.finished[row] = True
                    break

    @staticmethod
    def _output(input_ids: torch.Tensor, state: BatchState, pad_token_id: int) -> torch.Tensor:
        length = max(len(tokens) for tokens in state.generated)
        tail = torch.full((input_ids.shape[0], length), pad_token_id, dtype=torch.long)
        for row, tokens in enumerate(state.generated):
            tail[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        return torch.cat([input_ids, tail], dim=1)
