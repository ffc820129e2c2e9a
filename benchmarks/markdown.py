"""Read or replace (or append) one `## ` section of BENCHMARKS.md, leaving the others as they are."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # the repository
BENCHMARKS = ROOT / "BENCHMARKS.md"


def _bounds(text: str, header: str) -> tuple[int, int]:
    """Where the section `header` starts in `text` and where it ends (the next `## ` line or the end)."""
    start = text.index(header)
    end = text.find("\n## ", start + len(header))
    return start, end if end != -1 else len(text)


def read_section(header: str, path: Path = BENCHMARKS) -> str:
    """The section whose `## ...` line is `header`, that line included."""
    text = path.read_text()
    start, end = _bounds(text, header)
    return text[start:end]


def write_section(header: str, body: str, path: Path = BENCHMARKS) -> None:
    """`header` is the section's `## ...` line; `body` is the whole section, header included."""
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    if header in text:
        start, end = _bounds(text, header)
        text = text[:start] + body + text[end:]
    else:
        text = text.rstrip("\n") + "\n\n" + body
    path.write_text(text)
