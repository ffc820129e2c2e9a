"""How every process of ours joins the DHT: identity, record validators and (closed swarms) authorizer.

Servers and schedulers write records, so they run with an identity (`swarm.identity`): the p2p
daemon's key is the key that signs their records. Clients and monitors only read, with the same
validators. Keeping this in one place means no node of ours ever runs without validation.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

from hivemind.utils.crypto import RSAPrivateKey

from swarm.closed_swarm import SwarmSecret
from swarm.identity import load_identity, owner_subkey, public_key_text, temporary_identity_path
from swarm.record_validator import swarm_validators


@dataclass(frozen=True)
class PeerIdentity:
    private_key: RSAPrivateKey
    path: str
    created: bool  # a fresh key nobody can hold yet (hivemind need not check that it is free)

    @property
    def public_key(self) -> str:
        return public_key_text(self.private_key)

    @property
    def owner(self) -> bytes:
        """The DHT subkey of this peer's records."""
        return owner_subkey(self.public_key)


def open_identity(path: str | None) -> PeerIdentity:
    """The identity in `path` (created if missing), or a fresh one for this run if `path` is None."""
    target = path if path is not None else temporary_identity_path()
    created = not Path(target).exists()
    return PeerIdentity(load_identity(target), target, created)


def forget_identity(identity: PeerIdentity) -> None:
    """Delete a per-run identity (made by `open_identity(None)`) and its private directory."""
    path = Path(identity.path)
    path.unlink(missing_ok=True)
    with contextlib.suppress(OSError):
        path.parent.rmdir()


def dht_options(identity: PeerIdentity | None, secret: SwarmSecret | None) -> dict:
    """Keyword arguments for `hivemind.DHT` that make it one of our nodes."""
    options: dict = {"record_validators": swarm_validators(identity.private_key if identity else None)}
    if identity is not None:
        options["identity_path"] = identity.path
        if identity.created:
            options["check_if_identity_free"] = False
    if secret is not None:
        options["authorizer"] = secret.authorizer()
    return options
