"""A peer's identity: one RSA key that is both its libp2p peer id and the key that signs its records.

hivemind signs DHT records with an RSA key (`RSASignatureValidator`: the subkey names the owner's
public key, and only its private key can write under it) and names peers by their libp2p identity.
They are two different keys unless we make them one: every process of ours that writes records
loads (or creates) an identity file in hivemind's format, hands the file to its p2p daemon and
the same key to the signature validator. The peer id is then a hash of the public key in the
subkey, so a reader derives the peer id from the subkey itself and no record can claim someone
else's peer id.
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
import tempfile
from pathlib import Path

import multihash
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.p2p import P2P, PeerID
from hivemind.proto import crypto_pb2
from hivemind.utils.crypto import RSAPrivateKey

from llm_swarm.swarm.errors import SwarmUserError

_OWNER = re.compile(rb"^\[owner:(ssh-rsa [A-Za-z0-9+/=]{100,1200})\]$")


def load_identity(path: str | Path) -> RSAPrivateKey:
    """The RSA key of an identity file (hivemind's format); the file is created if it does not exist."""
    path = Path(path)
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        P2P.generate_identity(str(path))
    try:
        protobuf = crypto_pb2.PrivateKey.FromString(path.read_bytes())
        if protobuf.key_type != crypto_pb2.KeyType.RSA:
            raise ValueError("not an RSA key")
        key = serialization.load_der_private_key(protobuf.data, password=None)
        if not isinstance(key, rsa.RSAPrivateKey):
            raise ValueError("not an RSA key")
    except (OSError, ValueError) as error:
        raise SwarmUserError(f"identity file {path} is not a hivemind RSA identity: {error}") from None
    private_key = RSAPrivateKey.__new__(RSAPrivateKey)
    # hivemind's key class is built from DER through its pickling state (it has no other constructor)
    private_key.__setstate__({"_private_key": protobuf.data})
    return private_key


def temporary_identity_path() -> str:
    """A path for a fresh identity in a private directory (for processes run without --identity-path)."""
    directory = tempfile.mkdtemp(prefix="llm-swarm-id-")
    os.chmod(directory, 0o700)
    return os.path.join(directory, "identity.key")


def public_key_text(private_key: RSAPrivateKey) -> str:
    """The public key as one line of OpenSSH text ("ssh-rsa AAAA..."): what operators hand around."""
    return private_key.get_public_key().to_bytes().decode()


def owner_subkey(public_key: str | bytes) -> bytes:
    """The DHT subkey under which only the holder of this key can write (hivemind's owner marker)."""
    raw = public_key.encode() if isinstance(public_key, str) else public_key
    return RSASignatureValidator.PUBLIC_KEY_FORMAT.replace(b"_key_", raw.strip())


def owner_key(subkey: object) -> str | None:
    """The public key an owner subkey names, or None if `subkey` is not exactly one owner marker."""
    if not isinstance(subkey, bytes):
        return None
    match = _OWNER.match(subkey)
    return match.group(1).decode() if match else None


@functools.lru_cache(maxsize=4096)
def peer_id_of_key(public_key: str) -> str | None:
    """The base58 libp2p peer id of an RSA public key (libp2p's peer id spec), or None if malformed."""
    try:
        key = serialization.load_ssh_public_key(public_key.encode())
    except (ValueError, TypeError):
        return None
    if not isinstance(key, rsa.RSAPublicKey) or not 2048 <= key.key_size <= 8192:
        return None
    der = key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    encoded = crypto_pb2.PublicKey(key_type=crypto_pb2.RSA, data=der).SerializeToString()
    digest = multihash.encode(hashlib.sha256(encoded).digest(), multihash.coerce_code("sha2-256"))
    return PeerID(digest).to_base58()


def peer_id_of_subkey(subkey: object) -> str | None:
    key = owner_key(subkey)
    return peer_id_of_key(key) if key is not None else None


def read_public_key(value: str) -> str:
    """A public key given on a command line: the key text itself, or a file holding it."""
    text = value.strip()
    if not text.startswith("ssh-rsa "):
        try:
            text = Path(value).read_text().strip()
        except OSError as error:
            raise SwarmUserError(
                f"{value!r} is neither an ssh-rsa public key nor a readable file: {error}"
            ) from None
    if peer_id_of_key(text) is None:
        raise SwarmUserError(f"{value!r} does not hold a valid RSA public key (ssh-rsa ..., 2048+ bits)")
    return text


def ensure_key_files(identity_path: str | Path, public_key_path: str | Path) -> str:
    """An identity file and its public key beside it (created if missing); returns the public key.
    What a script that starts a scheduler hands the servers and clients it also starts."""
    key = public_key_text(load_identity(identity_path))
    Path(public_key_path).write_text(key + "\n")
    return key
