"""A worker's failures on the wire and what the client is told: one table for the prefill worker, the decode
worker and the gateway.

    raised in a worker                  gRPC status          the gateway's error (HTTP)
    ValueError                          INVALID_ARGUMENT     InvalidRequest (400)
    Busy                                RESOURCE_EXHAUSTED   Rejected (429; "reason: message", Retry-After)
    Unreachable                         FAILED_PRECONDITION  the decode worker asks again with landing slots
    Cancelled                           CANCELLED            (the caller went away)
    ConnectionError,                    UNAVAILABLE          Unavailable (503): a retry places the request again
    TransferError, RuntimeError
    (a peer gone, draining, the engine)

A decode worker passes on what its prefill answered when it is the request's own fate
(``REQUEST_CODES``: bad input, refused, cancelled, the cache unreachable); any other code is
the prefill worker's failure, which the decode worker answers as UNAVAILABLE naming that worker.
"""

from __future__ import annotations

import grpc

from mooncake.faults import StatusTable
from mooncake.serving.types import BackendError, InvalidRequest, Rejected, Unavailable
from transfer import TransferError


class Busy(Exception):
    """Turned away to protect the TBT SLO or for lack of landing slots (RESOURCE_EXHAUSTED)."""

    def __init__(self, message: str, reason: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.reason, self.retry_after_s = reason, retry_after_s


class Cancelled(Exception):
    """The caller (a decode worker, the gateway) went away."""


class Unreachable(Exception):
    """The landing names a decode engine's CUDA cache this worker cannot write (another host, no GPU here): the
    decode worker asks again with landing slots (FAILED_PRECONDITION)."""


WORKER_STATUS = StatusTable(
    raised=[
        (ValueError, grpc.StatusCode.INVALID_ARGUMENT),
        (Busy, grpc.StatusCode.RESOURCE_EXHAUSTED),
        (Unreachable, grpc.StatusCode.FAILED_PRECONDITION),  # a CUDA cache it cannot map: the decode worker sends slots
        (Cancelled, grpc.StatusCode.CANCELLED),
        # a pool node or another peer is gone (kvstore.errors.KVStoreUnavailable is one): the gateway places it again
        (ConnectionError, grpc.StatusCode.UNAVAILABLE),
        (TransferError, grpc.StatusCode.UNAVAILABLE),
        (RuntimeError, grpc.StatusCode.UNAVAILABLE),  # draining, or the engine failed
    ],
    caught={grpc.StatusCode.INVALID_ARGUMENT: InvalidRequest, grpc.StatusCode.RESOURCE_EXHAUSTED: Rejected},
    fallback=Unavailable,
)

RETRY_AFTER_KEY = "retry-after-s"  # a decode worker's trailing metadata on RESOURCE_EXHAUSTED: when to retry
FAILED_INSTANCE_KEY = (
    "failed-instance"  # and on UNAVAILABLE when its prefill worker failed: which (the Conductor hears)
)

REQUEST_CODES = frozenset(
    {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.CANCELLED,
        grpc.StatusCode.FAILED_PRECONDITION,
    }
)


def client_error(code: grpc.StatusCode, details: str, who: str, retry_after_s: float | None = None) -> BackendError:
    """What a worker's or the Conductor's failed call (its status code and details) means for the gateway's client:
    the table's error, a refusal's reason (the details before ':') as its code, anything else as ``who`` failing."""
    cls = WORKER_STATUS.caught.get(code, WORKER_STATUS.fallback)
    if cls is Rejected:
        reason = details.split(":", 1)[0] if ":" in details else "overloaded"
        return Rejected(details, code=reason, retry_after_s=retry_after_s or 1.0)
    if cls is InvalidRequest:
        return InvalidRequest(details)
    return Unavailable(f"{who} failed: {code.name} {details}".strip())
