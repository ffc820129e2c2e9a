"""The command line of the processes the emulation starts (`delayer.py`, `loadgen.py`): the path of a
JSON spec first, then the other paths the process needs.

Kept free of imports from this package: `delayer.py` runs as a plain file, with this folder on
`sys.path`, not as `netem.delayer`.
"""

from __future__ import annotations

import json
import sys


def read_spec_args(argv: list[str] | None, count: int, usage: str) -> tuple[dict, list[str]] | None:
    """The spec (the JSON file named by the first argument) and all the arguments, from `argv` or else
    the command line; None, after printing `usage` to stderr, unless there are exactly `count`."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != count:
        print(usage, file=sys.stderr)
        return None
    with open(args[0]) as handle:
        return json.load(handle), args
