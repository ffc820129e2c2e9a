"""Which DHT records every node of ours accepts, on store and on read (hivemind's validator mechanism).

Two validators run in each of our DHT nodes (`swarm-dht`, servers, schedulers, clients):
- hivemind's `RSASignatureValidator`: a record whose subkey names an owner's public key must be
  signed by that owner, so nobody can write under someone else's subkey;
- `SwarmRecordValidator` (below): every record must be such an owned dictionary entry (no plain
  values, which would replace a whole dictionary; no unsigned subkeys), expire no further ahead
  than an announcement's TTL allows, be small, and hold a well-formed server or scheduler record
  with finite, bounded numbers and an `announced_at` that is not in the future.

It needs no model facts, so a bootstrap `swarm-dht` that knows no model enforces it too; what
depends on the model (spans inside it, plausible sizes) is checked by readers (`swarm.model_limits`).
hivemind drops a whole dictionary a peer returns if one entry fails, and merges the dictionaries
of the peers that pass, so a hostile node can hide nothing it does not hold itself.
"""

from __future__ import annotations

from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils.crypto import RSAPrivateKey
from hivemind.utils.serializer import MSGPackSerializer
from hivemind.utils.timed_storage import get_dht_time

from llm_swarm.swarm.identity import owner_key
from llm_swarm.swarm.scheduler_record import SchedulerRecord
from llm_swarm.swarm.server_info import ServerInfo

MAX_RECORD_TTL = 300.0  # seconds: servers announce with 2 * period + 1 (period <= 120), schedulers 20
CLOCK_SKEW = 30.0  # seconds peers' clocks may disagree by
MAX_SERVER_RECORD_BYTES = 16 * 1024
MAX_SCHEDULER_RECORD_BYTES = 8 * 1024 * 1024  # the placement of 100k servers


def parse_record(value: object, now: float) -> ServerInfo | SchedulerRecord | None:
    """A server or scheduler record as stored in the DHT, or None if it is not a valid one."""
    if not isinstance(value, dict):
        return None
    if "state" in value:
        info = ServerInfo.from_wire(value)
        if info is None or info.announced_at > now + CLOCK_SKEW:
            return None
        return info
    return SchedulerRecord.from_wire(value)


class SwarmRecordValidator(RecordValidatorBase):
    """Accepts only owned, signed, bounded swarm records (see the module docstring)."""

    def validate(self, record: DHTRecord) -> bool:
        try:
            subkey = MSGPackSerializer.loads(record.subkey)
        except Exception:  # msgpack raises several unrelated types on garbage
            return False
        if owner_key(subkey) is None:
            return False  # a plain value, or a subkey nobody signs for
        now = get_dht_time()
        if record.expiration_time > now + MAX_RECORD_TTL + CLOCK_SKEW:
            return False
        if len(record.value) > MAX_SCHEDULER_RECORD_BYTES:
            return False
        try:
            value = MSGPackSerializer.loads(record.value)
        except Exception:
            return False
        parsed = parse_record(value, now)
        if isinstance(parsed, ServerInfo):
            return len(record.value) <= MAX_SERVER_RECORD_BYTES
        return parsed is not None

    @property
    def priority(self) -> int:
        return 0  # after the signature validator, which strips the signature for us

    def merge_with(self, other: RecordValidatorBase) -> bool:
        return isinstance(other, SwarmRecordValidator)


class SignatureValidator(RSASignatureValidator):
    """hivemind's signature check, except that a malformed owner key is an invalid record: hivemind's
    raises on it, which fails the whole request it came in (every other record of it too). Without a
    private key it only verifies: readers sign nothing, so they need not spend a key generation."""

    def __init__(self, private_key: RSAPrivateKey | None = None):
        if private_key is not None:
            super().__init__(private_key)
        else:
            self._private_key = None
            self._local_public_key = b"\0no local key\0"  # matches no subkey: nothing gets signed

    def validate(self, record: DHTRecord) -> bool:
        try:
            return super().validate(record)
        except Exception:  # cryptography raises several types on garbage keys and signatures
            return False


def swarm_validators(private_key: RSAPrivateKey | None = None) -> list[RecordValidatorBase]:
    """The validators of a DHT node of ours; `private_key` signs what it stores (readers need none)."""
    return [SignatureValidator(private_key), SwarmRecordValidator()]
