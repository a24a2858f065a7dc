"""One table per service between the errors its code raises and the gRPC status codes they cross the wire as.

A servicer answers an exception with the table's code (``table.servicer`` wraps its
methods); a client turns a failed call back into the table's exception (``table.error``).
The same table serves both sides, so what a caller catches is what the service raised:

    kvstore (kvstore/errors.py)   ValueError <-> INVALID_ARGUMENT   KeyError <-> NOT_FOUND
                                  StoreFull  <-> RESOURCE_EXHAUSTED
                                  TransferError, KVStoreUnavailable <-> UNAVAILABLE (and DEADLINE_EXCEEDED)
    conductor (conductor/service) Mismatch -> FAILED_PRECONDITION, ValueError, KeyError as above
    workers (mooncake/serving/    WORKER_STATUS: what a prefill or decode worker answers with,
             status.py)           and what the gateway makes of it (BackendError classes: HTTP)

An exception that no row matches is a bug: it propagates (gRPC answers UNKNOWN).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import grpc


@dataclass(frozen=True)
class StatusTable:
    """``raised``: (exception class, code) rows, the first match wins. ``caught``: code -> the exception a client raises
    (codes not listed: ``fallback``, with the code's name in the message)."""

    raised: Sequence[tuple[type[BaseException], grpc.StatusCode]]
    caught: dict[grpc.StatusCode, type[BaseException]] = field(default_factory=dict)
    fallback: type[BaseException] = RuntimeError
    prefix: str = ""  # put before a caught error's details ("kvstore: ...")

    def code_of(self, error: BaseException) -> grpc.StatusCode | None:
        """The status ``error`` is answered with, or None (not a designed failure: a bug)."""
        for cls, code in self.raised:
            if isinstance(error, cls):
                return code
        return None

    def error(self, code: grpc.StatusCode, details: str) -> BaseException:
        """The exception a client raises for a call that failed with ``code``."""
        cls = self.caught.get(code)
        if cls is None:
            return self.fallback(f"{self.prefix}{code.name}: {details}")
        # "the node is unreachable" reads better saying which service; a refusal's own message already does
        return cls(f"{self.prefix}{details}" if issubclass(cls, ConnectionError) else details)

    def servicer(self, fn: Callable) -> Callable:
        """Wrap a gRPC servicer method (``fn(self, request, context)``): a table exception aborts with its code."""

        @functools.wraps(fn)
        def wrapper(servicer, request, context):
            try:
                return fn(servicer, request, context)
            except Exception as e:
                code = self.code_of(e)
                if code is None:
                    raise
                context.abort(code, message(e))

        return wrapper


def message(error: BaseException) -> str:
    """An exception's text as a caller should read it (a KeyError's repr quotes its message; this does not)."""
    if isinstance(error, KeyError) and error.args:
        return str(error.args[0])
    return str(error)
