"""Publishing and reading swarm records in a hivemind DHT (the only module that knows the DHT's API).

The functions passed to `DHT.run_coroutine` execute inside the DHT's own process, so they are
module-level (picklable) and return plain data.

Records:
- every block key `{prefix}.{b}` holds, per serving peer, its `ServerInfo` (what clients route on);
- the roster key `{prefix}._servers` holds every server's `ServerInfo`, blocks or not (what the
  scheduler places);
- the scheduler key `{prefix}._scheduler` holds the scheduler's address and current placement.
A server that moved leaves stale records under its old blocks until they expire; every record
carries `announced_at`, and readers keep only the newest record per peer.
"""

from __future__ import annotations

from functools import partial
from typing import Any

from hivemind.dht import DHT, DHTNode
from hivemind.utils.timed_storage import get_dht_time

from swarm.dht_keys import block_key, roster_key, scheduler_key
from swarm.server_info import ServerInfo

SCHEDULER_RECORD_VERSION = 1


async def _store(
    _dht: DHT, node: DHTNode, keys: list[str], subkey: str, value: Any, expiration: float
) -> bool:
    count = len(keys)
    results = await node.store_many(
        keys, [value] * count, expiration_time=[expiration] * count, subkeys=[subkey] * count
    )
    return all(results.values())


def announce(dht: DHT, prefix: str, peer_id: str, info: ServerInfo, ttl: float, wait: bool = True):
    """Store `info` under the roster key and every block key of the server's span, for `ttl` seconds."""
    now = get_dht_time()
    info = info.model_copy(update={"announced_at": now})
    keys = [roster_key(prefix)]
    if info.has_blocks:
        keys += [block_key(prefix, block) for block in range(info.start, info.end)]
    coroutine = partial(_store, keys=keys, subkey=peer_id, value=info.to_wire(), expiration=now + ttl)
    return dht.run_coroutine(coroutine, return_future=not wait)


async def _get(_dht: DHT, node: DHTNode, keys: list[str]) -> dict[str, dict[str, object]]:
    # latest: search the peers for the newest value instead of stopping at the first one found,
    # which may be this node's own cached copy (a server that moved, a scheduler that restarted)
    found = await node.get_many(keys, sufficient_expiration_time=float("inf"))
    records: dict[str, dict[str, object]] = {}
    for key, entry in found.items():
        if entry is None or not isinstance(entry.value, dict):
            continue
        records[key] = {str(subkey): item.value for subkey, item in entry.value.items()}
    return records


def fetch_servers(dht: DHT, prefix: str, num_blocks: int) -> dict[str, ServerInfo]:
    """Every valid record of a server with blocks, by peer id (base58); malformed records are skipped."""
    records = dht.run_coroutine(partial(_get, keys=_all_block_keys(prefix, num_blocks)))
    return parse_server_records(records, num_blocks)


async def fetch_servers_async(dht: DHT, prefix: str, num_blocks: int) -> dict[str, ServerInfo]:
    future = dht.run_coroutine(partial(_get, keys=_all_block_keys(prefix, num_blocks)), return_future=True)
    return parse_server_records(await future, num_blocks)


async def fetch_roster_async(dht: DHT, prefix: str, num_blocks: int) -> dict[str, ServerInfo]:
    """Every server of the model (with or without blocks), newest record per peer."""
    future = dht.run_coroutine(partial(_get, keys=[roster_key(prefix)]), return_future=True)
    return parse_server_records(await future, num_blocks, require_blocks=False)


def _all_block_keys(prefix: str, num_blocks: int) -> list[str]:
    return [block_key(prefix, block) for block in range(num_blocks)]


def parse_server_records(
    records: dict[str, dict[str, object]], num_blocks: int, require_blocks: bool = True
) -> dict[str, ServerInfo]:
    """One record per peer: the newest valid one (a server that moved may leave older ones behind)."""
    servers: dict[str, ServerInfo] = {}
    for per_peer in records.values():
        for peer_id, value in per_peer.items():
            info = ServerInfo.from_wire(value)
            if info is None or (info.has_blocks and info.end > num_blocks):
                continue
            if require_blocks and not info.has_blocks:
                continue
            known = servers.get(peer_id)
            if known is None or info.announced_at > known.announced_at:
                servers[peer_id] = info
    return servers


# --- the scheduler's record ---------------------------------------------------------------------


def publish_scheduler(dht: DHT, prefix: str, record: dict[str, Any], ttl: float, wait: bool = True):
    """Store the scheduler's address and placement (a JSON-able dict) under the scheduler key."""
    value = {"schema_version": SCHEDULER_RECORD_VERSION, **record}
    coroutine = partial(
        _store, keys=[scheduler_key(prefix)], subkey="scheduler", value=value, expiration=get_dht_time() + ttl
    )
    return dht.run_coroutine(coroutine, return_future=not wait)


async def fetch_scheduler_async(dht: DHT, prefix: str) -> dict[str, Any] | None:
    """The scheduler's record, or None if no (valid) scheduler is announced."""
    future = dht.run_coroutine(partial(_get, keys=[scheduler_key(prefix)]), return_future=True)
    value = (await future).get(scheduler_key(prefix), {}).get("scheduler")
    if not isinstance(value, dict) or value.get("schema_version") != SCHEDULER_RECORD_VERSION:
        return None
    address = value.get("address")
    if not isinstance(address, str) or ":" not in address:
        return None
    return value
