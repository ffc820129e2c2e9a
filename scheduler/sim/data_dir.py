"""Where the real inputs live (topologies, the Azure trace, RIPE Atlas RTTs).

`SWARM_DATA_DIR` wins; otherwise the `shared/data` folder beside the repository (how checkouts and
CI are laid out), then a `data/` folder inside it.
"""

from __future__ import annotations

import os
from pathlib import Path

_REPO = Path(__file__).resolve().parents[2]


def find_data_dir() -> Path:
    candidates = [Path(os.environ["SWARM_DATA_DIR"])] if os.environ.get("SWARM_DATA_DIR") else []
    candidates += [_REPO.parent / "shared" / "data", _REPO / "data"]
    return next((path for path in candidates if path.is_dir()), candidates[0])


DATA_DIR = find_data_dir()
