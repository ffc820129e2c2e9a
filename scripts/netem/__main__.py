"""`python scripts/netem ...` (or `python -m netem` with scripts/ on sys.path): see cli.py."""

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a directory: make `netem` importable as a package
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    sys.path = [p for p in sys.path if Path(p).resolve() != Path(__file__).resolve().parent]

from netem.cli import main  # noqa: E402

sys.exit(main())
