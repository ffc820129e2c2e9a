"""`python -m benchmarks.netem ...`: see cli.py."""

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a directory: make `netem` importable as a package
    sys.path = [p for p in sys.path if Path(p).resolve() != Path(__file__).resolve().parent]

from benchmarks.netem.cli import main

sys.exit(main())
