"""Tool calls: which format a chat template's model writes them in, parsing them out of its text,
and holding back streamed text that may turn out to be a call.

The formats understood (the model's text, after special tokens are dropped):
- Hermes / Qwen2.5 / Qwen3: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one block
  per call, possibly after some text (which becomes the message's content);
- Llama 3.1+ / Mistral: the whole answer is the call as JSON, `{"name": ..., "parameters": {...}}`
  (or "arguments"), or a JSON list of such objects, optionally after `<|python_tag|>` or
  `[TOOL_CALLS]`.
Anything that does not parse as one of these is the answer's text (finish_reason as usual), as vLLM
does. The format is chosen from the template: one that mentions `<tool_call>` is Hermes, one that
mentions `[TOOL_CALLS]` Mistral, any other that renders tools Llama's JSON.

`tool_choice` "required" or a named function: the answer is started with the format's opening of a
call (for a named one, up to its arguments), so the model goes on with a call. The arguments are not
constrained by a grammar: a model that writes something unparseable gets its text back.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
JSON_PREFIXES = ("<|python_tag|>", "[TOOL_CALLS]")


@dataclass(frozen=True)
class ToolFormat:
    name: str  # "hermes", "mistral" or "llama"

    @classmethod
    def of_template(cls, template: str) -> ToolFormat:
        if HERMES_OPEN in template:
            return cls("hermes")
        return cls("mistral" if "[TOOL_CALLS]" in template else "llama")

    def opening(self, function: str) -> str:
        """The start of a call ("" for `function`: any function), which the answer is forced to begin with."""
        if self.name == "hermes":
            start = HERMES_OPEN + '\n{"name": "'
            key = "arguments"
        elif self.name == "mistral":
            start, key = '[TOOL_CALLS][{"name": "', "arguments"
        else:
            start, key = '{"name": "', "parameters"
        return start if not function else f'{start}{function}", "{key}": '

    def streamable(self, text: str) -> int:
        """How much of `text` is surely not part of a call (and can be streamed as content)."""
        if self.name == "hermes":
            found = text.find(HERMES_OPEN)
            if found != -1:
                return found
            for size in range(min(len(HERMES_OPEN) - 1, len(text)), 0, -1):
                if text.endswith(HERMES_OPEN[:size]):
                    return len(text) - size
            return len(text)
        stripped = text.lstrip()
        maybe_prefix = any(prefix.startswith(stripped[: len(prefix)]) for prefix in JSON_PREFIXES)
        if not stripped or stripped[0] in "{[" or maybe_prefix:
            return 0  # may still be a call: only the whole answer tells
        return len(text)


@dataclass(frozen=True)
class Parsed:
    content: str | None  # the text besides the calls (None: nothing but calls)
    calls: list[dict]  # OpenAI's `tool_calls` entries; empty: the answer is plain text
    content_end: int  # where the content ends in the text (the first call starts there)


def parse(text: str) -> Parsed:
    """The tool calls in a model's answer, in any of the formats above."""
    calls = _hermes(text)
    if calls is not None:
        start = text.find(HERMES_OPEN)
        content = text[:start].strip() or None
        return Parsed(content, calls, start)
    calls = _json(text)
    if calls is not None:
        return Parsed(None, calls, 0)
    return Parsed(text, [], len(text))


def _hermes(text: str) -> list[dict] | None:
    if HERMES_OPEN not in text:
        return None
    bodies = re.findall(re.escape(HERMES_OPEN) + r"(.*?)(?:" + re.escape(HERMES_CLOSE) + r"|$)", text, re.S)
    calls = [_call(_loads(body)) for body in bodies]
    return None if not calls or any(call is None for call in calls) else calls


def _json(text: str) -> list[dict] | None:
    stripped = text.strip()
    for prefix in JSON_PREFIXES:
        stripped = stripped.removeprefix(prefix).lstrip()
    if not stripped or stripped[0] not in "{[":
        return None
    value = _loads(stripped)
    items = value if isinstance(value, list) else [value]
    calls = [_call(item) for item in items]
    return None if not calls or any(call is None for call in calls) else calls


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


def _call(item: Any) -> dict | None:
    if not isinstance(item, dict) or not isinstance(item.get("name"), str):
        return None
    arguments = item.get("arguments", item.get("parameters", {}))
    if not isinstance(arguments, dict | str):
        return None
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    function = {"name": item["name"], "arguments": arguments}
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": function}


class ToolCallStream:
    """One streamed choice's text while tools are on: content goes out as soon as it surely is not
    a call; the rest waits for the end, where it becomes calls or, failing to parse, content."""

    def __init__(self, tool_format: ToolFormat, opening: str = ""):
        self.format, self.text, self.shown = tool_format, "", 0
        self.feed(opening)

    def feed(self, delta: str) -> str:
        """The content to stream now."""
        self.text += delta
        safe = self.format.streamable(self.text)
        if safe <= self.shown:
            return ""
        shown, self.shown = self.shown, safe
        return self.text[shown:safe]

    def finish(self) -> tuple[str, list[dict]]:
        """The content not streamed yet, and the calls."""
        parsed = parse(self.text)
        if not parsed.calls:
            return self.text[self.shown :], []
        return self.text[self.shown : parsed.content_end].rstrip(), parsed.calls
