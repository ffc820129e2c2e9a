"""Publishing and reading server records in a hivemind DHT (the only module that knows the DHT's API).

The functions passed to `DHT.run_coroutine` execute inside the DHT's own process, so they are
module-level (picklable) and return plain data.
"""

from __future__ import annotations

from functools import partial

from hivemind.dht import DHT, DHTNode
from hivemind.utils.timed_storage import get_dht_time

from swarm.dht_keys import block_key
from swarm.server_info import ServerInfo


async def _store_blocks(
    _dht: DHT, node: DHTNode, keys: list[str], subkey: str, value: dict, expiration: float
) -> bool:
    count = len(keys)
    results = await node.store_many(
        keys, [value] * count, expiration_time=[expiration] * count, subkeys=[subkey] * count
    )
    return all(results.values())


def announce(dht: DHT, prefix: str, peer_id: str, info: ServerInfo, ttl: float, wait: bool = True):
    """Store `info` under every block key of the server's span, expiring after `ttl` seconds."""
    keys = [block_key(prefix, block) for block in range(info.start, info.end)]
    coroutine = partial(
        _store_blocks, keys=keys, subkey=peer_id, value=info.to_wire(), expiration=get_dht_time() + ttl
    )
    return dht.run_coroutine(coroutine, return_future=not wait)


async def _get_blocks(_dht: DHT, node: DHTNode, keys: list[str]) -> dict[str, dict[str, object]]:
    found = await node.get_many(keys)
    records: dict[str, dict[str, object]] = {}
    for key, entry in found.items():
        if entry is None or not isinstance(entry.value, dict):
            continue
        records[key] = {str(subkey): item.value for subkey, item in entry.value.items()}
    return records


def fetch_servers(dht: DHT, prefix: str, num_blocks: int) -> dict[str, ServerInfo]:
    """Every valid server record of the model, by peer id (base58); malformed records are skipped."""
    records = dht.run_coroutine(partial(_get_blocks, keys=_all_block_keys(prefix, num_blocks)))
    return parse_server_records(records, num_blocks)


async def fetch_servers_async(dht: DHT, prefix: str, num_blocks: int) -> dict[str, ServerInfo]:
    future = dht.run_coroutine(
        partial(_get_blocks, keys=_all_block_keys(prefix, num_blocks)), return_future=True
    )
    return parse_server_records(await future, num_blocks)


def _all_block_keys(prefix: str, num_blocks: int) -> list[str]:
    return [block_key(prefix, block) for block in range(num_blocks)]


def parse_server_records(records: dict[str, dict[str, object]], num_blocks: int) -> dict[str, ServerInfo]:
    """A server appears under each block of its span with the same value: keep one record per peer."""
    servers: dict[str, ServerInfo] = {}
    for per_peer in records.values():
        for peer_id, value in per_peer.items():
            info = ServerInfo.from_wire(value)
            if info is not None and info.end <= num_blocks and peer_id not in servers:
                servers[peer_id] = info
    return servers
