"""Publishing and reading swarm records in a hivemind DHT (the only module that knows the DHT's API).

The functions passed to `DHT.run_coroutine` execute inside the DHT's own process, so they are
module-level (picklable) and return plain data.

Records:
- the roster is sharded: `{prefix}._servers.{s}` (s < ROSTER_SHARDS) holds the `ServerInfo` of every
  server whose owner key hashes to s, blocks or not. Clients, the scheduler and the status page read
  all shards (one small value each) to see the whole swarm: what one value holds grows with the
  swarm / ROSTER_SHARDS, and no reader fetches anything per block;
- legacy keys, for swarms that still have older clients and schedulers (`legacy_records`): the one
  roster key `{prefix}._servers` and every block key `{prefix}.{b}`, per serving peer. Readers also
  read the legacy roster, so servers that predate the shards are seen too;
- the scheduler key `{prefix}._scheduler` holds schedulers' addresses and current placements.
Every record is an entry under its writer's owner subkey (`swarm.identity`), signed by the writer
and validated by every node (`swarm.record_validator`); the writer's peer id is derived from that
subkey, never read from the record. A server that moved leaves stale records under its old blocks
until they expire; every record carries `announced_at`, and readers keep only the newest per peer.
"""

from __future__ import annotations

import asyncio
import math
from functools import partial
from typing import Any

from hivemind.dht import DHT, DHTNode
from hivemind.utils.timed_storage import get_dht_time

from llm_swarm.swarm.dht_keys import (
    block_key,
    roster_key,
    roster_keys,
    roster_shard_key,
    roster_shard_of,
    scheduler_key,
)
from llm_swarm.swarm.identity import owner_key, peer_id_of_key
from llm_swarm.swarm.model_limits import ModelLimits
from llm_swarm.swarm.record_validator import parse_record
from llm_swarm.swarm.scheduler_record import SCHEDULER_RECORD_VERSION, SchedulerRecord
from llm_swarm.swarm.server_info import ServerInfo

Limits = ModelLimits | int  # an int: only the number of blocks is known
FIRST_READ_PATIENCE = 0.1  # seconds a first read waits for more choice once live servers hold every block


async def _store(
    _dht: DHT, node: DHTNode, keys: list[str], subkey: bytes, value: Any, expiration: float
) -> bool:
    count = len(keys)
    results = await node.store_many(
        keys, [value] * count, expiration_time=[expiration] * count, subkeys=[subkey] * count
    )
    return all(results.values())


def announce(
    dht: DHT, prefix: str, owner: bytes, info: ServerInfo, ttl: float, wait: bool = True, legacy: bool = True
):
    """Store `info` under the server's roster shard for `ttl` seconds, as the entry of `owner` (the
    server's owner subkey: the DHT signs it with the server's key); with `legacy`, also under the
    legacy roster and every block key of its span, where older clients and schedulers look."""
    now = get_dht_time()
    info = info.model_copy(update={"announced_at": now})
    keys = [roster_shard_key(prefix, roster_shard_of(owner))]
    if legacy:
        keys.append(roster_key(prefix))
        if info.has_blocks:
            keys += [block_key(prefix, block) for block in range(info.start, info.end)]
    coroutine = partial(_store, keys=keys, subkey=owner, value=info.to_wire(), expiration=now + ttl)
    return dht.run_coroutine(coroutine, return_future=not wait)


async def _get(
    _dht: DHT, node: DHTNode, keys: list[str], latest: bool = True
) -> dict[str, dict[str, object]]:
    """{key: {owner public key: value}} of the (validated) entries found under `keys`."""
    # latest: search the peers for the newest value instead of stopping at the first one found,
    # which may be this node's own cached copy (a server that moved, a scheduler that restarted);
    # a new node has no copies of its own, and its first read may stop at the first value found
    # (a search for the latest asks every peer near the key: its cost grows with the swarm)
    found = await node.get_many(keys, sufficient_expiration_time=float("inf") if latest else None)
    return {key: owned for key, entry in found.items() if (owned := _owned_entries(entry)) is not None}


def _owned_entries(entry) -> dict[str, object] | None:
    """{owner public key: value} of a found dictionary value (None: nothing, or not a dictionary)."""
    if entry is None or not isinstance(entry.value, dict):
        return None
    owned = {}
    for subkey, item in entry.value.items():
        owner = owner_key(subkey)
        if owner is not None:
            owned[owner] = item.value
    return owned


async def _get_covering(
    _dht: DHT,
    node: DHTNode,
    keys: list[str],
    limits: ModelLimits,
    per_block: int,
    patience: float,
    read_id: str | None,
) -> tuple[dict[str, ServerInfo], bool, set[str]]:
    """A new node's first read: the servers of `_get`'s records (`latest=False`), returned early once
    the live ones found hold every block `per_block` times over, or hold every block at all and
    `patience` seconds passed since; else once every search ended. Also whether every search ended,
    and the peers known live (`_LivePeers`). Searches left running go on in this node; given a
    `read_id`, what they find is kept under it until `_finish_covering` collects it (a second search
    for the same keys would traverse the DHT again until these ended); without one, nothing is kept.

    Why: a key with no value (a shard no server hashes to, the legacy roster once every server is
    new) is found empty only after its search has asked every peer near it, and each is a new
    connection for a new node; and in a large swarm a few shards already name enough live servers.
    Reading every key before routing made a first read grow with the swarm."""
    futures = await node.get_many(keys, sufficient_expiration_time=None, return_futures=True)
    key_of = {future: key for key, future in futures.items()}
    found: dict[str, dict[str, object]] = {}  # every key's entries, for the whole roster
    servers: dict[str, ServerInfo] = {}
    pending, deadline = set(key_of), math.inf
    loop = asyncio.get_running_loop()
    live = _LivePeers(node)
    try:
        while pending:
            timeout = None if deadline == math.inf else max(deadline - loop.time(), 0.0)
            done, _ = await asyncio.wait(
                pending | {live.asking}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
            )
            if not done:
                break  # patience ran out with every block held by a live server
            for future in done & pending:  # each key's records are parsed once, as they arrive
                pending.discard(future)
                owned = _found_entries(future)
                if owned is not None:
                    found[key_of[future]] = owned
                    for peer, info in parse_server_records({key_of[future]: owned}, limits).items():
                        _keep_newest(servers, peer, info)
            if pending:
                alive = live.now()
                holders = _fewest_holders(
                    [info for peer, info in servers.items() if peer in alive and info.routable],
                    limits.num_blocks,
                )
                if holders >= per_block:
                    break
                if holders >= 1 and deadline == math.inf:
                    deadline = loop.time() + patience
        if pending and read_id is not None:
            _UNFINISHED_READS[read_id] = asyncio.ensure_future(_rest_of_read(found, pending, key_of))
        return servers, not pending, live.now()
    finally:
        live.asking.cancel()


# first reads that returned before every search ended (in the DHT process): read id -> the whole roster
_UNFINISHED_READS: dict[str, asyncio.Future] = {}


async def _rest_of_read(
    found: dict[str, dict[str, object]], pending: set[asyncio.Future], key_of: dict[asyncio.Future, str]
) -> dict[str, dict[str, object]]:
    await asyncio.wait(pending)
    for future in pending:
        owned = _found_entries(future)
        if owned is not None:
            found[key_of[future]] = owned
    return found


async def _finish_covering(
    _dht: DHT, node: DHTNode, read_id: str, keys: list[str]
) -> dict[str, dict[str, object]]:
    """The whole roster of the first read `read_id`, once its searches ended (a new search if there is
    no such read: it never returned early, or its rest was collected already)."""
    rest = _UNFINISHED_READS.pop(read_id, None)
    if rest is None:
        return await _get(_dht, node, keys, latest=False)
    return await rest


def _found_entries(search: asyncio.Future) -> dict[str, object] | None:
    """`_owned_entries` of a finished search (None if it failed or was cancelled)."""
    if search.cancelled() or search.exception() is not None:
        return None
    return _owned_entries(search.result())


class _LivePeers:
    """Peers a DHT node knows to be alive: those that answered its requests (`_answered`: a search asks
    the live servers near each key, while a record of a peer that is gone names nobody who answers),
    and those its p2p daemon is connected to (its Kademlia table fills with live peers in its first
    second). The daemon is asked in the background: a new one, busy connecting, takes 0.1-0.25 s to
    list its connections in a swarm of 30."""

    def __init__(self, node: DHTNode):
        self.node = node
        self.connected: set[str] = set()
        self.asking = asyncio.ensure_future(node.p2p.list_peers())

    def now(self) -> set[str]:
        if self.asking.done():
            if not self.asking.cancelled() and self.asking.exception() is None:
                self.connected = {info.peer_id.to_base58() for info in self.asking.result()}
            self.asking = asyncio.ensure_future(self.node.p2p.list_peers())
        return _answered(self.node) | self.connected


def _answered(node: DHTNode) -> set[str]:
    """Peers that answered this node's DHT requests (its routing table holds only those)."""
    return {peer.to_base58() for peer in node.protocol.routing_table.peer_id_to_uid}


async def _get_answered(_dht: DHT, node: DHTNode) -> set[str]:
    return _answered(node)


async def answered_peers_async(dht: DHT) -> set[str]:
    """Peers that answered `dht`'s requests (alive, as far as it knows)."""
    return await dht.run_coroutine(_get_answered, return_future=True)


def _keep_newest(servers: dict[str, ServerInfo], peer_id: str, info: ServerInfo) -> None:
    """One record per peer: a server is in its shard and, while it writes legacy records, in the legacy
    roster too; a server that moved has older records left until they expire."""
    known = servers.get(peer_id)
    if known is None or info.announced_at > known.announced_at:
        servers[peer_id] = info


def _fewest_holders(servers: list[ServerInfo], num_blocks: int) -> int:
    """How many of `servers` hold the least held block."""
    holders = [0] * num_blocks
    for info in servers:
        for block in range(info.start, info.end):
            holders[block] += 1
    return min(holders, default=0)


def fetch_servers(dht: DHT, prefix: str, limits: Limits) -> dict[str, ServerInfo]:
    """Every valid record of a server with blocks, by peer id (base58); invalid records are skipped."""
    records = dht.run_coroutine(partial(_get, keys=roster_keys(prefix)))
    return parse_server_records(records, _limits(limits))


async def fetch_servers_async(
    dht: DHT, prefix: str, limits: Limits, latest: bool = True
) -> dict[str, ServerInfo]:
    """`fetch_servers` for async callers; `latest=False` only for a node's first read (see `_get`)."""
    future = dht.run_coroutine(partial(_get, keys=roster_keys(prefix), latest=latest), return_future=True)
    return parse_server_records(await future, _limits(limits))


async def fetch_servers_covering(
    dht: DHT,
    prefix: str,
    limits: Limits,
    per_block: int,
    patience: float = FIRST_READ_PATIENCE,
    read_id: str | None = None,
) -> tuple[dict[str, ServerInfo], bool, set[str]]:
    """A new node's first read (see `_get_covering`): the servers found by the time enough live ones
    hold every block, whether that was the whole roster, and the peers known live by then. If it was
    not and `read_id` is given, `finish_covering_read(dht, prefix, limits, read_id)` returns the whole
    roster once the read's searches ended (without searching again)."""
    limits = _limits(limits)
    coroutine = partial(
        _get_covering,
        keys=roster_keys(prefix),
        limits=limits,
        per_block=per_block,
        patience=patience,
        read_id=read_id,
    )
    return await dht.run_coroutine(coroutine, return_future=True)


async def finish_covering_read(dht: DHT, prefix: str, limits: Limits, read_id: str) -> dict[str, ServerInfo]:
    """Every server of the first read `read_id` that returned early (see `fetch_servers_covering`)."""
    coroutine = partial(_finish_covering, read_id=read_id, keys=roster_keys(prefix))
    return parse_server_records(await dht.run_coroutine(coroutine, return_future=True), _limits(limits))


async def fetch_roster_async(dht: DHT, prefix: str, limits: Limits) -> dict[str, ServerInfo]:
    """Every server of the model (with or without blocks), newest record per peer."""
    future = dht.run_coroutine(partial(_get, keys=roster_keys(prefix)), return_future=True)
    return parse_server_records(await future, _limits(limits), require_blocks=False)


class RosterReader:
    """The roster, read incrementally: each `read()` fetches only the keys that are due, so that every
    key is re-read at least every `full_pass` seconds while one call costs a slice of the swarm
    (the scheduler refreshes twice a second; a full read of 1,000 records each time would not scale).
    Records of keys not re-read this time are those of the last read, expired ones dropped."""

    def __init__(self, dht: DHT, prefix: str, limits: Limits, full_pass: float, refresh: float):
        self.dht, self.limits = dht, _limits(limits)
        self.keys = roster_keys(prefix)
        self.per_read = min(max(1, math.ceil(len(self.keys) * refresh / full_pass)), len(self.keys))
        self._next = 0
        self._values: dict[str, dict[str, object]] = {}

    async def read(self) -> dict[str, ServerInfo]:
        """Every server (blocks or not), newest record per peer, after reading the keys due."""
        due = [self.keys[(self._next + i) % len(self.keys)] for i in range(self.per_read)]
        self._next = (self._next + self.per_read) % len(self.keys)
        found = await self.dht.run_coroutine(partial(_get, keys=due), return_future=True)
        for key in due:
            self._values[key] = found.get(key, {})
        return parse_server_records(self._values, self.limits, require_blocks=False)


def _limits(limits: Limits) -> ModelLimits:
    return limits if isinstance(limits, ModelLimits) else ModelLimits(num_blocks=limits)


def parse_server_records(
    records: dict[str, dict[str, object]], limits: ModelLimits, require_blocks: bool = True
) -> dict[str, ServerInfo]:
    """One record per peer: the newest valid one (a server is in its shard and, while it writes
    legacy records, in the legacy roster too). A record counts only if it is valid for this model."""
    now = get_dht_time()
    servers: dict[str, ServerInfo] = {}
    for per_owner in records.values():
        for owner, value in per_owner.items():
            info = parse_record(value, now)
            peer_id = peer_id_of_key(owner)
            if not isinstance(info, ServerInfo) or peer_id is None or limits.problem(info) is not None:
                continue
            if require_blocks and not info.has_blocks:
                continue
            _keep_newest(servers, peer_id, info)
    return servers


# --- the scheduler's record ---------------------------------------------------------------------


def publish_scheduler(
    dht: DHT, prefix: str, owner: bytes, record: dict[str, Any], ttl: float, wait: bool = True
):
    """Store the scheduler's address and placement under the scheduler key, as `owner`'s entry."""
    value = SchedulerRecord.model_validate({"schema_version": SCHEDULER_RECORD_VERSION, **record}).to_wire()
    coroutine = partial(
        _store, keys=[scheduler_key(prefix)], subkey=owner, value=value, expiration=get_dht_time() + ttl
    )
    return dht.run_coroutine(coroutine, return_future=not wait)


async def fetch_scheduler_async(dht: DHT, prefix: str, trusted_key: str) -> SchedulerRecord | None:
    """The record of the scheduler signed by `trusted_key`, or None if it announces none (valid).

    Schedulers signed by any other key are ignored: anyone can run one and announce it."""
    future = dht.run_coroutine(partial(_get, keys=[scheduler_key(prefix)]), return_future=True)
    value = (await future).get(scheduler_key(prefix), {}).get(trusted_key.strip())
    record = parse_record(value, get_dht_time())
    return record if isinstance(record, SchedulerRecord) else None
