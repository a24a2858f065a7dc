"""A submitted batch of slices: its state, its completion, and how a caller waits on it.

Backends split a batch into jobs (one per slice or per chunk of a large slice) and
resolve each job exactly once, as done or failed. The batch turns DONE when every job is
done and FAILED at the first failure (the first error is kept). Ownership of the local
buffer: backends may write into it (reads) or send from it (writes) until every job is
resolved; :meth:`wait` returns or raises only after that, so a caller that gets control
back may reuse or free the buffer, and the slots it named, even after a failure or a
timeout (a timeout cancels what is still queued or on the wire first).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from transfer.types import OpKind, TransferError, TransferState

log = logging.getLogger(__name__)

QUIESCE_LIMIT_S = 10.0  # after a cancel, how long wait() lets backends resolve their jobs


class TransferBatch:
    """Handle of one asynchronous batch (what ``TransferEngine.read``/``write`` return)."""

    __slots__ = (
        "kind",
        "num_bytes",
        "_outstanding",
        "_state",
        "_error",
        "_cond",
        "_cancels",
        "_settled",
        "started_at",
        "finished_at",
    )

    def __init__(self, kind: OpKind, num_jobs: int, num_bytes: int) -> None:
        self.kind = kind
        self.num_bytes = num_bytes
        self._outstanding = num_jobs
        self._state = TransferState.PENDING if num_jobs else TransferState.DONE
        self._error: TransferError | None = None
        self._cond = threading.Condition()
        self._cancels: list[Callable[["TransferBatch"], None]] = []
        self._settled: list[Callable[[], None]] = []
        self.started_at = time.monotonic()
        self.finished_at: float | None = None if num_jobs else self.started_at

    @property
    def state(self) -> TransferState:
        return self._state

    @property
    def error(self) -> TransferError | None:
        return self._error

    def poll(self) -> TransferState:
        """Return the current state without blocking."""
        return self._state

    def wait(self, timeout: float | None = None) -> None:
        """Block until every job is resolved; raise ``TransferError`` if the batch failed.

        If ``timeout`` seconds pass first, the batch fails with a timeout error, its
        queued and in-flight jobs are cancelled (a tcp connection carrying one is closed),
        and the error is raised once no backend touches the buffer any more.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._outstanding and not self._state.finished:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    self._fail_locked(
                        TransferError(f"{self.kind.value} of {self.num_bytes} bytes timed out after {timeout} s")
                    )
                    break
                self._cond.wait(remaining)
            cancels = list(self._cancels) if self._outstanding else []
        for cancel in cancels:
            cancel(self)
        with self._cond:
            if not self._cond.wait_for(lambda: self._outstanding == 0, QUIESCE_LIMIT_S):
                log.error(
                    "%r: %d jobs still unresolved %s s after the batch ended", self, self._outstanding, QUIESCE_LIMIT_S
                )
            if self._error is not None:
                raise self._error

    # -- called by backends ---------------------------------------------------------

    def on_cancel(self, hook: Callable[["TransferBatch"], None]) -> None:
        """Register how a backend stops this batch's unresolved jobs (called from :meth:`wait`)."""
        with self._cond:
            self._cancels.append(hook)

    def on_settled(self, hook: Callable[[], None]) -> None:
        """Call ``hook`` once every job is resolved, done or failed (at once if that is already so): when no
        backend touches the local buffer any more (the rdma backend deregisters a buffer's memory region then)."""
        with self._cond:
            if self._outstanding:
                self._settled.append(hook)
                return
        hook()

    def _settle_locked(self) -> list[Callable[[], None]]:
        if self._outstanding or not self._settled:
            return []
        hooks, self._settled = self._settled, []
        return hooks

    def job_started(self) -> None:
        if self._state is TransferState.PENDING:
            with self._cond:
                if self._state is TransferState.PENDING:
                    self._state = TransferState.TRANSFERRING

    def job_done(self) -> None:
        self.jobs_done(1)

    def jobs_done(self, count: int) -> None:
        """Resolve ``count`` jobs as done at once."""
        with self._cond:
            self._outstanding -= count
            if not self._state.finished and self._outstanding == 0:
                self._state = TransferState.DONE
                self.finished_at = time.monotonic()
            self._cond.notify_all()
            hooks = self._settle_locked()
        for hook in hooks:
            hook()

    def job_failed(self, error: BaseException) -> None:
        with self._cond:
            self._outstanding -= 1
            if not self._state.finished:
                self._fail_locked(error if isinstance(error, TransferError) else TransferError(str(error)))
            self._cond.notify_all()
            hooks = self._settle_locked()
        for hook in hooks:
            hook()

    def _fail_locked(self, error: TransferError) -> None:
        self._error = error
        self._state = TransferState.FAILED
        self.finished_at = time.monotonic()
        self._cond.notify_all()

    def __repr__(self) -> str:
        return f"TransferBatch({self.kind.value}, {self.num_bytes} B, {self._state.value})"
