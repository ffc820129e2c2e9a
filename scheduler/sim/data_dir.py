"""Where the real inputs live (topologies, the Azure trace, RIPE Atlas RTTs).

They ship with the project in its `data/` folder (see `data/README.md` for each file's source,
licence and preparation). `SWARM_DATA_DIR` may point at another folder with the same layout, for
instance a larger trace.
"""

from __future__ import annotations

import os
from pathlib import Path

REPOSITORY_DATA = Path(__file__).resolve().parents[2] / "data"


def find_data_dir() -> Path:
    override = os.environ.get("SWARM_DATA_DIR")
    return Path(override) if override else REPOSITORY_DATA


DATA_DIR = find_data_dir()
