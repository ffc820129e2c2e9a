"""What every DHT node of ours accepts, checked without a network: signatures bound to
peer identities, envelope and schema bounds, model limits, closed-swarm proofs, scheduler replies."""

from __future__ import annotations

import dataclasses

import pytest
from hivemind.dht.validation import CompositeValidator, DHTRecord
from hivemind.p2p import PeerID
from hivemind.utils.crypto import RSAPrivateKey
from hivemind.utils.serializer import MSGPackSerializer
from hivemind.utils.timed_storage import get_dht_time

from llm_swarm.client.routing import chain_problem
from llm_swarm.swarm.closed_swarm import SwarmSecret
from llm_swarm.swarm.identity import (
    load_identity,
    owner_subkey,
    peer_id_of_key,
    peer_id_of_subkey,
    public_key_text,
    read_public_key,
)
from llm_swarm.swarm.model_limits import ModelLimits
from llm_swarm.swarm.models.checkpoint import load_config
from llm_swarm.swarm.record_validator import MAX_RECORD_TTL, parse_record, swarm_validators
from llm_swarm.swarm.route_request import RouteHop
from llm_swarm.swarm.server_info import ServerInfo, ServerState


def server_record(**overrides) -> dict:
    value = dict(
        schema_version=1,
        state="online",
        start=0,
        end=6,
        announced_at=get_dht_time(),
        memory_bytes=10**9,
        block_bytes=147968,
        cache_token_bytes=256,
        cache_bytes_left=10**8,
        cache_slots_left=100,
        slot_tokens=2048,
        max_length=2048,
        tau=1e-4,
    )
    value.update(overrides)
    return value


@pytest.fixture(scope="module")
def key() -> RSAPrivateKey:
    return RSAPrivateKey()


@pytest.fixture(scope="module")
def validator(key) -> CompositeValidator:
    return CompositeValidator(swarm_validators(key))


def signed(
    validator: CompositeValidator, key: RSAPrivateKey, value, subkey=None, expiration=None
) -> DHTRecord:
    """A record as our DHT would store it: serialized, under `subkey` (default: the owner), signed."""
    subkey = owner_subkey(public_key_text(key)) if subkey is None else subkey
    record = DHTRecord(
        key=b"some-key-id",
        subkey=MSGPackSerializer.dumps(subkey),
        value=MSGPackSerializer.dumps(value),
        expiration_time=get_dht_time() + 30 if expiration is None else expiration,
    )
    return dataclasses.replace(record, value=validator.sign_value(record))


def test_the_peer_id_is_the_hash_of_the_key_that_signs(tmp_path):
    path = tmp_path / "identity.key"
    key = load_identity(path)
    assert load_identity(path).get_public_key().to_bytes() == key.get_public_key().to_bytes()
    expected = PeerID.from_identity(path.read_bytes()).to_base58()
    assert peer_id_of_key(public_key_text(key)) == expected
    assert peer_id_of_subkey(owner_subkey(public_key_text(key))) == expected
    assert peer_id_of_subkey(expected) is None  # a peer id is not an owner marker
    assert peer_id_of_key("ssh-rsa garbage") is None
    (tmp_path / "key.pub").write_text(public_key_text(key) + "\n")
    assert read_public_key(str(tmp_path / "key.pub")) == public_key_text(key)


def test_honest_records_pass_and_forgeries_fail(validator, key):
    assert validator.validate(signed(validator, key, server_record()))
    assert validator.validate(signed(validator, key, {"schema_version": 1, "address": "10.0.0.1:50051"}))
    other = RSAPrivateKey()
    forged = signed(CompositeValidator(swarm_validators(other)), other, server_record())
    # someone else's subkey: the signature is not its owner's
    stolen = dataclasses.replace(forged, subkey=MSGPackSerializer.dumps(owner_subkey(public_key_text(key))))
    assert not validator.validate(stolen)
    # a signed record whose value was changed afterwards (e.g. announced_at pushed ahead)
    honest = signed(validator, key, server_record())
    tampered = honest.value.replace(b"online", b"offlin")
    assert not validator.validate(dataclasses.replace(honest, value=tampered))


@pytest.mark.parametrize(
    "subkey",
    [None, "QmSomePeerIdInBase58", b"[owner:not a key]", b""],
    ids=["plain value", "peer id subkey", "bad owner", "empty"],
)
def test_only_owned_entries_are_stored(validator, key, subkey):
    record = signed(validator, key, server_record())
    assert not validator.validate(dataclasses.replace(record, subkey=MSGPackSerializer.dumps(subkey)))


@pytest.mark.parametrize(
    "overrides",
    [
        {"tau": 0.0},
        {"tau": float("inf")},
        {"tau": float("nan")},
        {"memory_bytes": 2**62},
        {"block_bytes": 2**62},
        {"cache_bytes_left": 2 * 10**9},  # more than its memory
        {"end": 1 << 20},
        {"announced_at": 1e11},  # far in the future
        {"state": "hacked"},
        {"throughput": float("inf")},
        {"public_name": "x" * 1000},
        {"prefill_chunk": -1},
        {"prefill_chunk": 1 << 40},
        {"prefill_chunk": float("nan")},
        {"tau_per_session": -0.001},
        {"tau_per_session": float("nan")},
        {"tau_per_session": 1e9},
        {"next_rtts": {"x": 0.0}},
        {"next_rtts": {"x": float("nan")}},
        {"next_rtts": {"x": 1e6}},
        {"next_rtts": {f"peer{k}": 0.01 for k in range(17)}},
        {"next_rtts": {"x" * 200: 0.01}},
        {"direct_address": "10.0.0.1"},  # no port
        {"direct_address": "10.0.0.1:123456"},
        {"direct_address": "evil host:80"},
        {"direct_address": "a" * 70 + ":80"},
    ],
    ids=str,
)
def test_absurd_server_records_fail(validator, key, overrides):
    assert not validator.validate(signed(validator, key, server_record(**overrides)))


def test_expirations_and_sizes_are_bounded(validator, key):
    assert not validator.validate(
        signed(validator, key, server_record(), expiration=get_dht_time() + MAX_RECORD_TTL + 60)
    )
    assert not validator.validate(signed(validator, key, server_record(version="v" * 20_000)))
    assert not validator.validate(signed(validator, key, "just a string"))
    huge_placement = {f"Qm{i:044d}": [0, 1] for i in range(100_001)}
    assert not validator.validate(
        signed(validator, key, {"schema_version": 1, "address": "a:1", "placement": huge_placement})
    )
    assert not validator.validate(signed(validator, key, {"schema_version": 1, "address": "no port"}))


def test_model_limits_come_from_the_local_config(llama_dir):
    limits = ModelLimits.from_config(load_config(llama_dir))
    honest = ServerInfo.model_validate(server_record())
    assert limits.problem(honest) is None
    assert "outside the model" in limits.problem(honest.model_copy(update={"end": 7}))
    assert "impossible" in limits.problem(honest.model_copy(update={"block_bytes": 10**12}))
    assert "key/value width" in limits.problem(honest.model_copy(update={"cache_token_bytes": 100}))
    now = get_dht_time()
    assert parse_record(server_record(announced_at=now + 3600), now) is None


def test_swarm_secret_proofs_are_bound_to_peers_and_time():
    secret = SwarmSecret(b"0123456789abcdef0123")
    proof = secret.session_proof("client", "server")
    assert secret.check_session_proof(proof, "client", "server")
    assert not secret.check_session_proof(proof, "someone else", "server")
    assert not SwarmSecret(b"another secret, 16+ bytes").check_session_proof(proof, "client", "server")
    timed = secret.timed_proof("scheduler")
    assert secret.check_timed_proof(timed, "scheduler") and not secret.check_timed_proof(timed, "other")
    stamp, _, mac = timed.partition(":")
    assert not secret.check_timed_proof(f"{float(stamp) - 3600}:{mac}", "scheduler")
    assert not secret.check_timed_proof("garbage", "scheduler")


def test_scheduler_chains_are_checked_against_validated_records():
    def info(start: int, end: int, state=ServerState.ONLINE) -> ServerInfo:
        return ServerInfo.model_validate(server_record(start=start, end=end, state=str(state)))

    servers = {"a": info(0, 3), "b": info(3, 6), "c": info(0, 6, ServerState.JOINING)}
    good = [RouteHop("a", 0, 3), RouteHop("b", 3, 6)]
    assert chain_problem(good, servers, 6) is None
    assert "empty" in chain_problem([], servers, 6)
    assert "ends at block 3" in chain_problem(good[:1], servers, 6)
    assert "holds 0:3" in chain_problem([RouteHop("a", 0, 6)], servers, 6)
    assert "not an online server" in chain_problem([RouteHop("c", 0, 6)], servers, 6)
    assert "not an online server" in chain_problem([RouteHop("x", 0, 6)], servers, 6)
    assert "continue" in chain_problem([RouteHop("a", 0, 3), RouteHop("b", 4, 6)], servers, 6)
