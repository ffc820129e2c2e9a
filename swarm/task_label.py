"""A task label a client may declare with its sessions (e.g. "code", "chat"): the scheduler learns
output lengths per label (scheduler/length_prediction.py). Checked where it is set and where it is
received, with the same rule."""

from __future__ import annotations

LABEL_CHARS = 64


def check_label(label: str | None) -> str | None:
    """A task label: None or "" (none), else at most `LABEL_CHARS` printable characters."""
    if label is None or label == "":
        return None
    if not isinstance(label, str) or len(label) > LABEL_CHARS or not label.isprintable():
        raise ValueError(f"a task label must be at most {LABEL_CHARS} printable characters, got {label!r}")
    return label
