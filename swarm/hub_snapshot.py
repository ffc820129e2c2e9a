"""Where the Hugging Face Hub cache keeps one commit of a model: `.../models--ORG--NAME/snapshots/
COMMIT`. Kept apart from `swarm.models.hub` (which fetches) so that light modules, such as the DHT's
key names, can tell a snapshot from a local directory without importing the model code."""

from __future__ import annotations

from pathlib import Path


def hub_snapshot(model_dir: str | Path) -> tuple[str, str] | None:
    """`(repo_id, commit)` when `model_dir` is a snapshot directory of the Hub cache, else None."""
    path = Path(model_dir)
    if path.parent.name != "snapshots" or not path.parent.parent.name.startswith("models--"):
        return None
    return path.parent.parent.name[len("models--") :].replace("--", "/"), path.name
