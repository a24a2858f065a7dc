"""The transfer engine's vocabulary: segments, slices, operation kinds and states.

A **segment** is a registered memory region that a node exposes to peers: a name unique
in the cluster (``"<node>/<label>"``), the owning node, its size, and how to reach it
(a shared-memory file for peers on the same host, a TCP address for any peer). An
operation is a batch of one-sided **slices**: ``(local_offset, segment, remote_offset,
length)``, read from the remote segment into local memory or written from local memory
into it. This is RDMA's model (memory regions, one-sided verbs, completions), so an
``rdma`` backend fits behind the same interface.
"""

from __future__ import annotations

import enum
import functools
import os
import socket
import time
from dataclasses import asdict, dataclass


class TransferError(RuntimeError):
    """A transfer failed: the peer vanished, refused the operation, or timed out."""


class OpKind(enum.Enum):
    READ = "read"  # remote segment -> local memory
    WRITE = "write"  # local memory -> remote segment


class TransferState(enum.Enum):
    """Lifecycle of a batch: PENDING -> TRANSFERRING -> DONE | FAILED."""

    PENDING = "pending"
    TRANSFERRING = "transferring"
    DONE = "done"
    FAILED = "failed"

    @property
    def finished(self) -> bool:
        return self in (TransferState.DONE, TransferState.FAILED)


class BackendKind(enum.Enum):
    """How bytes move to a peer. ``auto`` picks shm on the same host, then rdma where both ends have
    an RDMA port (transfer/rdma.py), then tcp. ``rdma`` forces it (an engine without a usable
    RDMA port then refuses to start, saying why)."""

    AUTO = "auto"
    SHM = "shm"
    TCP = "tcp"
    RDMA = "rdma"


@dataclass(frozen=True, slots=True)
class Segment:
    """A registered memory region as peers see it (what the segment registry stores).

    ``host`` identifies the machine (hostname and boot id): peers with the same ``host``
    may map ``shm_path`` directly. ``tcp_addr`` is ``"host:port"`` of the owner's
    transfer server. ``pid`` lets a same-host peer notice that the owner has died.
    """

    name: str
    node: str
    size: int
    host: str
    pid: int
    shm_path: str | None = None
    tcp_addr: str | None = None
    rdma_rkey: int | None = None  # registered for RDMA (transfer/rdma.py): its memory region's remote key
    rdma_addr: int = 0  # and the address RDMA requests name (the region's start)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "Segment":
        return cls(
            name=str(data["name"]),
            node=str(data["node"]),
            size=int(data["size"]),
            host=str(data["host"]),
            pid=int(data["pid"]),
            shm_path=data.get("shm_path") or None,
            tcp_addr=data.get("tcp_addr") or None,
            rdma_rkey=None if data.get("rdma_rkey") is None else int(data["rdma_rkey"]),
            rdma_addr=int(data.get("rdma_addr") or 0),
        )


@dataclass(frozen=True, slots=True)
class Slice:
    """One contiguous piece of a one-sided operation.

    ``local_offset`` is into the local buffer the batch names; ``remote_offset`` is into
    ``segment`` (a segment name, resolved through the registry). ``token`` is the
    capability the segment's owner issued for these bytes, where it asks for one (a pool
    node's DRAM: the lease or reservation id that granted the slots; checked by its tcp
    server on every request, see ``TransferEngine.allocate``).
    """

    local_offset: int
    segment: str
    remote_offset: int
    length: int
    token: str = ""


@functools.cache
def host_id() -> str:
    """Return this machine's identity: hostname plus kernel boot id (stable per boot)."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            boot = f.read().strip()
    except OSError:
        boot = "noboot"
    return f"{socket.gethostname()}:{boot}"


ZOMBIE_CHECK_INTERVAL_S = 1.0
_zombie_checked: dict[int, float] = {}


def pid_alive(pid: int) -> bool:
    """Return whether process ``pid`` exists on this host (zombies count as dead).

    ``kill(pid, 0)`` runs every time (about a microsecond); the zombie check reads /proc
    and so runs at most once per ``ZOMBIE_CHECK_INTERVAL_S`` per pid.
    """
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    now = time.monotonic()
    if now - _zombie_checked.get(pid, -ZOMBIE_CHECK_INTERVAL_S) < ZOMBIE_CHECK_INTERVAL_S:
        return True
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            alive = f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        alive = True
    if alive:
        _zombie_checked[pid] = now
    return alive
