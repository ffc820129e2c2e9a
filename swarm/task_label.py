"""A task label a client may declare with its sessions (e.g. "code", "chat"): the scheduler learns
output lengths per label (swarm/length_prediction.py). Checked where it is set and where it is
received, with the same rule."""

from __future__ import annotations

LABEL_CHARS = 64


def check_label(label: str | None) -> str | None:
    """A task label: None or "" (none), else at most `LABEL_CHARS` printable characters."""
    if label is None or label == "":
        return None
    if not isinstance(label, str) or len(label) > LABEL_CHARS or not label.isprintable():
        # the message quotes at most the start of what came: a hostile label of a megabyte must not be
        # echoed back (a gRPC error's details travel in metadata, limited to 16 KB)
        shown = repr(label[: LABEL_CHARS + 1]) if isinstance(label, str) else type(label).__name__
        size = f" ({len(label)} characters)" if isinstance(label, str) else ""
        limit = f"a task label must be at most {LABEL_CHARS} printable characters"
        raise ValueError(f"{limit}, got {shown}{size}")
    return label
