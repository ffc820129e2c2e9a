"""Names of everything llm-swarm stores in the DHT."""

from __future__ import annotations

import re

from swarm.errors import SwarmUserError

_PREFIX = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}$")


def validate_prefix(prefix: str) -> str:
    if not _PREFIX.match(prefix):
        raise SwarmUserError(
            f"DHT prefix {prefix!r} must be 1-64 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )
    return prefix


def default_prefix(model_dir: str) -> str:
    """Servers and clients of one model find each other under its directory name, like PETALS' repo names."""
    name = re.sub(r"[^A-Za-z0-9_.\-]", "-", model_dir.rstrip("/").split("/")[-1]).lstrip(".-_") or "model"
    return validate_prefix(name[:64])


def block_key(prefix: str, block: int) -> str:
    """Key of block `block`; each server serving it stores its `ServerInfo` under its peer id as subkey."""
    return f"{prefix}.{block}"


def roster_key(prefix: str) -> str:
    """Key listing every server of the model (subkey: peer id), with or without blocks: what the
    scheduler places. Clients read block keys instead, which only hold servers with blocks."""
    return f"{prefix}._servers"


def scheduler_key(prefix: str) -> str:
    """Key of the scheduler's record: its gRPC address and the current placement."""
    return f"{prefix}._scheduler"
