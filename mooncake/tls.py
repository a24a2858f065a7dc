"""Mutual TLS between the cluster's components: only holders of the cluster's certificate get in.

Every component of a cluster reads the same three files from one directory:

    ca.crt    the cluster's CA: the only issuer a peer's certificate may come from
    tls.crt   the certificate this process presents, signed by the CA for the name "mooncake"
    tls.key   its private key

and presents the certificate on every connection it makes or accepts. A peer without a
certificate from the CA is refused during the handshake, before a byte of the protocol
is read: it can neither call nor register, read nor write.

- **gRPC** (the Conductor, the workers, the pool nodes): grpcio's TLS credentials with the
  client's certificate required. The whole call is encrypted.
- **The framed paths** (a pool node's control port, the Conductor's fast path) and **the
  tcp transfer path**: each connection starts with a TLS 1.3 handshake in which both sides
  present their certificates (:func:`accept`, :func:`connect`); then the TLS layer is
  removed (``SSLSocket.unwrap``) and frames travel in the clear. The connection is
  authenticated, not encrypted: Python's TLS moves 1 MiB records at a third of the raw
  socket's rate on these machines (benchmarks/tls_bench.py), which the KV transfer path
  cannot afford; someone who can already read or inject packets on the pod network
  (root on a node) is outside what this defends against.
- **Unix sockets** (a worker's calls to a pool node on its own host): the socket file's
  permissions, as for the shared-memory segments beside it.

A process learns its identity from ``MOONCAKE_TLS_DIR`` (``mooncake up`` sets it for every
component it starts; the helm chart mounts the cluster's Secret and sets it). Without it
the process runs INSECURE, as before this module existed, and logs so loudly once.
Peers verify the name "mooncake" rather than an address: pods move, the CA is the
cluster's own, and every component holds the same certificate (the identity is the
cluster, not the role).
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
from pathlib import Path

from transfer import handshake
from transfer.handshake import FILES, HANDSHAKE_TIMEOUT_S, SERVER_NAME, Identity, load_identity

log = logging.getLogger(__name__)

ENV_DIR = "MOONCAKE_TLS_DIR"
VALID_DAYS = 365


_warned = False


def identity() -> Identity | None:
    """This process's identity (``MOONCAKE_TLS_DIR``), or None when it runs insecure (logged once, loudly).

    Read at each connection and server start (a cached file read), so a test process can
    move between clusters by changing the variable.
    """
    global _warned
    directory = os.environ.get(ENV_DIR)
    if directory:
        return load_identity(directory)
    if not _warned:
        _warned = True
        log.warning(
            "INSECURE: %s is not set, so this process neither presents nor asks for a certificate: "
            "anyone who can reach its ports can call them (development only)",
            ENV_DIR,
        )
    return None


# -- gRPC ---------------------------------------------------------------------------------


def _channel_args(ident: Identity, options) -> tuple:
    import grpc

    creds = grpc.ssl_channel_credentials(
        root_certificates=ident.ca, private_key=ident.key, certificate_chain=ident.cert
    )
    return creds, [*(options or ()), ("grpc.ssl_target_name_override", SERVER_NAME)]


def grpc_channel(target: str, options=None):
    """A grpc channel to ``target``: mutual TLS when this process has an identity, plain otherwise."""
    import grpc

    ident = identity()
    if ident is None:
        return grpc.insecure_channel(target, options=options)
    creds, opts = _channel_args(ident, options)
    return grpc.secure_channel(target, creds, options=opts)


def grpc_aio_channel(target: str, options=None):
    """The asyncio twin of :func:`grpc_channel`."""
    import grpc

    ident = identity()
    if ident is None:
        return grpc.aio.insecure_channel(target, options=options)
    creds, opts = _channel_args(ident, options)
    return grpc.aio.secure_channel(target, creds, options=opts)


def grpc_add_port(server, address: str) -> int:
    """Bind ``server`` to ``address``, requiring a client certificate from the CA when this process has an identity."""
    import grpc

    ident = identity()
    if ident is None:
        return server.add_insecure_port(address)
    creds = grpc.ssl_server_credentials([(ident.key, ident.cert)], root_certificates=ident.ca, require_client_auth=True)
    return server.add_secure_port(address, creds)


# -- framed sockets: authenticate, then carry on in the clear ------------------------------


def accept(sock: socket.socket, timeout: float = HANDSHAKE_TIMEOUT_S) -> socket.socket:
    """The server side of a tcp connection just accepted, with this process's identity
    (:func:`transfer.handshake.accept`)."""
    return handshake.accept(sock, identity(), timeout)


def connect(sock: socket.socket, timeout: float = HANDSHAKE_TIMEOUT_S) -> socket.socket:
    """The client side of :func:`accept`, on a socket just connected."""
    return handshake.connect(sock, identity(), timeout)


def create_connection(address: tuple[str, int], timeout: float) -> socket.socket:
    """``socket.create_connection`` followed by :func:`connect`; closes the socket if the handshake fails."""
    return handshake.create_connection(address, timeout, identity())


# -- a cluster's CA and certificate ---------------------------------------------------------


def generate(directory: str | Path, days: int = VALID_DAYS) -> Identity:
    """Write a new CA and a certificate it signs into ``directory`` (unless a valid set is there); return it.

    Keys are ECDSA P-256, written 0600; the CA's key (``ca.key``) stays beside them so
    more certificates can be issued from it. Used by ``mooncake up`` on first start.
    """
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    directory = Path(directory)
    if all((directory / f).is_file() for f in FILES):
        cert = x509.load_pem_x509_certificate((directory / "tls.crt").read_bytes())
        if cert.not_valid_after_utc > datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(days=1):
            return Identity.load(directory)
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "mooncake cluster CA")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=False,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, SERVER_NAME)]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(SERVER_NAME)]), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )
    pem = serialization.Encoding.PEM

    def private(k) -> bytes:
        return k.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())

    for name, data, mode in (
        ("ca.key", private(ca_key), 0o600),
        ("tls.key", private(key), 0o600),
        ("ca.crt", ca.public_bytes(pem), 0o644),
        ("tls.crt", cert.public_bytes(pem), 0o644),
    ):
        tmp = directory / f".{name}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, directory / name)
    load_identity.cache_clear()
    return Identity.load(directory)
