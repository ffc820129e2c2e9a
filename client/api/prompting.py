"""Turning a request into token ids: the checkpoint's chat template, or ours when it has none."""

from __future__ import annotations

from client.api.schema import Message

# For checkpoints without a chat template (the tiny test models). Documented in the README: each
# message on its own line after a role tag, then the assistant's tag the model continues from.
SIMPLE_TEMPLATE = (
    "{% for message in messages %}<|{{ message.role }}|>\n{{ message.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def chat_prompt(tokenizer, messages: list[Message]) -> list[int]:
    """Token ids of the conversation, ready for the assistant's answer."""
    template = getattr(tokenizer, "chat_template", None) or SIMPLE_TEMPLATE
    ids = tokenizer.apply_chat_template(
        [message.model_dump(exclude_none=True) for message in messages],
        chat_template=template,
        add_generation_prompt=True,
        tokenize=True,
    )
    return list(ids["input_ids"] if isinstance(ids, dict) else ids)


def completion_prompt(tokenizer, prompt: str) -> list[int]:
    return list(tokenizer(prompt).input_ids)


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
