"""Turning a request into token ids: the checkpoint's chat template (with tools where it renders them),
or ours when it has none; completion prompts as text or token ids."""

from __future__ import annotations

from functools import lru_cache

import jinja2
import jinja2.meta

from llm_swarm.client.api.chat_schema import Message
from llm_swarm.client.api.errors import bad_request

# For checkpoints without a chat template (the tiny test models). Documented in the README: each
# message on its own line after a role tag, then the assistant's tag the model continues from.
SIMPLE_TEMPLATE = (
    "{% for message in messages %}<|{{ message.role }}|>\n{{ message.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def chat_template(tokenizer, tools: list[dict] | None = None) -> str:
    """The template a conversation is rendered with: the checkpoint's (its tool-use variant when it
    names one and tools are given, as transformers chooses), or ours when it has none."""
    if getattr(tokenizer, "chat_template", None) is None:
        return SIMPLE_TEMPLATE
    return tokenizer.get_chat_template(None, tools)


@lru_cache(maxsize=16)
def template_renders_tools(template: str) -> bool:
    """Whether the template uses the `tools` variable at all (a template that ignores it would
    silently drop the tools from the prompt)."""
    try:
        return "tools" in jinja2.meta.find_undeclared_variables(jinja2.Environment().parse(template))
    except jinja2.TemplateSyntaxError:
        return False


def chat_prompt(
    tokenizer, messages: list[Message], tools: list[dict] | None = None, opening: str = ""
) -> list[int]:
    """Token ids of the conversation, ready for the assistant's answer (which starts with `opening`,
    the beginning of a tool call the request forces; see `client.api.tools`)."""
    template = chat_template(tokenizer, tools)
    if tools is not None and not template_renders_tools(template):
        raise bad_request(
            "this model's chat template does not support tools (it never renders `tools`); "
            "serve a checkpoint whose template does, or call without tools",
            "tools",
        )
    ids = tokenizer.apply_chat_template(
        [message.for_template() for message in messages],
        tools=tools,
        chat_template=template,
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,  # transformers 5 returns a BatchEncoding by default, 4.57 the ids
    )
    ids = list(ids)
    if opening:
        ids += tokenizer(opening, add_special_tokens=False).input_ids
    return ids


def completion_prompt(tokenizer, prompt: str | list[int], vocab_size: int) -> list[int]:
    """Token ids of one prompt: a string tokenized as the checkpoint does, or ids checked against the
    vocabulary."""
    if isinstance(prompt, str):
        return list(tokenizer(prompt).input_ids)
    if any(not 0 <= token < vocab_size for token in prompt):
        raise bad_request(f"prompt holds token ids outside the vocabulary (0..{vocab_size - 1})", "prompt")
    return list(prompt)


def prompt_text(tokenizer, prompt: str | list[int]) -> str:
    """What `echo` shows of a prompt: the string as given, or a token-id prompt decoded."""
    return prompt if isinstance(prompt, str) else tokenizer.decode(prompt, skip_special_tokens=True)


class StopStrings:
    """Cuts generated text at the first stop string, holding back a tail that may begin one (so a
    stream never shows part of a stop string)."""

    def __init__(self, stops: list[str] | None):
        self.stops = stops or []

    def cut(self, text: str) -> tuple[str, bool]:
        """(text before the first stop string, whether one was found)."""
        found = [index for index in (text.find(stop) for stop in self.stops) if index != -1]
        return (text[: min(found)], True) if found else (text, False)

    def safe_length(self, text: str) -> int:
        """How much of `text` can be shown now: all but a suffix that is a prefix of a stop string."""
        held = 0
        for stop in self.stops:
            for size in range(min(len(stop) - 1, len(text)), 0, -1):
                if text.endswith(stop[:size]):
                    held = max(held, size)
                    break
        return len(text) - held
