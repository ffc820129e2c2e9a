"""TLS for direct streams, keyed by the peers' libp2p identities instead of a certificate authority.

A server's certificate is self-signed by its identity key, so the key in the certificate is the key
its peer id is the hash of: a client that dialed the address a server announced checks, after the
TLS handshake, that the certificate's key hashes to the peer id it meant to reach
(`certificate_peer_id`). Nobody else holds that key, so nobody else can finish the handshake as that
server, and what follows is encrypted and authenticated by TLS 1.3. The client proves its own id
inside the channel (`swarm.direct_hello`).
"""

from __future__ import annotations

import datetime
import os
import ssl
import tempfile

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.x509.oid import NameOID
from hivemind.utils.crypto import RSAPrivateKey

from llm_swarm.swarm.identity import peer_id_of_key

CERTIFICATE_DAYS = 3650  # nobody checks the dates: the key is what identifies the server


def server_context(private_key: RSAPrivateKey) -> ssl.SSLContext:
    """A TLS 1.3 server context whose certificate is self-signed by `private_key`."""
    key = serialization.load_der_private_key(private_key.to_bytes(), password=None)
    if not isinstance(key, rsa.RSAPrivateKey):
        raise ValueError("a direct stream's identity must be an RSA key")
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "llm-swarm peer")])
    now = datetime.datetime.now(datetime.UTC)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=CERTIFICATE_DAYS))
        .sign(key, hashes.SHA256())
    )
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    # the ssl module loads a certificate chain from files only: a private directory, removed at once
    with tempfile.TemporaryDirectory(prefix="llm-swarm-tls-") as directory:
        os.chmod(directory, 0o700)
        certificate_path, key_path = os.path.join(directory, "cert.pem"), os.path.join(directory, "key.pem")
        with open(certificate_path, "wb") as file:
            file.write(certificate.public_bytes(serialization.Encoding.PEM))
        descriptor = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(descriptor, "wb") as file:
            file.write(
                key.private_bytes(
                    serialization.Encoding.PEM,
                    serialization.PrivateFormat.PKCS8,
                    serialization.NoEncryption(),
                )
            )
        context.load_cert_chain(certificate_path, key_path)
    return context


def client_context() -> ssl.SSLContext:
    """A TLS 1.3 client context that accepts any certificate: the caller checks the certificate's key
    against the peer id it dialed (`certificate_peer_id`) before sending anything."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    return context


def certificate_peer_id(certificate_der: bytes | None) -> str | None:
    """The peer id whose key signed a peer's certificate, or None if it is not a usable RSA key."""
    if not certificate_der:
        return None
    try:
        key = x509.load_der_x509_certificate(certificate_der).public_key()
    except ValueError:
        return None
    if not isinstance(key, rsa.RSAPublicKey):
        return None
    text = key.public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    return peer_id_of_key(text.decode())
