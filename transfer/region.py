"""Shared-memory regions: a file in a tmpfs directory, mapped by its owner and by peers.

A region is the memory behind a segment that same-host peers can map: the owner creates
it (replacing a stale file a killed predecessor left behind) and unlinks it on close; a
peer opens it read-write by path. ``buffer`` is a writable memoryview over the mapping.

Regions are committed up front: the owner reserves every page (``posix_fallocate``: a
tmpfs too small for it fails at start with a clear error, not with SIGBUS at some later
write), and every process maps it populated (``MAP_POPULATE``), paying for its page tables
once instead of a page fault on each first touch in the middle of a transfer: on this
project's 2-core VMs a first write into a fresh 256 MiB mapping ran at 1.4 GB/s, into a
reserved and populated one at 11.1 GB/s (``python -m benchmarks.shm_fault_bench``, 2026-11-26).
"""

from __future__ import annotations

import errno
import mmap
import os
from pathlib import Path

_FLAGS = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)  # MAP_POPULATE: Linux


class SharedRegion:
    """A memory-mapped shared file. Create as owner with :meth:`create`, map with :meth:`open`."""

    def __init__(self, path: Path, size: int, mm: mmap.mmap, owner: bool) -> None:
        self.path = path
        self.size = size
        self._mmap = mm
        self.buffer = memoryview(mm)
        self.owner = owner

    @classmethod
    def create(cls, path: str | os.PathLike, size: int) -> "SharedRegion":
        """Create (or replace) the file at ``path`` with ``size`` bytes and map it."""
        if size <= 0:
            raise ValueError(f"region size must be positive, got {size}")
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.unlink(missing_ok=True)  # a stale region from a killed owner
        fd = os.open(p, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, size)
            _reserve(fd, size, p)
            mm = mmap.mmap(fd, size, _FLAGS, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            p.unlink(missing_ok=True)
            raise
        os.close(fd)
        return cls(p, size, mm, owner=True)

    @classmethod
    def open(cls, path: str | os.PathLike) -> "SharedRegion":
        """Map an existing region read-write (a peer on the same host)."""
        p = Path(path)
        fd = os.open(p, os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            if size == 0:
                raise ValueError(f"shared region {p} is empty")
            mm = mmap.mmap(fd, size, _FLAGS, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        return cls(p, size, mm, owner=False)

    def close(self) -> None:
        """Unmap; the owner also removes the file. Safe to call twice."""
        if self._mmap.closed:
            return
        try:
            self.buffer.release()
            self._mmap.close()
        except BufferError:
            # Someone still holds a slice of the buffer; the mapping goes with the process.
            pass
        if self.owner:
            self.path.unlink(missing_ok=True)

    def __enter__(self) -> "SharedRegion":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _reserve(fd: int, size: int, path: Path) -> None:
    """Allocate every page of the file now; OSError naming the directory and the size when it does not fit."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        if e.errno in (errno.EOPNOTSUPP, errno.EINVAL):  # a filesystem without fallocate: pages come on first touch
            return
        raise OSError(
            e.errno,
            f"cannot reserve {size / 2**20:,.1f} MiB of shared memory in {path.parent} ({e.strerror}); "
            "give it more room (docker --shm-size, a Kubernetes emptyDir with medium Memory and a sizeLimit) "
            "or ask for less (the pool's --dram-blocks, a worker's landing slots)",
        ) from None
