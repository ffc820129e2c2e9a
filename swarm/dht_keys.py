"""Names of everything llm-swarm stores in the DHT."""

from __future__ import annotations

import hashlib
import re

from llm_swarm.swarm.errors import SwarmUserError
from llm_swarm.swarm.hub_snapshot import hub_snapshot

_PREFIX = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}$")


def validate_prefix(prefix: str) -> str:
    if not _PREFIX.match(prefix):
        raise SwarmUserError(
            f"DHT prefix {prefix!r} must be 1-64 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )
    return prefix


def default_prefix(model_dir: str) -> str:
    """Servers and clients of one model find each other under its directory name, like PETALS' repo
    names; a Hub snapshot's under its model name and commit (`NAME.COMMIT12`), so that servers and
    clients of different revisions never meet."""
    snapshot = hub_snapshot(model_dir.rstrip("/"))
    if snapshot is not None:
        repo_id, commit = snapshot
        return f"{_safe_name(repo_id.split('/')[-1])[:51]}.{commit[:12]}"
    return validate_prefix(_safe_name(model_dir.rstrip("/").split("/")[-1])[:64])


def _safe_name(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.\-]", "-", name).lstrip(".-_") or "model"


def block_key(prefix: str, block: int) -> str:
    """Key of block `block`; each server serving it stores its `ServerInfo` under its peer id as subkey."""
    return f"{prefix}.{block}"


def roster_key(prefix: str) -> str:
    """The legacy roster: one key listing every server of the model (subkey: its owner key), with or
    without blocks. Servers before the sharded roster wrote it (and their block keys) only; it grows
    with the swarm, so current servers write it only while `legacy_records` is on."""
    return f"{prefix}._servers"


ROSTER_SHARDS = 16  # 1,000 servers: ~63 records (~70 KB) per value instead of one 1 MB value


def roster_shard_key(prefix: str, shard: int) -> str:
    """One shard of the roster: the servers whose owner key hashes to `shard`."""
    return f"{prefix}._servers.{shard}"


def roster_shard_of(owner: bytes) -> int:
    """The shard a server's records go to: a hash of its owner subkey, so it never moves."""
    return int.from_bytes(hashlib.sha256(owner).digest()[:4], "big") % ROSTER_SHARDS


def roster_keys(prefix: str) -> list[str]:
    """What readers fetch to see every server: every shard, and the legacy roster for servers that
    predate the shards (or still write it), newest record per peer winning."""
    return [*(roster_shard_key(prefix, shard) for shard in range(ROSTER_SHARDS)), roster_key(prefix)]


def scheduler_key(prefix: str) -> str:
    """Key of the scheduler's record: its gRPC address and the current placement."""
    return f"{prefix}._scheduler"
