"""The request bodies the API accepts (OpenAI's fields, validated) and the JSON helpers it answers with.

Unknown fields are refused (a typo must not silently do nothing), and so is every out-of-range value:
each becomes a 400 naming the field. What depends on this server's settings (how many choices and
tokens a request may ask for) is checked when the request is planned (`client.api.planning`).
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, field_validator

MAX_N = 128  # OpenAI's own bound on `n`
MAX_PROMPTS = 128  # prompts in one /v1/completions request (a batch, as lm-eval sends them)
MAX_PROMPT_CHARS = 1_000_000
MAX_COMPLETION_LOGPROBS = 5  # OpenAI's bound on the legacy `logprobs` (alternatives per token)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: StrictBool = False


class RequestBase(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str = Field(min_length=1, max_length=256)
    # 0 is for /v1/completions with `echo` (the prompt's log-probabilities alone); chats refuse it
    max_tokens: int | None = Field(default=None, ge=0)
    max_completion_tokens: int | None = Field(default=None, ge=0)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**63)
    n: StrictInt = Field(default=1, ge=1, le=MAX_N)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(default=None, max_length=256)

    @field_validator("n", mode="before")
    @classmethod
    def _default_n(cls, n: Any) -> Any:
        return 1 if n is None else n  # clients that send every field send `"n": null`

    @field_validator("stop")
    @classmethod
    def _stops(cls, stop: str | list[str] | None) -> list[str] | None:
        stops = [stop] if isinstance(stop, str) else stop
        if stops is not None and (len(stops) > 4 or any(not 1 <= len(s) <= 256 for s in stops)):
            raise ValueError("stop takes at most 4 sequences of 1..256 characters")
        return stops or None

    @property
    def requested_tokens(self) -> int | None:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens


class CompletionRequest(RequestBase):
    # one string, one token-id list, or a batch of either (each its own completion: OpenAI's index
    # of choice j of prompt i is i * n + j); normalized to a list of prompts by the validator
    prompt: Any
    echo: StrictBool = False
    logprobs: StrictInt | None = Field(default=None, ge=0, le=MAX_COMPLETION_LOGPROBS)

    @field_validator("echo", mode="before")
    @classmethod
    def _default_echo(cls, echo: Any) -> Any:
        return False if echo is None else echo

    @field_validator("prompt")
    @classmethod
    def _prompts(cls, prompt: Any) -> list[str | list[int]]:
        """Always a list of prompts, each a non-empty string or a non-empty list of token ids."""
        shape = "prompt must be a string, a list of strings, a list of token ids or a list of token-id lists"
        if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and _is_token(prompt[0])):
            prompts = [prompt]
        elif isinstance(prompt, list):
            prompts = prompt
        else:
            raise ValueError(shape)
        if not 1 <= len(prompts) <= MAX_PROMPTS:
            raise ValueError(f"prompt must hold 1..{MAX_PROMPTS} prompts")
        for one in prompts:
            if isinstance(one, str):
                if len(one) > MAX_PROMPT_CHARS:
                    raise ValueError(f"a prompt is longer than {MAX_PROMPT_CHARS:,} characters")
            elif not isinstance(one, list) or not all(_is_token(token) for token in one):
                raise ValueError(shape)
            if not one:
                raise ValueError("every prompt must be a non-empty string or a non-empty list of token ids")
        return prompts

    @property
    def prompts(self) -> list[str | list[int]]:
        return self.prompt  # normalized by the validator


def _is_token(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
