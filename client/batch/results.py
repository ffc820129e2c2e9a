"""The results file of `swarm-batch`: what a restart skips, and appending so that a kill loses nothing.

Each finished prompt is one line, appended with a single `write` and made durable with `fsync`
before the next one starts, so the file only ever ends in one of two ways: complete lines, or
complete lines followed by one torn line (the process was killed inside the write). A restart
reads the ids of the complete lines and skips them; the torn tail is cut off (`repair`). A prompt
is never written twice: the writer refuses an id it, or an earlier run, already wrote.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path

from llm_swarm.client.batch.records import BatchInputError, id_key

logger = logging.getLogger(__name__)


@dataclass
class ResultsState:
    """What an existing results file holds."""

    done: set[str] = field(default_factory=set)  # id keys (`records.id_key`) answered or failed
    errors: set[str] = field(default_factory=set)  # the failed ones among them
    lines: int = 0
    torn_bytes: int = 0  # the length of a torn last line that `repair` cut off
    duplicates: int = 0  # lines repeating an earlier id (only someone else's writes make them)


def parse_results(data: bytes, source: str = "results") -> tuple[ResultsState, int]:
    """The state of a results file's bytes, and how many of them are complete lines (a torn last
    line, without its newline, is not). A complete line that is not a result record is refused:
    the file is not ours, or was edited, and guessing could answer a prompt twice."""
    complete = data.rfind(b"\n") + 1
    state = ResultsState(torn_bytes=len(data) - complete)
    for number, raw in enumerate(data[:complete].split(b"\n")[:-1], start=1):
        if not raw.strip():
            continue
        try:
            record = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise BatchInputError(
                f"{source} line {number} is not JSON: not a file swarm-batch wrote (or it was edited); "
                "fix or remove that line, or write the results elsewhere"
            ) from None
        if not isinstance(record, dict) or "id" not in record:
            raise BatchInputError(f'{source} line {number} is not a result record (no "id")')
        key = id_key(record["id"])
        state.lines += 1
        if key in state.done:
            state.duplicates += 1
            continue
        state.done.add(key)
        if "error" in record:
            state.errors.add(key)
    return state, complete


def load_results(path: Path, repair: bool = True) -> ResultsState:
    """The state of the results file at `path` (empty if there is none); with `repair`, a torn last
    line is cut off the file, so that the next append starts on a line of its own."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return ResultsState()
    except IsADirectoryError:
        raise BatchInputError(f"results file {path} is a directory") from None
    state, complete = parse_results(data, path.name)
    if state.torn_bytes and repair:
        with path.open("r+b") as handle:
            handle.truncate(complete)
            handle.flush()
            os.fsync(handle.fileno())
        logger.warning(
            "%s ended in a torn line of %d bytes (a run killed while writing it): cut off; that prompt "
            "runs again",
            path.name,
            state.torn_bytes,
        )
    if state.duplicates:
        logger.warning("%s repeats %d ids; the first line of each counts", path.name, state.duplicates)
    return state


def drop_error_lines(path: Path) -> int:
    """Rewrite the results file without its error lines (`--retry-errors`), atomically: a new file
    beside it, fsynced, renamed over it. Returns how many lines were dropped."""
    data = path.read_bytes()
    parse_results(data, path.name)  # refuse what is not ours before rewriting anything
    kept, dropped = [], 0
    for raw in data[: data.rfind(b"\n") + 1].split(b"\n")[:-1]:
        if raw.strip() and "error" in json.loads(raw):
            dropped += 1
        else:
            kept.append(raw + b"\n")
    if not dropped:
        return 0
    fresh = path.with_name(path.name + ".rewrite")
    with fresh.open("wb") as handle:
        handle.write(b"".join(kept))
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(fresh, path)
    _fsync_directory(path.parent)
    return dropped


def _fsync_directory(directory: Path) -> None:
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


class ResultsWriter:
    """Appends result records, one durable line each; thread-safe; never the same id twice."""

    def __init__(self, path: Path, already_done: set[str]):
        self.path = path
        self._written = set(already_done)
        self._lock = threading.Lock()
        created = not path.exists()
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        if created:
            _fsync_directory(path.parent)  # the new file's name survives a crash too

    def write(self, record: dict) -> None:
        line = (json.dumps(record, ensure_ascii=False, allow_nan=False) + "\n").encode()
        key = id_key(record["id"])
        with self._lock:
            if key in self._written:
                raise RuntimeError(f"id {key} was already written to {self.path.name}: a bug")
            view = memoryview(line)
            while view:  # one write unless interrupted part-way; a kill then leaves a torn line
                view = view[os.write(self._fd, view) :]
            os.fsync(self._fd)
            self._written.add(key)

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1
