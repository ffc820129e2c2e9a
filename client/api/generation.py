"""One choice's generation on a worker thread, its text handed to the event loop as it grows.

`transformers`' `generate()` runs in a thread (it blocks); a streamer decodes each new token and
pushes text deltas onto an asyncio queue through the loop's thread-safe call. The request can be
cancelled (a client that disconnected): a stopping criterion ends `generate()` at the next token,
and its inference session closes, freeing the servers' caches. Sampling uses a per-request
`torch.Generator`, so a `seed` reproduces a completion whatever else runs concurrently.

A job is one choice of a request (a request with several prompts or `n` > 1 runs several jobs, each in
its own session). With `logprobs`, a `LogprobRecorder` sees the logits of the job's forwards and each
delta carries the entries of the tokens whose text it shows; with `echo`, the first delta is the
prompt itself (and its tokens' entries, from the prompt's prefill). `max_tokens` 0 with echo runs one
forward of the prompt (the forward RPC, no session) instead of a generation.
"""

from __future__ import annotations

import asyncio
import math
import random
import threading
import time
from dataclasses import dataclass, field

import torch
from transformers import LogitsProcessor, StoppingCriteria, TemperatureLogitsWarper, TopPLogitsWarper

from llm_swarm.client.api.logprobs import LogprobRecorder, PlacedLogprob, TokenLogprob, recording
from llm_swarm.client.api.prompting import StopStrings


@dataclass(frozen=True)
class GenerationParams:
    max_tokens: int
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    stop: list[str] | None = None
    seed: int | None = None
    logprobs: int | None = None  # how many alternatives per token; None: no log-probabilities
    echo: bool = False  # the prompt comes first in the text (and in the log-probabilities)


@dataclass(frozen=True)
class Delta:
    """What a choice adds to its answer: text, and the log-probabilities of the tokens it shows."""

    text: str
    logprobs: list[PlacedLogprob]


@dataclass
class GenerationResult:
    text: str = ""  # the completion (after the echoed prompt, if any)
    prompt_text: str = ""
    logprobs: list[PlacedLogprob] = field(default_factory=list)  # the echoed prompt's, then the text's
    completion_tokens: int = 0
    finish_reason: str = "length"
    first_token_at: float | None = None  # monotonic
    finished_at: float | None = None


class SeededSampling(LogitsProcessor):
    """Samples the next token with the request's own randomness and leaves only it possible, so that
    greedy selection in `generate()` picks it: sampling without touching torch's global RNG.

    The draw for the token at position `t` uses a generator seeded by `(seed, t)` alone. Speculative
    decoding (`swarm-api --assistant`) calls this for several positions per round and discards the
    draws after a rejected draft; since a position's draw does not depend on how many were made
    before it, a seed gives the same text whatever the draft lengths were, and every token is still
    a fresh draw from its own distribution."""

    def __init__(self, temperature: float, top_p: float, seed: int | None):
        self.warpers = [TemperatureLogitsWarper(temperature)]
        if top_p < 1.0:
            self.warpers.append(TopPLogitsWarper(top_p))
        self.seed = seed % 2**63 if seed is not None else random.SystemRandom().getrandbits(63)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        for warper in self.warpers:
            scores = warper(input_ids, scores)
        probabilities = torch.softmax(scores.float(), dim=-1).cpu()
        position = input_ids.shape[1]
        generator = torch.Generator().manual_seed((self.seed * 1_000_003 + position) % 2**63)
        chosen = torch.multinomial(probabilities, 1, generator=generator).to(scores.device)
        only = torch.full_like(scores, -math.inf)
        return only.scatter_(1, chosen, 0.0)


class _Cancelled(StoppingCriteria):
    def __init__(self, event: threading.Event):
        self.event = event

    def __call__(self, input_ids, scores, **kwargs) -> torch.BoolTensor:
        return torch.full((input_ids.shape[0],), self.event.is_set(), dtype=torch.bool)


@dataclass
class GenerationJob:
    model: object
    tokenizer: object
    prompt_ids: list[int]
    params: GenerationParams
    loop: asyncio.AbstractEventLoop
    assistant: object = None  # a draft model for speculative decoding (`swarm-api --assistant`)
    index: int = 0  # which choice of its request this is
    prompt_text: str = ""  # what echo shows and text offsets count from (the prompt as given)
    # (index, Delta) items, then (index, None); choices of one request may share a queue
    deltas: asyncio.Queue = field(default_factory=asyncio.Queue)
    result: GenerationResult = field(default_factory=GenerationResult)
    cancelled: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None  # what ended generate() early, if anything
    _generated: list[int] = field(default_factory=list)
    _shown: int = 0  # characters of the text already handed out
    _prompt_seen: bool = False
    _echoed: bool = False
    _text_length: int = 0  # characters of the whole decoded text so far (before any stop string cut)
    _unreported: list[tuple[TokenLogprob, int]] = field(default_factory=list)  # (entry, where it starts)

    def __post_init__(self) -> None:
        self._stops = StopStrings(self.params.stop)
        self.result.prompt_text = self.prompt_text
        self._recorder = None
        if self.params.logprobs is not None:
            self._recorder = LogprobRecorder(self.prompt_ids, self.params.logprobs, self.params.echo)

    def cancel(self) -> None:
        self.cancelled.set()

    # --- runs on a worker thread ----------------------------------------------------------------
    def run(self) -> GenerationResult:
        eos = self.tokenizer.eos_token_id
        try:
            with recording(self._recorder):
                if self.params.max_tokens == 0:  # echo alone: the prompt's log-probabilities
                    if self._recorder is not None:
                        with torch.inference_mode():
                            self.model(input_ids=torch.tensor([self.prompt_ids]))
                else:
                    self._generate(eos)
        except BaseException as error:
            self.error = error
            raise
        finally:
            self._finish(eos)
        return self.result

    def _generate(self, eos: int | None) -> None:
        kwargs = {"assistant_model": self.assistant} if self.assistant is not None else {}
        if self.params.temperature > 0:
            kwargs["logits_processor"] = [
                SeededSampling(self.params.temperature, self.params.top_p, self.params.seed)
            ]
        self.model.generate(
            torch.tensor([self.prompt_ids]),
            max_new_tokens=self.params.max_tokens,
            do_sample=False,
            streamer=self,
            stopping_criteria=[_Cancelled(self.cancelled)],
            pad_token_id=self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else eos,
            eos_token_id=eos,
            **kwargs,
        )

    # the streamer protocol of generate(): the prompt first, then each new token
    def put(self, value: torch.Tensor) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        if self.cancelled.is_set():
            return
        self._echo()  # the prompt's prefill has run: its log-probabilities are known
        for token in value.reshape(-1).tolist():
            if self._recorder is not None:
                position = len(self.prompt_ids) + len(self._generated)
                self._unreported.append((self._recorder.resolve(position, token), self._text_length))
            self._generated.append(token)
            self._text_length = len(self._decoded())
        self.result.completion_tokens = len(self._generated)
        if self.result.first_token_at is None:
            self.result.first_token_at = time.monotonic()
        text, stopped = self._stops.cut(self._decoded())
        if stopped:
            self.result.finish_reason = "stop"
            self.cancel()  # generate() ends at the next token; nothing after the stop string
            self._emit(text, len(text))
            return
        if not text.endswith("\ufffd"):  # an incomplete multi-byte character: wait for the rest
            self._emit(text[: self._stops.safe_length(text)])

    def end(self) -> None:
        pass  # `_finish` runs once generate() returns, whatever way it ends

    def _decoded(self) -> str:
        return self.tokenizer.decode(self._generated, skip_special_tokens=True)

    def _echo(self) -> None:
        """The echoed prompt, once, before any generated text."""
        if self._echoed or not self.params.echo:
            return
        self._echoed = True
        placed = []
        if self._recorder is not None:
            for position, entry in enumerate(self._recorder.prompt):
                offset = len(self.tokenizer.decode(self.prompt_ids[:position], skip_special_tokens=True))
                placed.append(PlacedLogprob(entry, self.prompt_ids[position], offset))
        self.result.logprobs += placed
        self._push(Delta(self.prompt_text, placed))

    def _emit(self, text: str, reported_below: int | None = None) -> None:
        """Hand out what `text` adds to what was shown, with the entries of the tokens that start
        before `reported_below` characters (default: the end of `text`; a large number: all)."""
        limit = len(text) if reported_below is None else reported_below
        placed = []
        while self._unreported and self._unreported[0][1] < limit:
            entry, start = self._unreported.pop(0)
            placed.append(PlacedLogprob(entry, entry.token_id, len(self.prompt_text) + start))
        self.result.logprobs += placed
        added = text[self._shown :] if len(text) > self._shown else ""
        if added or placed:
            self._push(Delta(added, placed))
        self._shown = max(self._shown, len(text))
        self.result.text = text

    def _finish(self, eos: int | None) -> None:
        if not self.cancelled.is_set() or self.result.finish_reason == "stop":
            self._echo()
        if self.result.finish_reason != "stop":
            text = self._stops.cut(self._decoded())[0]
            if not self.cancelled.is_set():
                self._emit(text, 2**62)  # every token's entry, a closing EOS included
            if self._generated and self._generated[-1] == eos:
                self.result.finish_reason = "stop"
        self.result.finished_at = time.monotonic()
        self._push(None)

    def _push(self, item: Delta | None) -> None:
        self.loop.call_soon_threadsafe(self.deltas.put_nowait, (self.index, item))
