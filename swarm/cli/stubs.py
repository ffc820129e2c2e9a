"""Entry points for commands whose issue has not landed yet: each says so and exits with status 2."""

from __future__ import annotations

import sys


def _not_yet(command: str) -> None:
    print(f"{command}: not implemented yet", file=sys.stderr)
    raise SystemExit(2)


def scheduler_main() -> None:
    _not_yet("swarm-scheduler")
