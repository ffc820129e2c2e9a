"""The prompts file of `swarm-batch` (JSON lines in) and the result records it writes (JSON lines out).

Pure: text in, typed records or a `BatchInputError` naming the line out. Every line of the input is
checked before anything connects to the swarm, so a typo on line 9,000 stops the job at once rather
than after hours of generation.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from llm_swarm.swarm.errors import SwarmUserError

MAX_ID_CHARS = 256
INPUT_FIELDS = ("id", "prompt", "max_new_tokens")


class BatchInputError(SwarmUserError):
    """The prompts file (or the results file) cannot be used as it is; the message names the line."""


@dataclass(frozen=True)
class InputLimits:
    """What one prompts file may ask for (the command's flags)."""

    default_max_new_tokens: int = 32  # for lines without "max_new_tokens"
    max_new_tokens_limit: int = 1024  # a line asking for more is refused
    max_prompt_chars: int = 100_000  # a longer prompt is refused before tokenizing it
    max_prompts: int = 1_000_000

    def __post_init__(self) -> None:
        if not 1 <= self.default_max_new_tokens <= self.max_new_tokens_limit:
            raise BatchInputError(
                f"--max-new-tokens ({self.default_max_new_tokens}) must be in 1..--max-new-tokens-limit "
                f"({self.max_new_tokens_limit})"
            )
        if self.max_prompt_chars < 1 or self.max_prompts < 1:
            raise BatchInputError("the prompt size and count limits must be positive")

    @property
    def max_line_chars(self) -> int:
        """A line longer than this cannot hold a valid record (JSON may escape each character as 6)."""
        return 6 * self.max_prompt_chars + 4 * MAX_ID_CHARS + 1024


@dataclass(frozen=True)
class PromptRecord:
    """One valid input line."""

    id: str | int  # as given: written back unchanged in the result
    prompt: str
    max_new_tokens: int
    line: int  # 1-based line number in the prompts file, for error messages

    @property
    def key(self) -> str:
        return id_key(self.id)


def id_key(value: str | int) -> str:
    """How ids are compared (results against prompts, duplicates): their JSON text, so that the id
    "7" and the id 7 stay two different ids, exactly as they are written."""
    return json.dumps(value, ensure_ascii=False)


def _check_id(value: object, where: str) -> str | int:
    if isinstance(value, bool) or not isinstance(value, str | int):
        raise BatchInputError(f'{where}: "id" must be a string or an integer, got {type(value).__name__}')
    if isinstance(value, str) and not 0 < len(value) <= MAX_ID_CHARS:
        raise BatchInputError(f'{where}: "id" must be 1..{MAX_ID_CHARS} characters long')
    if isinstance(value, int) and abs(value) >= 2**63:
        raise BatchInputError(f'{where}: "id" {value} is out of the 64-bit range')
    return value


def parse_prompt_line(
    text: str, line: int, limits: InputLimits, source: str = "prompts"
) -> PromptRecord | None:
    """The record of one line (None for a blank line), or a `BatchInputError` saying what is wrong."""
    where = f"{source} line {line}"
    if not text.strip():
        return None
    if len(text) > limits.max_line_chars:
        raise BatchInputError(f"{where}: the line is {len(text)} characters long, more than any valid record")
    try:
        record = json.loads(text)
    except json.JSONDecodeError as error:
        raise BatchInputError(f"{where}: not valid JSON ({error.msg} at column {error.colno})") from None
    if not isinstance(record, dict):
        raise BatchInputError(f"{where}: expected a JSON object, got {type(record).__name__}")
    unknown = sorted(set(record) - set(INPUT_FIELDS))
    if unknown:
        raise BatchInputError(
            f"{where}: unknown field(s) {', '.join(map(repr, unknown))}; a line has "
            f'"id", "prompt" and optionally "max_new_tokens"'
        )
    for name in ("id", "prompt"):
        if name not in record:
            raise BatchInputError(f'{where}: missing "{name}"')
    record_id = _check_id(record["id"], where)
    where = f"{where} (id {id_key(record_id)})"
    prompt = record["prompt"]
    if not isinstance(prompt, str):
        raise BatchInputError(f'{where}: "prompt" must be a string, got {type(prompt).__name__}')
    if not prompt:
        raise BatchInputError(f'{where}: "prompt" is empty')
    if len(prompt) > limits.max_prompt_chars:
        raise BatchInputError(
            f'{where}: "prompt" has {len(prompt)} characters, more than --max-prompt-chars '
            f"({limits.max_prompt_chars})"
        )
    max_new = record.get("max_new_tokens", limits.default_max_new_tokens)
    if isinstance(max_new, float) and math.isfinite(max_new) and max_new.is_integer():
        max_new = int(max_new)  # 16.0 is what some JSON writers make of 16
    if isinstance(max_new, bool) or not isinstance(max_new, int):
        raise BatchInputError(f'{where}: "max_new_tokens" must be an integer, got {max_new!r}')
    if not 1 <= max_new <= limits.max_new_tokens_limit:
        raise BatchInputError(
            f'{where}: "max_new_tokens" must be in 1..{limits.max_new_tokens_limit} '
            f"(--max-new-tokens-limit), got {max_new}"
        )
    return PromptRecord(record_id, prompt, max_new, line)


def parse_prompt_lines(
    lines: Iterable[str], limits: InputLimits, source: str = "prompts"
) -> list[PromptRecord]:
    """Every record of a prompts file's lines; refuses duplicate ids (naming both lines)."""
    records: list[PromptRecord] = []
    first_line: dict[str, int] = {}
    for number, text in enumerate(lines, start=1):
        record = parse_prompt_line(text, number, limits, source)
        if record is None:
            continue
        if record.key in first_line:
            raise BatchInputError(
                f"{source} line {number}: id {record.key} was already used on line {first_line[record.key]}"
            )
        first_line[record.key] = number
        records.append(record)
        if len(records) > limits.max_prompts:
            raise BatchInputError(f"{source}: more than {limits.max_prompts} prompts (--max-prompts)")
    return records


def read_prompts(path: Path, limits: InputLimits) -> list[PromptRecord]:
    """The records of the prompts file at `path` (UTF-8 JSON lines)."""
    try:
        with path.open(encoding="utf-8", newline="\n") as handle:
            return parse_prompt_lines(
                _bounded_lines(handle, limits.max_line_chars, path.name), limits, path.name
            )
    except FileNotFoundError:
        raise BatchInputError(f"prompts file {path} does not exist") from None
    except UnicodeDecodeError as error:
        raise BatchInputError(f"{path.name}: not UTF-8 text ({error.reason} at byte {error.start})") from None
    except IsADirectoryError:
        raise BatchInputError(f"prompts file {path} is a directory") from None


def _bounded_lines(handle, max_chars: int, source: str) -> Iterable[str]:
    """The file's lines, never reading more than `max_chars` + 1 characters of one into memory."""
    number = 0
    while True:
        number += 1
        text = handle.readline(max_chars + 1)
        if not text:
            return
        if len(text) > max_chars and not text.endswith("\n"):
            raise BatchInputError(f"{source} line {number}: the line is longer than any valid record")
        yield text


@dataclass(frozen=True)
class TokenBounds:
    """What the model and the flags allow one prompt to tokenize to."""

    max_prompt_tokens: int
    max_total_tokens: int | None  # the model's position limit (prompt + new tokens), if it has one


def check_prompt_tokens(record: PromptRecord, prompt_tokens: int, bounds: TokenBounds, source: str) -> None:
    """Refuse a prompt that tokenizes to nothing or to more than the bounds allow, naming its line."""
    where = f"{source} line {record.line} (id {record.key})"
    if prompt_tokens < 1:
        raise BatchInputError(f'{where}: "prompt" tokenizes to no tokens at all')
    if prompt_tokens > bounds.max_prompt_tokens:
        raise BatchInputError(
            f'{where}: "prompt" is {prompt_tokens} tokens, more than --max-prompt-tokens '
            f"({bounds.max_prompt_tokens})"
        )
    total = prompt_tokens + record.max_new_tokens
    if bounds.max_total_tokens is not None and total > bounds.max_total_tokens:
        raise BatchInputError(
            f"{where}: {prompt_tokens} prompt tokens + {record.max_new_tokens} new tokens exceed the "
            f"model's {bounds.max_total_tokens} positions"
        )


def result_record(
    record: PromptRecord,
    text: str,
    tokens: list[int],
    prompt_tokens: int,
    finish_reason: str,
    chain: int,
    seconds: float,
) -> dict:
    """The output line of a prompt answered."""
    return {
        "id": record.id,
        "text": text,
        "tokens": tokens,
        "prompt_tokens": prompt_tokens,
        "finish_reason": finish_reason,
        "chain": chain,
        "seconds": round(seconds, 4),
    }


def error_record(record: PromptRecord, error: str, chain: int | None) -> dict:
    """The output line of a prompt that failed (after the client's own failovers and retries)."""
    return {"id": record.id, "error": error, "chain": chain}
