"""Turn user errors into one clear line and exit status 2; let real bugs keep their traceback."""

from __future__ import annotations

import sys
from collections.abc import Callable

from llm_swarm.swarm.errors import SwarmUserError


def run_cli(prog: str, main: Callable[[], None]) -> None:
    try:
        main()
    except SwarmUserError as error:
        print(f"{prog}: error: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        raise SystemExit(130) from None
