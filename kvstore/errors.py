"""The pool's errors and their status codes: one table (mooncake.faults) for the node's servicers, the control
fast path and KVStoreClient alike."""

from __future__ import annotations

import grpc

from kvstore.records import StoreFull
from mooncake.faults import StatusTable
from transfer import TransferError


class KVStoreUnavailable(ConnectionError):
    """The node did not answer (down, unreachable, or past the deadline)."""


KVSTORE_STATUS = StatusTable(
    raised=[
        (ValueError, grpc.StatusCode.INVALID_ARGUMENT),  # the caller's mistake
        (KeyError, grpc.StatusCode.NOT_FOUND),  # an unknown, expired or released lease or reservation
        (StoreFull, grpc.StatusCode.RESOURCE_EXHAUSTED),  # nothing evictable left
        (TransferError, grpc.StatusCode.UNAVAILABLE),  # a peer's bytes did not arrive (Pull)
        (KVStoreUnavailable, grpc.StatusCode.UNAVAILABLE),
    ],
    caught={
        grpc.StatusCode.INVALID_ARGUMENT: ValueError,
        grpc.StatusCode.NOT_FOUND: KeyError,
        grpc.StatusCode.RESOURCE_EXHAUSTED: StoreFull,
        grpc.StatusCode.UNAVAILABLE: KVStoreUnavailable,
        grpc.StatusCode.DEADLINE_EXCEEDED: KVStoreUnavailable,
    },
    prefix="kvstore: ",
)
