"""A submitted batch of slices: its state, its completion, and how a caller waits on it.

Backends split a batch into jobs (one per slice or per chunk of a large slice) and report
each job's start and end here; the batch turns DONE when every job is done and FAILED as
soon as any job fails (the first error is kept, later completions are ignored). Waiting
never outlives ``wait(timeout)``, and a backend that loses its peer fails every job it
holds, so nothing waits forever.
"""

from __future__ import annotations

import threading
import time

from transfer.types import OpKind, TransferError, TransferState


class TransferBatch:
    """Handle of one asynchronous batch (what ``TransferEngine.read``/``write`` return)."""

    __slots__ = ("kind", "num_bytes", "_pending_jobs", "_state", "_error", "_cond", "started_at", "finished_at")

    def __init__(self, kind: OpKind, num_jobs: int, num_bytes: int) -> None:
        self.kind = kind
        self.num_bytes = num_bytes
        self._pending_jobs = num_jobs
        self._state = TransferState.PENDING if num_jobs else TransferState.DONE
        self._error: TransferError | None = None
        self._cond = threading.Condition()
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
        """Block until the batch finishes; raise ``TransferError`` if it failed.

        With a ``timeout`` (seconds) that passes first, the batch is failed with a
        timeout error (its backends' late completions are then ignored) and that error
        is raised.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while not self._state.finished:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    self._fail_locked(TransferError(f"{self.kind.value} of {self.num_bytes} bytes timed out after {timeout} s"))
                    break
                self._cond.wait(remaining)
            if self._error is not None:
                raise self._error

    # -- called by backends ---------------------------------------------------------

    def job_started(self) -> None:
        if self._state is TransferState.PENDING:
            with self._cond:
                if self._state is TransferState.PENDING:
                    self._state = TransferState.TRANSFERRING

    def job_done(self) -> None:
        with self._cond:
            if self._state.finished:
                return
            self._pending_jobs -= 1
            if self._pending_jobs == 0:
                self._state = TransferState.DONE
                self.finished_at = time.monotonic()
                self._cond.notify_all()

    def job_failed(self, error: BaseException) -> None:
        with self._cond:
            if not self._state.finished:
                err = error if isinstance(error, TransferError) else TransferError(str(error))
                self._fail_locked(err)

    def _fail_locked(self, error: TransferError) -> None:
        self._error = error
        self._state = TransferState.FAILED
        self.finished_at = time.monotonic()
        self._cond.notify_all()

    def __repr__(self) -> str:
        return f"TransferBatch({self.kind.value}, {self.num_bytes} B, {self._state.value})"
