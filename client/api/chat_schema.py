"""The body of /v1/chat/completions: messages (tool calls and tool results included), tools,
`tool_choice` and the chat form of log-probabilities, validated as OpenAI documents them."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, field_validator, model_validator

from llm_swarm.client.api.schema import RequestBase

MAX_TOP_LOGPROBS = 20  # OpenAI's bound on the chat `top_logprobs`
MAX_TOOLS = 128  # OpenAI's bound on `tools`
FUNCTION_NAME = r"^[A-Za-z0-9_-]{1,64}$"  # OpenAI's rule for function names


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class FunctionCall(_Strict):
    name: str = Field(max_length=64)
    arguments: str = Field(max_length=1_000_000)  # JSON text, as the model wrote it


class ToolCall(_Strict):
    id: str = Field(max_length=256)
    type: Literal["function"] = "function"
    function: FunctionCall


class TextPart(_Strict):
    type: Literal["text"]
    text: str = Field(max_length=1_000_000)


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = Field(default=None, max_length=1_000_000)
    name: str | None = Field(default=None, max_length=64)
    tool_calls: list[ToolCall] | None = Field(default=None, max_length=MAX_TOOLS)  # an assistant's calls
    tool_call_id: str | None = Field(default=None, max_length=256)  # which call a tool message answers

    @model_validator(mode="after")
    def _consistent(self) -> Message:
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs the tool_call_id it answers")
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a {self.role} message needs content")
        return self

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates take it: text content, and each call's arguments as a dict
        (Hermes-, Qwen- and Llama-style templates serialize them with `tojson`), as vLLM passes them."""
        rendered: dict[str, Any] = {
            "role": "system" if self.role == "developer" else self.role,
            "content": self.text,
        }
        if self.name is not None:
            rendered["name"] = self.name
        if self.tool_call_id is not None:
            rendered["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            rendered["tool_calls"] = [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {
                        "name": call.function.name,
                        "arguments": _arguments(call.function.arguments),
                    },
                }
                for call in self.tool_calls
            ]
        return rendered

    @property
    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text  # what the model wrote: the template shows it as is


class FunctionDefinition(_Strict):
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = Field(default=None, max_length=100_000)
    parameters: dict[str, Any] | None = None  # a JSON schema, shown to the model by the template
    strict: StrictBool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Strict):
    name: str = Field(pattern=FUNCTION_NAME)


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionName


class ChatRequest(RequestBase):
    messages: list[Message] = Field(min_length=1, max_length=1024)
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[Tool] | None = Field(default=None, min_length=1, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool | None = None  # accepted; each call the model writes is returned

    @field_validator("logprobs", mode="before")
    @classmethod
    def _default_logprobs(cls, logprobs: Any) -> Any:
        return False if logprobs is None else logprobs  # `"logprobs": null`, as some clients send

    @model_validator(mode="after")
    def _consistent(self) -> ChatRequest:
        if self.requested_tokens == 0:
            raise ValueError("max_tokens must be at least 1 for a chat")
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        if self.tool_choice is not None and self.tools is None:
            raise ValueError("tool_choice needs tools")
        if isinstance(self.tool_choice, NamedToolChoice):
            names = {tool.function.name for tool in self.tools or []}
            name = self.tool_choice.function.name
            if name not in names:
                raise ValueError(f"tool_choice names {name!r}, which is not in tools")
        return self

    @property
    def uses_tools(self) -> bool:
        """Whether the tools go into the prompt and the answer is parsed for calls."""
        return self.tools is not None and self.tool_choice != "none"

    @property
    def forced_function(self) -> str | None:
        """The function the answer must call ("" for `required`: any); None when it need not."""
        if isinstance(self.tool_choice, NamedToolChoice):
            return self.tool_choice.function.name
        return "" if self.tool_choice == "required" else None
