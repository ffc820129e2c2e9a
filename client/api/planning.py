"""From a validated request to the generations it runs (its choices), within this server's bounds.

A request runs one generation per choice: each of its prompts `n` times (OpenAI's choice index
`i * n + j` for sample j of prompt i). Every bound is a 400 that names the limit:
- `max_tokens` at most `--max-tokens`; each prompt plus `max_tokens` within `--max-context`;
- choices (prompts times `n`) at most `--max-concurrent`: each takes a generation slot, and a request
  must fit the server at once (admission counts them against the concurrency limits: 429 beyond);
- the tokens all choices may hold (each choice's prompt plus `max_tokens`) at most
  `--max-request-tokens`: this bounds `n` times `max_tokens`, and echoing the log-probabilities of
  long prompts, whose forward passes and answers grow with them.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from llm_swarm.client.api.chat_schema import ChatRequest
from llm_swarm.client.api.config import ApiConfig
from llm_swarm.client.api.errors import bad_request
from llm_swarm.client.api.generation import GenerationParams
from llm_swarm.client.api.prompting import chat_prompt, chat_template, completion_prompt, prompt_text
from llm_swarm.client.api.schema import CompletionRequest, RequestBase
from llm_swarm.client.api.tools import ToolFormat


@dataclass(frozen=True)
class ChoicePlan:
    index: int
    prompt_ids: list[int]
    prompt_text: str  # what echo shows and text offsets count from
    params: GenerationParams


@dataclass(frozen=True)
class RequestPlan:
    choices: list[ChoicePlan]
    prompt_tokens: int  # each prompt once, however many samples it has (OpenAI's usage)
    tool_format: ToolFormat | None = None  # chats whose answers are parsed for tool calls
    opening: str = ""  # the start of a forced tool call, already in the prompt: part of the answer


def choice_seed(seed: int | None, sample: int) -> int | None:
    """The seed of sample `sample` of a prompt: the request's own for the first (so `n` = 1 answers as
    before), and one derived from it for the others: each sample reproducible, all different."""
    if seed is None or sample == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}/{sample}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % 2**63


def plan_completion(body: CompletionRequest, tokenizer, config: ApiConfig, vocab_size: int) -> RequestPlan:
    max_tokens = _max_tokens(body, config)
    if max_tokens == 0 and not body.echo:
        raise bad_request(
            "max_tokens 0 asks for nothing without echo (the prompt's log-probabilities)", "max_tokens"
        )
    _check_choices(len(body.prompts) * body.n, config)  # before tokenizing what would be refused anyway
    prompts = [(completion_prompt(tokenizer, prompt, vocab_size), prompt) for prompt in body.prompts]
    params = _params(body, max_tokens, body.logprobs, body.echo)
    choices = [
        ChoicePlan(
            index=index * body.n + sample,
            prompt_ids=ids,
            prompt_text=prompt_text(tokenizer, prompt),
            params=_seeded(params, sample),
        )
        for index, (ids, prompt) in enumerate(prompts)
        for sample in range(body.n)
    ]
    _check_bounds(choices, config)
    return RequestPlan(choices, sum(len(ids) for ids, _prompt in prompts))


def plan_chat(body: ChatRequest, tokenizer, config: ApiConfig) -> RequestPlan:
    max_tokens = _max_tokens(body, config)
    tools = [tool.model_dump(exclude_none=True) for tool in body.tools] if body.uses_tools else None
    tool_format = ToolFormat.of_template(chat_template(tokenizer, tools)) if tools else None
    opening = ""
    if tool_format is not None and body.forced_function is not None:
        opening = tool_format.opening(body.forced_function)
    ids = chat_prompt(tokenizer, body.messages, tools, opening)
    top = (body.top_logprobs or 0) if body.logprobs else None
    params = _params(body, max_tokens, top, echo=False)
    choices = [ChoicePlan(sample, ids, "", _seeded(params, sample)) for sample in range(body.n)]
    _check_bounds(choices, config)
    return RequestPlan(choices, len(ids), tool_format, opening)


def _max_tokens(body: RequestBase, config: ApiConfig) -> int:
    requested = body.requested_tokens
    max_tokens = config.default_max_tokens if requested is None else requested
    if max_tokens > config.max_tokens:
        raise bad_request(
            f"max_tokens {max_tokens} exceeds this server's limit of {config.max_tokens}", "max_tokens"
        )
    return max_tokens


def _params(body: RequestBase, max_tokens: int, logprobs: int | None, echo: bool) -> GenerationParams:
    return GenerationParams(max_tokens, body.temperature, body.top_p, body.stop, body.seed, logprobs, echo)


def _seeded(params: GenerationParams, sample: int) -> GenerationParams:
    seed = choice_seed(params.seed, sample)
    return params if seed == params.seed else GenerationParams(**{**params.__dict__, "seed": seed})


def _check_choices(count: int, config: ApiConfig) -> None:
    if count > config.max_concurrent:
        raise bad_request(
            f"this request asks for {count} choices (prompts times n), more than the "
            f"{config.max_concurrent} generations this server runs at once (--max-concurrent)",
            "n",
        )


def _check_bounds(choices: list[ChoicePlan], config: ApiConfig) -> None:
    for choice in choices:
        prompt_tokens, max_tokens = len(choice.prompt_ids), choice.params.max_tokens
        if prompt_tokens + max_tokens > config.max_context:
            raise bad_request(
                f"the prompt's {prompt_tokens} tokens plus max_tokens {max_tokens} exceed the context "
                f"of {config.max_context}",
                "max_tokens",
            )
    _check_choices(len(choices), config)
    tokens = sum(len(choice.prompt_ids) + choice.params.max_tokens for choice in choices)
    if tokens > config.max_request_tokens:
        raise bad_request(
            f"this request's choices hold {tokens} tokens (prompt plus max_tokens, for each of prompts "
            f"times n), more than this server's limit of {config.max_request_tokens} (--max-request-tokens)",
            "n",
        )
