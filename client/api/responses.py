"""The JSON the generation routes answer: whole responses and streamed chunks, completion or chat."""

from __future__ import annotations

from llm_swarm.client.api.generation import GenerationResult
from llm_swarm.client.api.logprobs import PlacedLogprob, TokenTexts, chat_logprobs, completion_logprobs
from llm_swarm.client.api.planning import RequestPlan
from llm_swarm.client.api.schema import new_id, now, usage
from llm_swarm.client.api.tools import parse


class Responder:
    """Builds one request's answers (its id, model and format) from its choices' results."""

    def __init__(self, model_name: str, texts: TokenTexts, plan: RequestPlan, chat: bool, logprobs: bool):
        self.model_name, self.texts, self.plan, self.chat, self.logprobs = (
            model_name,
            texts,
            plan,
            chat,
            logprobs,
        )
        self.id, self.created = new_id("chatcmpl" if chat else "cmpl"), now()

    @property
    def echo(self) -> bool:
        return any(choice.params.echo for choice in self.plan.choices)

    def whole(self, results: list[GenerationResult]) -> dict:
        choices = [self._whole_choice(index, result) for index, result in enumerate(results)]
        completion_tokens = sum(result.completion_tokens for result in results)
        return {
            **self._envelope(),
            "choices": choices,
            "usage": usage(self.plan.prompt_tokens, completion_tokens),
        }

    def _whole_choice(self, index: int, result: GenerationResult) -> dict:
        logprobs = self.format_logprobs(result.logprobs)
        if not self.chat:
            text = result.prompt_text + result.text if self.echo else result.text
            return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": result.finish_reason}
        message: dict = {"role": "assistant", "content": self.plan.opening + result.text}
        finish_reason = result.finish_reason
        if self.plan.tool_format is not None:
            parsed = parse(self.plan.opening + result.text)
            if parsed.calls:
                message = {"role": "assistant", "content": parsed.content, "tool_calls": parsed.calls}
                finish_reason = "tool_calls"
        return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}

    def format_logprobs(self, placed: list[PlacedLogprob]) -> dict | None:
        if not self.logprobs:
            return None
        return chat_logprobs(placed, self.texts) if self.chat else completion_logprobs(placed, self.texts)

    def chunk(
        self,
        index: int,
        text: str | None = None,
        placed: list[PlacedLogprob] | None = None,
        finish: str | None = None,
        role: bool = False,
        tool_calls: list[dict] | None = None,
    ) -> dict:
        logprobs = self.format_logprobs(placed or []) if placed else None
        if self.chat:
            delta: dict = {"role": "assistant", "content": ""} if role else {}
            if text:
                delta["content"] = text
            if tool_calls:
                delta["tool_calls"] = [{"index": number, **call} for number, call in enumerate(tool_calls)]
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        else:
            choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish}
        return {**self._envelope(chunk=True), "choices": [choice]}

    def usage_chunk(self, completion_tokens: int) -> dict:
        return {
            **self._envelope(chunk=True),
            "choices": [],
            "usage": usage(self.plan.prompt_tokens, completion_tokens),
        }

    def _envelope(self, chunk: bool = False) -> dict:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model_name}
