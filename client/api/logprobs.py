"""Log-probabilities of tokens, computed as transformers computes them, and OpenAI's two formats.

What is computed: `torch.log_softmax(logits.float(), dim=-1)` of the model's raw logits at each
position (what `generate(output_logits=True)` returns, normalized as `compute_transition_scores(...,
normalize_logits=True)` does). The request's temperature and top-p change which token is sampled but
not the log-probabilities reported: OpenAI reports the model's own distribution whatever the sampling
settings (so does vLLM by default), and an evaluation harness must get the same numbers for a prompt
whether it asks greedily or not. The checkpoint's own generation-config processors (a repetition
penalty, say) do not apply to them either: these are the raw logits' log-probabilities.

How they are captured: a forward hook on the client model sees the logits of every forward it runs
(the prompt's prefill, each decoding step, speculative drafts' verification) and hands them to the
recorder of the generation running on that thread. Rows of prompt positions become the prompt's
entries at once (for `echo`); rows predicting new tokens wait until the token is known.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

FLOOR = -9999.0  # JSON has no -inf: a token the model rules out entirely reports this (as vLLM does)
ROWS_PER_CHUNK = 256  # log-softmax of a long prompt in pieces: a [2048, 150k] float32 copy is 1.2 GB


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # the most likely tokens at this position, best first


class LogprobRecorder:
    """Collects the log-probabilities of one generation (batch size 1) from the logits it computes."""

    def __init__(self, prompt_ids: list[int], top: int, echo: bool):
        self.prompt_ids, self.top, self.echo = prompt_ids, top, echo
        # the prompt's entries (for echo); the first token has none: nothing predicts it
        self.prompt: list[TokenLogprob | None] = [None] * len(prompt_ids)
        self._pending: dict[int, torch.Tensor] = {}  # position -> log-probabilities predicting it

    def observe(self, input_ids: torch.Tensor, logits: torch.Tensor) -> None:
        """`logits` [1, k, vocab] of the last k positions of `input_ids` [1, length]: row j predicts
        the token at position length - k + j + 1."""
        length, rows = input_ids.shape[1], logits.shape[1]
        first_target = length - rows + 1
        # without echo, rows predicting prompt tokens are not needed: skip their log-softmax
        skipped = 0 if self.echo else min(max(len(self.prompt_ids) - first_target, 0), rows)
        first_target += skipped
        logits = logits[:, skipped:]
        rows -= skipped
        for start in range(0, rows, ROWS_PER_CHUNK):
            stop = min(start + ROWS_PER_CHUNK, rows)
            logprobs = torch.log_softmax(logits[0, start:stop].float(), dim=-1)
            targets = range(first_target + start, first_target + stop)
            in_prompt = [index for index, target in enumerate(targets) if target < len(self.prompt_ids)]
            if self.echo and in_prompt:
                self._prompt_entries(logprobs, [targets[index] for index in in_prompt], in_prompt)
            for index in range(len(in_prompt), len(targets)):
                # a new token's distribution (or a draft's, replaced if the draft is rejected)
                self._pending[targets[index]] = logprobs[index].clone()

    def _prompt_entries(self, logprobs: torch.Tensor, targets: list[int], rows: list[int]) -> None:
        """The entries of prompt tokens, all rows of a chunk at once (a long prompt's topk adds up)."""
        rows_tensor = torch.tensor(rows)
        chosen_ids = torch.tensor([self.prompt_ids[target] for target in targets])
        chosen = logprobs[rows_tensor, chosen_ids].tolist()
        if self.top > 0:
            values, indices = logprobs[rows_tensor].topk(self.top, dim=-1)
            tops = [
                tuple(zip(row_indices, (_finite(v) for v in row_values), strict=True))
                for row_indices, row_values in zip(indices.tolist(), values.tolist(), strict=True)
            ]
        else:
            tops = [()] * len(rows)
        for target, token_id, value, top in zip(targets, chosen_ids.tolist(), chosen, tops, strict=True):
            self.prompt[target] = TokenLogprob(token_id, _finite(value), top)

    def resolve(self, position: int, token_id: int) -> TokenLogprob:
        """The entry of the token generated at `position`, whose distribution was observed."""
        row = self._pending.pop(position, None)
        if row is None:
            raise RuntimeError(f"no logits were observed for position {position}")
        for stale in [known for known in self._pending if known < position]:
            del self._pending[stale]
        return self._entry(row, token_id)

    def _entry(self, row: torch.Tensor, token_id: int) -> TokenLogprob:
        top: tuple[tuple[int, float], ...] = ()
        if self.top > 0:
            values, indices = row.topk(self.top)
            top = tuple(zip(indices.tolist(), (_finite(v) for v in values.tolist()), strict=True))
        return TokenLogprob(token_id, _finite(float(row[token_id])), top)


def _finite(value: float) -> float:
    return max(value, FLOOR)


# --- the hook: one per model, dispatching to the recorder of the calling thread ------------------
_current = threading.local()
_hooked: set[int] = set()


def install_hook(model: torch.nn.Module) -> None:
    """Let recorders see `model`'s logits (idempotent)."""
    if id(model) in _hooked:
        return
    model.register_forward_hook(_dispatch, with_kwargs=True)
    _hooked.add(id(model))


def _dispatch(_module, args: tuple, kwargs: dict, output) -> None:
    recorder: LogprobRecorder | None = getattr(_current, "recorder", None)
    if recorder is None:
        return
    input_ids = kwargs.get("input_ids", args[0] if args else None)
    logits = getattr(output, "logits", None)
    if input_ids is None or logits is None:  # a prompt given as embeddings: nothing to attribute
        return
    recorder.observe(input_ids, logits)


@contextmanager
def recording(recorder: LogprobRecorder | None) -> Iterator[None]:
    """The model's forwards on this thread feed `recorder` (None: nobody) inside the block."""
    previous = getattr(_current, "recorder", None)
    _current.recorder = recorder
    try:
        yield
    finally:
        _current.recorder = previous


# --- OpenAI's formats ----------------------------------------------------------------------------
class TokenTexts:
    """Each token id's text (the token alone, special tokens included), decoded once per id."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._texts: dict[int, str] = {}

    def __getitem__(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self.tokenizer.decode([token_id])
        return text


@dataclass(frozen=True)
class PlacedLogprob:
    """An entry where its token's text starts (characters from the start of the prompt text)."""

    entry: TokenLogprob | None  # None: the prompt's first token, which nothing predicts
    token_id: int
    offset: int


def completion_logprobs(placed: list[PlacedLogprob], texts: TokenTexts) -> dict:
    """The legacy /v1/completions form: parallel lists, and per token a dict of its `logprobs` most
    likely alternatives plus the token itself (so up to logprobs + 1 keys, as OpenAI documents)."""
    tokens, token_logprobs, tops, offsets = [], [], [], []
    for item in placed:
        tokens.append(texts[item.token_id])
        offsets.append(item.offset)
        if item.entry is None:
            token_logprobs.append(None)
            tops.append(None)
            continue
        token_logprobs.append(item.entry.logprob)
        top = {texts[token]: value for token, value in item.entry.top}
        top.setdefault(texts[item.token_id], item.entry.logprob)
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(placed: list[PlacedLogprob], texts: TokenTexts) -> dict:
    """The chat form: `{"content": [{token, logprob, bytes, top_logprobs: [...]}, ...]}`."""

    def described(token_id: int, logprob: float) -> dict:
        text = texts[token_id]
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    content = []
    for item in placed:
        if item.entry is None:
            continue
        entry = described(item.token_id, item.entry.logprob)
        entry["top_logprobs"] = [described(token, value) for token, value in item.entry.top]
        content.append(entry)
    return {"content": content, "refusal": None}
