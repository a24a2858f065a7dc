"""The backend interface every transport implements, and the shm (same-host) backend.

The engine turns a batch into :class:`Job` s (one per slice, or per chunk of a large
slice), groups them by peer and hands each group to that peer's backend. A backend
reports every job's start and end to its batch and never blocks the caller: copies and
socket work happen on its own threads. ``rdma`` (pyverbs: register the local buffer as
an MR, post RDMA READ/WRITE work requests, poll the CQ, report completions per job) is
the third implementation this interface is shaped for; it is not built yet.
"""

from __future__ import annotations

import abc
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from transfer.batch import TransferBatch
from transfer.region import SharedRegion
from transfer.types import BackendKind, OpKind, Segment, TransferError, pid_alive


@dataclass(slots=True)
class Job:
    """One contiguous copy between local memory and a remote segment."""

    batch: TransferBatch
    kind: OpKind
    local: memoryview  # exactly ``length`` bytes of the caller's buffer
    segment: Segment
    remote_offset: int
    length: int


def fail_jobs(jobs: list[Job], error: BaseException) -> None:
    """Fail every job's batch with ``error`` (a batch already finished ignores it)."""
    for job in jobs:
        job.batch.job_failed(error)


class Backend(abc.ABC):
    """Moves jobs' bytes to and from one kind of peer."""

    kind: BackendKind

    @abc.abstractmethod
    def submit(self, segment: Segment, jobs: list[Job]) -> None:
        """Start ``jobs`` (all against ``segment``); returns at once."""

    @abc.abstractmethod
    def close(self) -> None:
        """Fail whatever is still queued and release connections and mappings."""


def copy_bytes(dst: memoryview, src: memoryview) -> None:
    """memcpy through numpy, which releases the GIL for large copies."""
    np.copyto(np.frombuffer(dst, dtype=np.uint8), np.frombuffer(src, dtype=np.uint8))


class ShmBackend(Backend):
    """Same-host peers: map the segment's shared-memory file and copy.

    ``local_buffer`` returns this process's own memory for segments it owns (no mapping
    needed). A peer process that has died fails the jobs that target it, even though its
    file may outlive it, because what it held is no longer being maintained.
    """

    kind = BackendKind.SHM

    def __init__(self, threads: int, local_buffer: Callable[[str], memoryview | None]) -> None:
        self._pool = ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="shm-copy")
        self._local_buffer = local_buffer
        self._maps: dict[str, SharedRegion] = {}
        self._lock = threading.Lock()
        self._closed = False

    def submit(self, segment: Segment, jobs: list[Job]) -> None:
        if self._closed:
            raise TransferError("transfer engine is closed")
        self._pool.submit(self._run, segment, jobs)

    def _mapping(self, segment: Segment) -> memoryview:
        own = self._local_buffer(segment.name)
        if own is not None:
            return own
        if not pid_alive(segment.pid):
            raise TransferError(f"segment {segment.name!r}: owner process {segment.pid} of node {segment.node!r} is gone")
        with self._lock:
            region = self._maps.get(segment.name)
            if region is None or str(region.path) != segment.shm_path:
                if segment.shm_path is None:
                    raise TransferError(f"segment {segment.name!r} has no shared-memory file")
                try:
                    region = SharedRegion.open(segment.shm_path)
                except (OSError, ValueError) as e:
                    raise TransferError(f"segment {segment.name!r}: cannot map {segment.shm_path}: {e}") from e
                self._maps[segment.name] = region
            return region.buffer

    def _run(self, segment: Segment, jobs: list[Job]) -> None:
        try:
            remote = self._mapping(segment)
        except TransferError as e:
            fail_jobs(jobs, e)
            return
        for job in jobs:
            if job.batch.state.finished:  # failed elsewhere or timed out: skip the copy
                job.batch.job_failed(job.batch.error or TransferError("batch cancelled"))
                continue
            job.batch.job_started()
            end = job.remote_offset + job.length
            if end > len(remote):
                job.batch.job_failed(TransferError(f"segment {segment.name!r}: [{job.remote_offset}, {end}) is past its end ({len(remote)})"))
                continue
            window = remote[job.remote_offset : end]
            if job.kind is OpKind.READ:
                copy_bytes(job.local, window)
            else:
                copy_bytes(window, job.local)
            job.batch.job_done()

    def close(self) -> None:
        self._closed = True
        self._pool.shutdown(wait=True)
        with self._lock:
            for region in self._maps.values():
                region.close()
            self._maps.clear()
