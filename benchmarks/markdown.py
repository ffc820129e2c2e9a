"""Replace (or append) one `## ` section of BENCHMARKS.md, leaving the others as they are."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # the repository
BENCHMARKS = ROOT / "BENCHMARKS.md"


def write_section(header: str, body: str, path: Path = BENCHMARKS) -> None:
    """`header` is the section's `## ...` line; `body` is the whole section, header included."""
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    if header in text:
        start = text.index(header)
        end = text.find("\n## ", start + len(header))
        text = text[:start] + body + (text[end:] if end != -1 else "")
    else:
        text = text.rstrip("\n") + "\n\n" + body
    path.write_text(text)
