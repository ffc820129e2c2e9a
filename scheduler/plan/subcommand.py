"""How `swarm-plan` adds a subcommand."""

from __future__ import annotations

import argparse


def add_subcommand(
    commands: argparse._SubParsersAction, name: str, help_text: str, description: str
) -> argparse.ArgumentParser:
    """The parser of subcommand `name`: one line in `swarm-plan --help`, and its own `--help` shows
    `description` with its line breaks (the examples and input formats are laid out by hand)."""
    return commands.add_parser(
        name, help=help_text, description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
