"""A causal LM whose blocks run elsewhere, usable with `transformers`' `generate()`.

The model holds only the client-side modules; its forward embeds the tokens the active session
has not processed yet, runs them through the backend's blocks and applies the final norm and LM
head. It declares itself stateful, so `generate()` keeps no cache of its own and simply asks for
the next logits at every step; sampling, streamers and stopping are all `transformers`' code.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from transformers import GenerationConfig, GenerationMixin
from transformers.modeling_outputs import CausalLMOutputWithPast

from llm_swarm.client.continuation import continuation, mask_after
from llm_swarm.client.sequence_forward import last_block_output, with_prompt_positions
from llm_swarm.client.session import InferenceSession
from llm_swarm.client.session_cache import SessionCache
from llm_swarm.client.speculation import DraftLength, DraftLengthOptions
from llm_swarm.client.speculation.batched import BatchedSpeculation, check_batched_config
from llm_swarm.client.speculation.candidates import AdaptiveCandidates
from llm_swarm.client.swarm_model import SwarmModelBase
from llm_swarm.swarm.transformers_compat import (
    GENERATE_CACHE_ARGUMENT,
    library_default,
    resolved_generation_config,
)


class DistributedModelForCausalLM(SwarmModelBase, GenerationMixin):
    # the attention caches live in the backend's session; generate() sees it as its `past_key_values`
    # (`SessionCache`), which assisted generation crops after rejected drafts (the session rewinds)

    def _add_own_parts(self) -> None:
        self._local = threading.local()  # each thread may drive its own session through one model
        # how speculative decoding (assistant_model=, prompt_lookup_num_tokens=) chooses its draft length
        self.speculation = DraftLengthOptions()

    def _read_checkpoint(self, model_dir: str | Path) -> None:
        """The checkpoint's generation config, when it has one."""
        with contextlib.suppress(OSError):  # a checkpoint without generation_config.json is fine
            self.generation_config = GenerationConfig.from_pretrained(model_dir)

    # --- sessions -------------------------------------------------------------------------------
    def open_session(
        self,
        max_length: int,
        batch_size: int = 1,
        prompt_tokens: int | None = None,
        expected_new_tokens: int | None = None,
    ) -> InferenceSession:
        if max_length < 1 or batch_size < 1:
            raise ValueError("max_length and batch_size must be positive")
        for name, value in (("prompt_tokens", prompt_tokens), ("expected_new_tokens", expected_new_tokens)):
            if value is not None and not 0 < value <= max_length:
                raise ValueError(f"{name} must be in 1..max_length ({max_length}), got {value}")
        blocks = self.backend.open_session(batch_size, max_length, prompt_tokens, expected_new_tokens)
        return InferenceSession(blocks, batch_size, max_length)

    @contextlib.contextmanager
    def inference_session(
        self,
        max_length: int,
        batch_size: int = 1,
        prompt_tokens: int | None = None,
        expected_new_tokens: int | None = None,
    ) -> Iterator[InferenceSession]:
        """A session that several `generate()` calls continue, reusing server caches: inside the `with`
        block it is this thread's active session (PETALS' semantics: `generate(None, ...)` continues it),
        or pass it explicitly as `generate(..., session=s)`. `prompt_tokens` and `expected_new_tokens`:
        the first step's length and how many tokens will be generated, if known; routing (and the
        scheduler's wait estimate) prices the session with them, else with `ClientOptions.expected_l_in`
        as the prompt and the rest of `max_length` as generated tokens."""
        session = self.open_session(max_length, batch_size, prompt_tokens, expected_new_tokens)
        try:
            with self._use_session(session):
                yield session
        finally:
            session.close()

    @property
    def _active_session(self) -> InferenceSession | None:
        return getattr(self._local, "session", None)

    @contextlib.contextmanager
    def _use_session(self, session: InferenceSession) -> Iterator[None]:
        previous, self._local.session = self._active_session, session
        try:
            yield
        finally:
            self._local.session = previous

    # --- generation -----------------------------------------------------------------------------
    @torch.inference_mode()
    def generate(
        self, input_ids: torch.Tensor | None = None, session: InferenceSession | None = None, **kwargs
    ):
        embeds = kwargs.get("inputs_embeds")
        if input_ids is None and embeds is not None:  # a prompt given as embeddings (returns new tokens)
            if session is None and self._active_session is None:
                settings = self._generation_settings(kwargs)
                new = settings.max_new_tokens or settings.max_length
                prompt = embeds.shape[1] + (self.prompts.length if self.prompts is not None else 0)
                with self.inference_session(prompt + new, embeds.shape[0], prompt_tokens=prompt) as own:
                    return self._generate_in(own, None, kwargs)
            return self._generate_in(session or self._active_session, None, kwargs)
        if input_ids is None and session is None and self._active_session is None:
            raise ValueError(
                "generate(None) continues an inference session that generate() already produced "
                "tokens in; otherwise pass input_ids"
            )
        if session is None and self._active_session is None:
            # a one-off generation: size the session for the prompt plus every token it may add, and
            # for every hypothesis of a beam search
            settings = self._generation_settings(kwargs)
            max_new = settings.max_new_tokens
            max_length = self._generation_length(settings, kwargs, input_ids.shape[1])
            if self._speculates(kwargs) and input_ids.shape[0] > 1:
                # rows of a batch accept different numbers of drafts: the positions they leave masked
                # need room (without it, speculation turns itself off as the session fills up)
                max_length += max_length - input_ids.shape[1]
            prefix = self.prompts.length if self.prompts is not None else 0  # the trained prefix
            max_length += prefix
            beams = settings.num_beams or 1
            rows, prompt = input_ids.shape[0] * beams, max(min(input_ids.shape[1] + prefix, max_length), 1)
            new = min(max_new, max_length) if max_new else None  # room for masked drafts is not output
            with self.inference_session(max_length, rows, prompt, expected_new_tokens=new) as own:
                return self._generate_in(own, input_ids, kwargs)
        # a session that already generated: transformers' or PETALS' convention (`client.continuation`)
        active = session or self._active_session
        call = continuation(input_ids, kwargs.get("attention_mask"), active.last_output_ids, active.last_mask)
        if call.attention_mask is not None:
            kwargs = {**kwargs, "attention_mask": call.attention_mask}
        output = self._generate_in(active, call.input_ids, kwargs)
        sequences = output if isinstance(output, torch.Tensor) else getattr(output, "sequences", None)
        if not isinstance(sequences, torch.Tensor):
            return output
        active.last_output_ids = sequences  # what the next call continues from
        active.last_mask = mask_after(sequences, call.attention_mask, call.input_ids.shape[1])
        if isinstance(output, torch.Tensor):
            return sequences[:, call.returned_from :]
        output.sequences = sequences[:, call.returned_from :]
        return output

    def _generation_settings(self, kwargs: dict) -> GenerationConfig:
        """What generate() will run with: the call's arguments over the model's generation config over
        transformers' defaults (transformers 5 leaves unset fields None until generate() fills them)."""
        settings = {name: value for name, value in kwargs.items() if name != "generation_config"}
        return resolved_generation_config(self, kwargs.get("generation_config"), **settings)

    def _generation_length(self, settings: GenerationConfig, kwargs: dict, prompt_length: int) -> int:
        """How long generate() lets its sequences grow, prompt included, decided as transformers decides
        it: the prompt plus `max_new_tokens`; else a `max_length` the call or a generation config set;
        else the library's default count of new tokens after the prompt, within the model's positions."""
        if settings.max_new_tokens is not None:
            return prompt_length + settings.max_new_tokens
        if kwargs.get("max_length") is not None or settings.max_length != library_default("max_length"):
            return settings.max_length
        limit = getattr(self.config, "max_position_embeddings", None)
        return min(prompt_length + settings.max_length, limit or math.inf)

    def _speculates(self, kwargs: dict) -> bool:
        lookup = self._generation_settings(kwargs).prompt_lookup_num_tokens
        return kwargs.get("assistant_model") is not None or bool(lookup)

    def _generate_in(self, session: InferenceSession, input_ids: torch.Tensor | None, kwargs: dict):
        """transformers' generate() in `session`, which it sees as its cache (`past_key_values`, or
        `cache` from transformers 5)."""
        if kwargs.get("past_key_values") is not None or kwargs.get("cache") is not None:
            raise ValueError("the swarm session is the cache: pass session=..., not a cache of your own")
        if session.generation_cache is None:
            session.generation_cache = SessionCache(session)
        session.draft_stats = None  # set again by this call if it speculates with our draft length
        with self._use_session(session):
            if input_ids is not None and input_ids.shape[0] > 1 and self._speculates(kwargs):
                return self._generate_batched_speculation(session, input_ids, dict(kwargs))
            kwargs = {**kwargs, GENERATE_CACHE_ARGUMENT: session.generation_cache}
            if input_ids is None:
                return super().generate(**kwargs)
            return super().generate(input_ids, **kwargs)

    def _generate_batched_speculation(self, session: InferenceSession, input_ids: torch.Tensor, kwargs: dict):
        """Greedy speculative decoding of a batch (transformers' assisted generation takes one row)."""
        assistant = kwargs.pop("assistant_model", None)
        attention_mask = kwargs.pop("attention_mask", None)
        hooks = ("logits_processor", "stopping_criteria", "prefix_allowed_tokens_fn")
        custom = [name for name in hooks if kwargs.get(name)]
        if custom:
            raise ValueError(
                f"speculative decoding of a batch does not apply {', '.join(custom)}: generate one "
                "sequence at a time for them"
            )
        config = self._generation_settings(kwargs)
        check_batched_config(config)
        if kwargs.get("streamer") is not None:
            raise ValueError("streaming supports one sequence at a time (as in transformers)")
        max_new = self._generation_length(config, kwargs, input_ids.shape[1]) - input_ids.shape[1]
        if max_new < 1:
            raise ValueError(f"nothing to generate: max_new_tokens is {max_new}")
        eos = config.eos_token_id
        eos_ids = {int(eos)} if isinstance(eos, int) else {int(e) for e in (eos or [])}
        pad = config.pad_token_id if config.pad_token_id is not None else min(eos_ids, default=0)
        if assistant is not None:
            fixed = int(resolved_generation_config(assistant).num_assistant_tokens)
        else:
            fixed = int(config.prompt_lookup_num_tokens)
        draft_length = self._draft_length(session, fixed, lookup=assistant is None)
        run = BatchedSpeculation(
            self,
            session,
            draft_length,
            assistant=assistant,
            lookup_ngram=0 if assistant is not None else (config.max_matching_ngram_size or 2),
        )
        return run.generate(input_ids, attention_mask, max_new, eos_ids, pad)

    def _get_candidate_generator(self, generation_config: GenerationConfig, *args, **kwargs):
        """transformers' drafter (assistant model or prompt lookup) with the draft length chosen from
        what this session measures (`client.speculation`), unless `self.speculation.adaptive` is off."""
        inner = super()._get_candidate_generator(generation_config, *args, **kwargs)
        session = self._active_session
        if not self.speculation.adaptive or session is None:
            return inner
        lookup = generation_config.prompt_lookup_num_tokens
        draft_length = self._draft_length(session, lookup or self.speculation.max_draft, lookup=bool(lookup))
        return AdaptiveCandidates(inner, draft_length, generation_config.max_length)

    def _draft_length(self, session: InferenceSession, requested: int, lookup: bool) -> DraftLength:
        """The draft-length chooser of one generation: adaptive up to `self.speculation.max_draft` (and
        up to prompt lookup's own `requested` count), or fixed at `requested` when not adaptive."""
        options = self.speculation
        if not options.adaptive:
            options = dataclasses.replace(options, max_draft=max(requested, 1), first_draft=max(requested, 1))
        elif lookup:
            cap = max(min(requested, options.max_draft), 1)
            options = dataclasses.replace(options, max_draft=cap, first_draft=min(options.first_draft, cap))
        draft_length = DraftLength(options, session.step_costs)
        session.draft_stats = draft_length  # acceptance and rounds, for logs and benchmarks
        return draft_length

    def prepare_inputs_for_generation(
        self,
        input_ids: torch.Tensor,
        attention_mask=None,
        inputs_embeds=None,
        past_key_values=None,
        cache=None,
        **kwargs,
    ) -> dict:
        """The model's inputs at each step: the session (generate()'s cache) knows what it processed."""
        session = self._active_session
        if inputs_embeds is not None and (session is None or session.position == 0):
            return {"inputs_embeds": inputs_embeds, "attention_mask": attention_mask}  # the prompt, once
        return {"input_ids": input_ids, "attention_mask": attention_mask}

    def _reorder_cache(self, past_key_values, beam_idx: torch.Tensor):
        """transformers' beam search hook: the session (and, with its next step, the servers) reorder."""
        self._active_session.reorder(beam_idx)
        return past_key_values

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        """Inside an inference session (generate()): logits for the tokens the session has not processed
        yet, or for a prompt given as `inputs_embeds`. Outside one: whole sequences through the blocks'
        forward RPC, differentiable (training), with the causal LM loss when `labels` are given."""
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("forward() takes exactly one of input_ids and inputs_embeds")
        session = self._active_session
        if session is None:
            return self._forward_sequence(input_ids, attention_mask, inputs_embeds, labels)
        return self._forward_in(session, input_ids, attention_mask, inputs_embeds)

    def _forward_sequence(
        self,
        input_ids: torch.Tensor | None,
        attention_mask: torch.Tensor | None,
        inputs_embeds: torch.Tensor | None,
        labels: torch.Tensor | None,
    ) -> CausalLMOutputWithPast:
        output = last_block_output(
            self.client_parts, self.backend, self.prompts, input_ids, attention_mask, inputs_embeds
        )
        logits = self.client_parts.logits(output).float()
        loss = None
        if labels is not None:
            loss = torch.nn.functional.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]),
                labels[:, 1:].reshape(-1).to(logits.device),
                ignore_index=-100,
            )
        return CausalLMOutputWithPast(loss=loss, logits=logits)

    def _with_prompt_positions(self, attention_mask: torch.Tensor) -> torch.Tensor:
        """The mask with the trained prompt's positions (always real) in front."""
        return with_prompt_positions(attention_mask, self.prompts)

    def _forward_in(
        self,
        session: InferenceSession,
        input_ids: torch.Tensor | None,
        attention_mask: torch.Tensor | None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> CausalLMOutputWithPast:
        if self.prompts is not None:
            if attention_mask is not None:
                attention_mask = self._with_prompt_positions(attention_mask)
            if session.position == 0:  # the trained prompt opens every session, then the input follows
                prefix = self.prompts.prefix(session.batch_size)
                session.step_embeddings(self.client_parts.from_embeddings(prefix), None, self.prompts.deep())
        started = time.perf_counter()
        if inputs_embeds is not None:
            hidden = session.step_embeddings(self.client_parts.from_embeddings(inputs_embeds), attention_mask)
        else:
            new_ids = session.unprocessed(input_ids)
            hidden = self.client_parts.embed_tokens(new_ids)
            hidden = session.step(new_ids, hidden, attention_mask)
        logits = self.client_parts.logits(hidden).float()
        session.step_costs.observe(hidden.shape[1], time.perf_counter() - started)
        # the session stands for the cache: assisted generation crops it (a rewind), beam search
        # reorders it through `_reorder_cache`
        cache = session.generation_cache if session.generation_cache is not None else SessionCache(session)
        return CausalLMOutputWithPast(logits=logits, **{GENERATE_CACHE_ARGUMENT: cache})


AutoDistributedModelForCausalLM = DistributedModelForCausalLM  # the name users know from PETALS
