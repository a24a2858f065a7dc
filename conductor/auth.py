"""Who may change the cluster: the operator credential, and each registration's own token.

    conductor --operator-token-file FILE     the admin calls (Drain, SetPolicy, ScalePool, and
                                             Deregister of an instance not one's own) need
                                             gRPC metadata ``authorization: Bearer <the file's token>``
    RegisterResponse.instance_token          a registration's secret: with it, an instance
                                             deregisters itself without the operator credential

Without a token file the admin calls stay open to anyone who reaches the port, as before;
the Conductor logs a warning at start and ``mooncake status`` says so. A missing credential
is UNAUTHENTICATED, a wrong one PERMISSION_DENIED. Tokens are compared as SHA-256 digests
in constant time and never logged. The operator CLI finds the token the way kubectl finds a
kubeconfig: ``--operator-token-file``, else ``MOONCAKE_OPERATOR_TOKEN_FILE``, else the one
``mooncake up`` wrote into its run directory.

This authenticates calls, not peers: without TLS between components (issue 21), a token
crosses the network in the clear.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from pathlib import Path

import grpc

METADATA_KEY = "authorization"
TOKEN_FILE_ENV = "MOONCAKE_OPERATOR_TOKEN_FILE"
MIN_TOKEN_CHARS = 16


def read_token_file(path: str | Path) -> str:
    """The token in ``path`` (surrounding whitespace dropped); ValueError when unreadable or too short to be a
    secret."""
    try:
        token = Path(path).read_text().strip()
    except OSError as e:
        raise ValueError(f"cannot read the operator token file {path}: {e.strerror}") from None
    if len(token) < MIN_TOKEN_CHARS:
        raise ValueError(f"the operator token in {path} is shorter than {MIN_TOKEN_CHARS} characters")
    return token


def write_token_file(path: Path) -> str:
    """A fresh random token in ``path``, readable by its owner alone."""
    token = secrets.token_urlsafe(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    return token


def bearer(token: str | None) -> tuple[tuple[str, str], ...]:
    """The call metadata that carries ``token`` (none for None)."""
    return ((METADATA_KEY, f"Bearer {token}"),) if token else ()


def _digest(token: bytes) -> bytes:
    return hashlib.sha256(token).digest()


def same_token(given: bytes, known: bytes) -> bool:
    """Whether ``given`` is ``known``, in time that does not depend on where they differ."""
    return bool(known) and hmac.compare_digest(_digest(given), _digest(known))


def new_instance_token() -> bytes:
    return secrets.token_bytes(16)


class OperatorCheck:
    """The operator credential of one Conductor (None: admin calls are open)."""

    def __init__(self, token: str | None) -> None:
        self._token = token.encode() if token else None

    @property
    def open(self) -> bool:
        return self._token is None

    def presented(self, context: grpc.ServicerContext) -> bytes | None:
        """The bearer token the call carries (None: no authorization metadata)."""
        for key, value in context.invocation_metadata() or ():
            if key == METADATA_KEY:
                scheme, _, token = value.partition(" ")
                return token.strip().encode() if scheme.lower() == "bearer" else b""
        return None

    def holds(self, context: grpc.ServicerContext) -> bool:
        """Whether the call may do what an operator may."""
        if self._token is None:
            return True
        given = self.presented(context)
        return given is not None and same_token(given, self._token)

    def require(self, context: grpc.ServicerContext, what: str) -> None:
        """Abort the call unless it carries the operator credential."""
        if self.holds(context):
            return
        if self.presented(context) is None:
            context.abort(
                grpc.StatusCode.UNAUTHENTICATED,
                f"{what} needs the operator credential: metadata "
                f"'authorization: Bearer <token>' (the CLI reads --operator-token-file or ${TOKEN_FILE_ENV})",
            )
        context.abort(grpc.StatusCode.PERMISSION_DENIED, f"{what}: the operator credential is not this Conductor's")
