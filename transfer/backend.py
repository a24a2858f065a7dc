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
    token: bytes = b""  # the owner's capability for these bytes (Slice.token)


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


def split_by_bytes(jobs: list[Job], parts: int, total: int) -> list[list[Job]]:
    """Cut ``jobs`` into at most ``parts`` consecutive runs of roughly ``total / parts`` bytes."""
    if parts <= 1 or len(jobs) < 2:
        return [jobs]
    share = total / parts
    out: list[list[Job]] = []
    current: list[Job] = []
    size = 0
    for job in jobs:
        current.append(job)
        size += job.length
        if size >= share * (len(out) + 1) and len(out) < parts - 1:
            out.append(current)
            current = []
    if current:
        out.append(current)
    return out


class ShmBackend(Backend):
    """Same-host peers: map the segment's shared-memory file and copy.

    Batches of up to ``inline_bytes`` are copied in the submitting thread before
    ``submit`` returns (handing a copy of a few microseconds to a pool thread and waking
    the waiter again costs more than the copy); larger ones go to the copy threads.

    ``local_buffer`` returns this process's own memory for segments it owns (no mapping
    needed). A peer process that has died fails the jobs that target it, even though its
    file may outlive it, because what it held is no longer being maintained.
    """

    kind = BackendKind.SHM

    def __init__(self, threads: int, local_buffer: Callable[[str], memoryview | None], inline_bytes: int = 0) -> None:
        self._threads = max(1, threads)
        self._pool = ThreadPoolExecutor(max_workers=self._threads, thread_name_prefix="shm-copy")
        self._local_buffer = local_buffer
        self._inline_bytes = inline_bytes
        self._maps: dict[str, tuple[int, SharedRegion]] = {}  # segment name -> (owner pid, mapping)
        self._lock = threading.Lock()
        self._closed = False

    def submit(self, segment: Segment, jobs: list[Job]) -> None:
        if self._closed:
            raise TransferError("transfer engine is closed")
        total = sum(job.length for job in jobs)
        if total <= self._inline_bytes:
            self._run(segment, jobs)  # a small copy costs less than waking a pool thread
            return
        for part in split_by_bytes(jobs, self._threads, total):  # copy threads share the work
            self._pool.submit(self._run, segment, part)

    def mapping(self, segment: Segment) -> memoryview:
        """The segment's memory mapped here (this process's own, or its owner's shared-memory file); TransferError when
        its owner is gone or the file cannot be mapped."""
        own = self._local_buffer(segment.name)
        if own is not None:
            return own
        if not pid_alive(segment.pid):
            raise TransferError(
                f"segment {segment.name!r}: owner process {segment.pid} of node {segment.node!r} is gone"
            )
        with self._lock:
            pid, region = self._maps.get(segment.name, (None, None))
            if region is None or pid != segment.pid or str(region.path) != segment.shm_path:
                # new, or re-created by a restarted owner (same path, new file): map it afresh
                if segment.shm_path is None:
                    raise TransferError(f"segment {segment.name!r} has no shared-memory file")
                try:
                    fresh = SharedRegion.open(segment.shm_path)
                except (OSError, ValueError) as e:
                    raise TransferError(f"segment {segment.name!r}: cannot map {segment.shm_path}: {e}") from e
                if region is not None:
                    region.close()
                region = fresh
                self._maps[segment.name] = (segment.pid, region)
            return region.buffer

    def _run(self, segment: Segment, jobs: list[Job]) -> None:
        try:
            remote = self.mapping(segment)
        except TransferError as e:
            fail_jobs(jobs, e)
            return
        done: list[Job] = []
        for job in jobs:
            batch = job.batch
            if batch.state.finished:  # failed elsewhere or timed out: skip the copy
                batch.job_failed(batch.error or TransferError("batch cancelled"))
                continue
            batch.job_started()
            end = job.remote_offset + job.length
            if end > len(remote):
                batch.job_failed(
                    TransferError(
                        f"segment {segment.name!r}: [{job.remote_offset}, {end}) is past its end ({len(remote)})"
                    )
                )
                continue
            window = remote[job.remote_offset : end]
            try:
                if job.kind is OpKind.READ:
                    copy_bytes(job.local, window)
                else:
                    copy_bytes(window, job.local)
            except (ValueError, OSError) as e:  # e.g. the mapping went away under us
                batch.job_failed(TransferError(f"segment {segment.name!r}: copy failed: {e}"))
                continue
            done.append(job)
        if done:
            done[0].batch.jobs_done(len(done))  # one engine submit: every job is of one batch

    def close(self) -> None:
        self._closed = True
        self._pool.shutdown(wait=True)
        with self._lock:
            for _, region in self._maps.values():
                region.close()
            self._maps.clear()
