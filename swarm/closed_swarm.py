"""Closed swarms: only holders of a shared secret join the DHT, announce, discover or open sessions.

The default swarm is open. With a secret (`--swarm-secret FILE` on every command, or
`ClientOptions.swarm_secret`) two checks keep everyone else out:
- the DHT: hivemind's authorizer mechanism (`AuthorizerBase`) signs every DHT request and response
  with an HMAC of the secret, with a timestamp and a nonce against replays; a node of ours ignores
  requests and responses that do not carry one, so a peer without the secret can neither store
  nor find records, and cannot even bootstrap;
- our RPCs: a client proves to each server that it holds the secret with an HMAC over both peer ids
  (libp2p authenticates them, so the proof is worthless to anyone else), and to the scheduler with
  a timed HMAC in the gRPC metadata; without it they answer with a clear refusal.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from pathlib import Path

from hivemind.utils.auth import AuthorizedRequestBase, AuthorizedResponseBase, AuthorizerBase
from hivemind.utils.crypto import RSAPublicKey
from hivemind.utils.timed_storage import TimedStorage, get_dht_time

from llm_swarm.swarm.errors import SwarmUserError

MIN_SECRET_BYTES = 16
MAX_CLOCK_DIFFERENCE = 120.0  # seconds a signed request may be old (or early: clock skew)
PROOF_METADATA_KEY = "x-swarm-proof"  # gRPC metadata the scheduler checks


class SwarmSecret:
    def __init__(self, secret: bytes):
        if len(secret) < MIN_SECRET_BYTES:
            raise SwarmUserError(f"a swarm secret must hold at least {MIN_SECRET_BYTES} bytes")
        self._key = hashlib.sha256(b"llm-swarm closed swarm v1\0" + secret).digest()

    @classmethod
    def from_file(cls, path: str | Path) -> SwarmSecret:
        try:
            return cls(Path(path).read_bytes().strip())
        except OSError as error:
            raise SwarmUserError(f"cannot read the swarm secret file {path}: {error}") from None

    @staticmethod
    def generate(path: str | Path) -> None:
        """Write a new random secret (for `swarm-dht --new-swarm-secret`)."""
        Path(path).write_text(secrets.token_hex(32) + "\n")
        Path(path).chmod(0o600)

    def _mac(self, *parts: str | bytes) -> str:
        message = b"\0".join(part.encode() if isinstance(part, str) else part for part in parts)
        return hmac.new(self._key, message, hashlib.sha256).hexdigest()

    # --- our RPCs -----------------------------------------------------------------------------------
    def session_proof(self, client_peer: str, server_peer: str) -> str:
        return self._mac("session", client_peer, server_peer)

    def check_session_proof(self, proof: str, client_peer: str, server_peer: str) -> bool:
        return hmac.compare_digest(proof, self.session_proof(client_peer, server_peer))

    def timed_proof(self, purpose: str) -> str:
        stamp = f"{time.time():.3f}"
        return f"{stamp}:{self._mac(purpose, stamp)}"

    def check_timed_proof(self, proof: str, purpose: str) -> bool:
        stamp, _, mac = proof.partition(":")
        try:
            age = abs(time.time() - float(stamp))
        except ValueError:
            return False
        return age <= MAX_CLOCK_DIFFERENCE and hmac.compare_digest(mac, self._mac(purpose, stamp))

    def scheduler_metadata(self) -> tuple[tuple[str, str], ...]:
        """The gRPC metadata that proves the secret to the scheduler (`scheduler.service.auth`)."""
        return ((PROOF_METADATA_KEY, self.timed_proof("scheduler")),)

    def authorizer(self) -> SecretAuthorizer:
        return SecretAuthorizer(self)


class SecretAuthorizer(AuthorizerBase):
    """hivemind's DHT authorizer for a closed swarm: requests and responses carry an HMAC of the
    secret over their bytes; requests also a time and a nonce, so a recorded one cannot be replayed."""

    def __init__(self, secret: SwarmSecret):
        self._secret = secret
        self._recent_nonces = TimedStorage()

    async def sign_request(
        self, request: AuthorizedRequestBase, service_public_key: RSAPublicKey | None
    ) -> None:
        auth = request.auth
        auth.time = get_dht_time()
        auth.nonce = secrets.token_bytes(16)
        auth.signature = b""
        auth.signature = self._secret._mac("request", request.SerializeToString()).encode()

    async def validate_request(self, request: AuthorizedRequestBase) -> bool:
        auth = request.auth
        signature, auth.signature = auth.signature, b""
        expected = self._secret._mac("request", request.SerializeToString()).encode()
        if not hmac.compare_digest(signature, expected):
            return False
        now = get_dht_time()
        if abs(auth.time - now) > MAX_CLOCK_DIFFERENCE:
            return False
        with self._recent_nonces.freeze():
            if auth.nonce in self._recent_nonces:
                return False
        self._recent_nonces.store(auth.nonce, None, now + 3 * MAX_CLOCK_DIFFERENCE)
        return True

    async def sign_response(self, response: AuthorizedResponseBase, request: AuthorizedRequestBase) -> None:
        auth = response.auth
        auth.nonce = request.auth.nonce
        auth.signature = b""
        auth.signature = self._secret._mac("response", response.SerializeToString()).encode()

    async def validate_response(
        self, response: AuthorizedResponseBase, request: AuthorizedRequestBase
    ) -> bool:
        auth = response.auth
        signature, auth.signature = auth.signature, b""
        expected = self._secret._mac("response", response.SerializeToString()).encode()
        return hmac.compare_digest(signature, expected) and auth.nonce == request.auth.nonce
