"""Who may open a tcp connection to this node: both ends show a certificate from the cluster's CA.

A connection starts with a TLS 1.3 handshake in which both sides present their
certificates; then the TLS layer is removed (``SSLSocket.unwrap``) and frames travel in
the clear. The connection is authenticated, not encrypted (why: ``mooncake.tls``, which
also covers gRPC and how a process learns its identity). Unix sockets pass as they are:
the socket file's permissions guard them, as for the shared-memory segments beside them.

The identity comes in through configuration (``TransferConfig.tls_dir``, then an
:class:`Identity` handed to the server and the client side); None means unauthenticated.
"""

from __future__ import annotations

import functools
import socket
import ssl
from dataclasses import dataclass
from pathlib import Path

SERVER_NAME = "mooncake"  # every certificate's subject alternative name; what each peer checks
FILES = ("ca.crt", "tls.crt", "tls.key")
HANDSHAKE_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class Identity:
    """One directory's CA, certificate and key (PEM bytes), and the TLS contexts built from them."""

    directory: Path
    ca: bytes
    cert: bytes
    key: bytes

    @classmethod
    def load(cls, directory: str | Path) -> "Identity":
        """Read ``ca.crt``, ``tls.crt`` and ``tls.key`` from ``directory``; ValueError naming what is missing."""
        directory = Path(directory)
        missing = [f for f in FILES if not (directory / f).is_file()]
        if missing:
            raise ValueError(
                f"{directory} has no {', '.join(missing)}: a TLS directory needs {', '.join(FILES)} "
                f"(mooncake up writes one into its run directory; see deploy/README.md)"
            )
        ca, cert, key = ((directory / f).read_bytes() for f in FILES)
        return cls(directory, ca, cert, key)

    @functools.cached_property
    def server_context(self) -> ssl.SSLContext:
        ctx = self._context(ssl.PROTOCOL_TLS_SERVER)
        ctx.num_tickets = (
            0  # no session tickets: nothing follows the handshake but the close (see unwrap in _handshake)
        )
        return ctx

    @functools.cached_property
    def client_context(self) -> ssl.SSLContext:
        return self._context(ssl.PROTOCOL_TLS_CLIENT)

    @functools.cached_property
    def https_context(self) -> ssl.SSLContext:
        """For an https URL by address (the launcher's control endpoint): the chain is checked, the name cannot be."""
        ctx = self._context(ssl.PROTOCOL_TLS_CLIENT)
        ctx.check_hostname = False
        return ctx

    def _context(self, protocol: int) -> ssl.SSLContext:
        ctx = ssl.SSLContext(protocol)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_3
        ctx.load_cert_chain(self.directory / "tls.crt", self.directory / "tls.key")
        ctx.load_verify_locations(cadata=self.ca.decode())
        ctx.verify_mode = ssl.CERT_REQUIRED  # the server requires the client's certificate too
        return ctx


@functools.cache
def load_identity(directory: str) -> Identity:
    """:meth:`Identity.load`, read once per directory and process."""
    return Identity.load(directory)


def handshake(sock: socket.socket, ctx: ssl.SSLContext, server_side: bool, timeout: float) -> socket.socket:
    """Run a TLS 1.3 handshake with both certificates on ``sock``, then take TLS off again; return the plain socket.

    ``unwrap`` exchanges close_notify both ways; OpenSSL reads no further than that alert,
    so the peer's first frame stays in the kernel's buffer for the plain socket.
    Raises ``ssl.SSLError`` (a peer without the cluster's certificate) or ``OSError``.
    """
    before = sock.gettimeout()  # None: blocking; 0.0: non-blocking; else a timeout
    kw = {} if server_side else {"server_hostname": SERVER_NAME}
    wrapped = ctx.wrap_socket(sock, server_side=server_side, do_handshake_on_connect=False, **kw)
    try:
        wrapped.settimeout(timeout)
        wrapped.do_handshake()
        wrapped.unwrap()
        plain = socket.socket(wrapped.family, wrapped.type, wrapped.proto, fileno=wrapped.detach())
    except BaseException:
        wrapped.close()
        raise
    plain.settimeout(before)
    return plain


def accept(sock: socket.socket, identity: Identity | None, timeout: float = HANDSHAKE_TIMEOUT_S) -> socket.socket:
    """The server side of a connection just accepted: authenticated when there is an ``identity``, else as is."""
    if identity is None or sock.family == socket.AF_UNIX:
        return sock
    return handshake(sock, identity.server_context, True, timeout)


def connect(sock: socket.socket, identity: Identity | None, timeout: float = HANDSHAKE_TIMEOUT_S) -> socket.socket:
    """The client side of :func:`accept`, on a socket just connected."""
    if identity is None or sock.family == socket.AF_UNIX:
        return sock
    return handshake(sock, identity.client_context, False, timeout)


def create_connection(address: tuple[str, int], timeout: float, identity: Identity | None) -> socket.socket:
    """``socket.create_connection`` followed by :func:`connect`; closes the socket if the handshake fails."""
    sock = socket.create_connection(address, timeout=timeout)
    try:
        return connect(sock, identity, timeout)
    except BaseException:
        sock.close()
        raise
