"""Stand-in server records: correctly signed records of peers that do not serve, from one DHT node.

A large swarm cannot run on one small machine, but what it costs a client to *read and route* it
can be measured: this module announces N plausible server records, each under its own key (so
each is a distinct, validly signed server to every reader), from a single DHT peer. No daemon
answers for those peers: they are exactly the dead records a real swarm accumulates (servers that
crashed, records that outlive them). Used by `benchmarks/serving/scale.py` and the scale tests.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from functools import partial

from hivemind.dht import DHT, DHTNode
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.validation import DHTRecord
from hivemind.utils.crypto import RSAPrivateKey
from hivemind.utils.timed_storage import get_dht_time
from tqdm import tqdm

from llm_swarm.swarm.dht_keys import block_key, roster_key, roster_shard_key, roster_shard_of
from llm_swarm.swarm.dht_process import SwarmDHT
from llm_swarm.swarm.identity import owner_subkey, peer_id_of_key, public_key_text
from llm_swarm.swarm.record_validator import MAX_RECORD_TTL, SignatureValidator, SwarmRecordValidator
from llm_swarm.swarm.server_info import Reachability, ServerInfo, ServerState

_OWNER_RE = re.compile(rb"\[owner:(.+?)\]")


class StandInSigner(SignatureValidator):
    """Signs each record with the key of the owner its subkey names (many servers from one node);
    verifies like every node of ours."""

    def __init__(self, keys: Iterable[RSAPrivateKey]):
        super().__init__(None)
        self._signers: dict[bytes, RSASignatureValidator] = {}
        for key in keys:
            signer = RSASignatureValidator(key)
            self._signers[signer._local_public_key] = signer

    def sign_value(self, record: DHTRecord) -> bytes:
        for match in _OWNER_RE.finditer(record.subkey or b""):
            signer = self._signers.get(match.group(0))
            if signer is not None:
                return signer.sign_value(record)
        return record.value


def new_keys(count: int, progress: bool = False) -> list[RSAPrivateKey]:
    """`count` fresh identities (about 50 ms each: RSA-2048 key generation)."""
    return [RSAPrivateKey() for _ in tqdm(range(count), desc="stand-in keys", disable=not progress)]


def peer_id(key: RSAPrivateKey) -> str:
    return peer_id_of_key(public_key_text(key))


def standin_info(
    start: int, end: int, tau: float, reachability: Reachability = Reachability.DIRECT, **fields
) -> ServerInfo:
    """A plausible ONLINE server record for blocks `[start, end)` announcing decode time `tau`."""
    values = dict(
        state=ServerState.ONLINE, start=start, end=end, public_name="stand-in", memory_bytes=10**9,
        block_bytes=150_000, cache_token_bytes=256, cache_bytes_left=10**8, cache_slots_left=100,
        slot_tokens=2048, max_length=2048, tau=tau, tau_prefill=tau * 4, prefill_tokens=20,
        throughput=1 / (tau * (end - start)), reachability=reachability,
    )  # fmt: skip
    values.update(fields)
    return ServerInfo(**values)


def start_standin_dht(initial_peers: list[str], keys: list[RSAPrivateKey]) -> DHT:
    """A client-mode DHT peer that can sign records for every key in `keys`."""
    return SwarmDHT(
        initial_peers=initial_peers,
        client_mode=True,
        start=True,
        record_validators=[StandInSigner(keys), SwarmRecordValidator()],
    )


async def _store_each(_dht: DHT, node: DHTNode, keys, values, subkeys, expiration: float) -> int:
    results = await node.store_many(keys, values, expiration_time=[expiration] * len(keys), subkeys=subkeys)
    return sum(bool(ok) for ok in results.values())


def publish_standins(
    dht: DHT,
    prefix: str,
    records: list[tuple[RSAPrivateKey, ServerInfo]],
    ttl: float = MAX_RECORD_TTL,
    legacy: bool = False,
    batch: int = 20,  # hivemind passes each call to its DHT process through a pipe: keep it small
) -> int:
    """Announce every (key, record) as its own server, like `swarm.dht_records.announce` would;
    returns how many stores succeeded."""
    now = get_dht_time()
    stored = 0
    for first in range(0, len(records), batch):
        keys, values, subkeys = [], [], []
        for key, info in records[first : first + batch]:
            owner = owner_subkey(public_key_text(key))
            value = info.model_copy(update={"announced_at": now}).to_wire()
            targets = [roster_shard_key(prefix, roster_shard_of(owner))]
            if legacy:
                targets.append(roster_key(prefix))
                targets += [block_key(prefix, block) for block in range(info.start, info.end)]
            keys += targets
            values += [value] * len(targets)
            subkeys += [owner] * len(targets)
        stored += dht.run_coroutine(
            partial(_store_each, keys=keys, values=values, subkeys=subkeys, expiration=now + ttl)
        )
    return stored
