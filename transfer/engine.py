"""The transfer engine: register memory as segments, move slices to and from peers' segments.

    engine = TransferEngine(TransferConfig(node="node-a"), registry)
    seg = engine.allocate("dram", 1 << 30)             # shm-backed, served to peers
    batch = engine.read(local_buf, [Slice(0, "node-b/dram", 4096, 65536)])
    batch.wait(timeout=5)                               # or poll() for the state

Each batch is split into jobs (slices contiguous on both sides merged, then cut to
``tcp_chunk_bytes`` on tcp, so one large slice is pipelined over several connections),
grouped by remote segment, and handed to
the backend chosen for that segment's owner: shm when it lives on this host (and shm is
allowed), tcp otherwise. Every engine also runs a tcp server for its own segments.
Segments are resolved through the registry and cached for ``segment_cache_ttl_s``;
:meth:`add_segment` teaches the engine a segment learnt some other way (a control RPC),
which it then uses until taught a newer version.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from pydantic import BaseModel, Field

from transfer.backend import Backend, Job, ShmBackend
from transfer.batch import TransferBatch
from transfer.region import SharedRegion
from transfer.registry import MemoryRegistry, SegmentRegistry
from transfer.tcp import Guard, TcpBackend, TcpServer
from transfer.types import BackendKind, OpKind, Segment, Slice, TransferError, host_id

log = logging.getLogger(__name__)


class TransferConfig(BaseModel):
    """Configuration of one node's transfer engine."""

    node: str = Field(min_length=1, description="this node's name; segment names are '<node>/<label>'")
    backend: BackendKind = Field(BackendKind.AUTO, description="auto: shm on the same host, tcp otherwise")
    shm_dir: str = Field("/dev/shm/mooncake", description="where shared-memory segments live (a tmpfs)")
    listen_host: str = Field("127.0.0.1", description="address the tcp server binds")
    advertise_host: str | None = Field(None, description="address peers dial (default: listen_host)")
    port: int = Field(0, ge=0, le=65535, description="tcp server port (0: any free port)")
    serve: bool = Field(True, description="run a tcp server for this node's segments")
    tcp_connections: int = Field(2, ge=1, le=64, description="connections per peer")
    tcp_chunk_bytes: int = Field(2 << 20, ge=4096, description="large slices are cut into chunks of this size")
    connect_timeout_s: float = Field(3.0, gt=0)
    io_timeout_s: float = Field(30.0, gt=0, description="an answer overdue by this long fails the connection")
    shm_threads: int = Field(2, ge=1, le=64, description="threads that copy large shm batches")
    shm_inline_bytes: int = Field(4 << 20, ge=0, description="shm batches up to this size are copied by the caller, before read/write returns")
    segment_cache_ttl_s: float = Field(5.0, ge=0)


class TransferEngine:
    """One node's endpoint: owns its segments, its tcp server, and a backend per transport."""

    def __init__(self, config: TransferConfig, registry: SegmentRegistry | None = None) -> None:
        if config.backend is BackendKind.RDMA:
            raise ValueError("the rdma backend (pyverbs) is not built yet; use auto, shm or tcp")
        self.config = config
        self.registry = registry if registry is not None else MemoryRegistry()
        self.host = host_id()
        self._local: dict[str, memoryview] = {}
        self._guards: dict[str, Guard] = {}  # segment -> who may touch which bytes of it over tcp (allocate)
        self._regions: dict[str, SharedRegion] = {}
        self._segments: dict[str, Segment] = {}
        self._cache: dict[str, tuple[float, Segment]] = {}  # from the registry, for segment_cache_ttl_s
        self._taught: dict[str, Segment] = {}  # from add_segment
        self._lock = threading.Lock()
        self._server = TcpServer(config.listen_host, config.port, self._local.get, self._guards.get) if config.serve else None
        self._shm = ShmBackend(config.shm_threads, self._local.get, config.shm_inline_bytes)
        self._tcp = TcpBackend(config.tcp_connections, config.connect_timeout_s, config.io_timeout_s)
        self._closed = False

    # -- local segments -------------------------------------------------------------

    @property
    def tcp_addr(self) -> str | None:
        if self._server is None:
            return None
        return f"{self.config.advertise_host or self.config.listen_host}:{self._server.port}"

    def allocate(self, label: str, size: int, guard: Guard | None = None) -> Segment:
        """Create a shared-memory segment of ``size`` bytes, serve it, and publish it.

        Returns its :class:`Segment`; :meth:`buffer` gives the memory. Same-host peers
        map the file; others reach it over tcp. With ``guard``, the tcp server asks it
        about every request: ``guard(token, write, offset, length)`` returns None to
        allow the bytes or why not (the request then fails, and nothing is read or
        written); without one, any peer the transport lets in may touch any byte.
        """
        name = self._name(label)
        if guard is not None:
            self._guards[name] = guard
        path = Path(self.config.shm_dir) / name.replace("/", "--")
        region = SharedRegion.create(path, size)
        with self._lock:
            self._regions[name] = region
        return self._publish(name, region.buffer, str(path))

    def register_buffer(self, label: str, buffer) -> Segment:
        """Serve an existing writable buffer (bytearray, numpy array, torch storage...) over tcp."""
        view = memoryview(buffer).cast("B")
        if view.readonly:
            raise ValueError("a registered buffer must be writable")
        return self._publish(self._name(label), view, None)

    def _name(self, label: str) -> str:
        if not label or "/" in label:
            raise ValueError(f"segment label must be non-empty without '/', got {label!r}")
        name = f"{self.config.node}/{label}"
        if name in self._local:
            raise ValueError(f"segment {name!r} is already registered")
        return name

    def _publish(self, name: str, view: memoryview, shm_path: str | None) -> Segment:
        segment = Segment(
            name=name, node=self.config.node, size=len(view), host=self.host, pid=os.getpid(),
            shm_path=shm_path, tcp_addr=self.tcp_addr,
        )  # fmt: skip
        with self._lock:
            self._local[name] = view
            self._segments[name] = segment
        self.registry.register(segment)
        return segment

    def buffer(self, name: str) -> memoryview:
        """Return the memory of a local segment (by full name or label)."""
        view = self._local.get(name) or self._local.get(f"{self.config.node}/{name}")
        if view is None:
            raise ValueError(f"no local segment {name!r}")
        return view

    def segment(self, name: str) -> Segment:
        """Return a segment's descriptor (local, taught by :meth:`add_segment`, cached, or from the registry)."""
        local = self._segments.get(name) or self._taught.get(name)
        if local is not None:
            return local
        now = time.monotonic()
        cached = self._cache.get(name)
        if cached is not None and now - cached[0] <= self.config.segment_cache_ttl_s:
            return cached[1]
        found = self.registry.get(name)
        if found is None:
            raise ValueError(f"unknown segment {name!r}: not registered")
        self._cache[name] = (now, found)
        return found

    def add_segment(self, segment: Segment) -> None:
        """Use ``segment`` (learnt outside the registry, e.g. from a control RPC) until taught another version of it."""
        if segment.name not in self._segments:
            self._taught[segment.name] = segment

    def unregister(self, name: str) -> None:
        """Stop serving a local segment and remove it from the registry."""
        with self._lock:
            self._local.pop(name, None)
            self._guards.pop(name, None)
            self._segments.pop(name, None)
            region = self._regions.pop(name, None)
        self.registry.unregister(name)
        if region is not None:
            region.close()

    # -- transfers ------------------------------------------------------------------

    def read(self, local, slices: Sequence[Slice]) -> TransferBatch:
        """Start reading each slice of a remote segment into ``local`` (a local segment name or a writable buffer)."""
        return self._submit(OpKind.READ, local, slices)

    def write(self, local, slices: Sequence[Slice]) -> TransferBatch:
        """Start writing each slice from ``local`` (a local segment name or a buffer) into a remote segment."""
        return self._submit(OpKind.WRITE, local, slices)

    def backend_for(self, segment: Segment) -> Backend:
        """Return the backend that reaches ``segment``'s owner under this engine's configuration."""
        mode = self.config.backend
        if segment.name in self._local:
            return self._shm  # our own memory: a plain copy
        same_host = segment.host == self.host and segment.shm_path is not None
        if mode is BackendKind.SHM or (mode is BackendKind.AUTO and same_host):
            if not same_host:
                raise ValueError(f"segment {segment.name!r} is not on this host; shm cannot reach it")
            return self._shm
        return self._tcp

    def _submit(self, kind: OpKind, local, slices: Sequence[Slice]) -> TransferBatch:
        if self._closed:
            raise TransferError("transfer engine is closed")
        view = self.buffer(local) if isinstance(local, str) else memoryview(local).cast("B")
        if kind is OpKind.READ and view.readonly:
            raise ValueError("a read needs a writable local buffer")
        groups: dict[tuple[str, str], tuple[Segment, Backend, list[tuple[int, int, int]]]] = {}
        total = 0
        for s in slices:
            if s.length <= 0 or s.local_offset < 0 or s.remote_offset < 0:
                raise ValueError(f"bad slice {s}: offsets must be >= 0 and length > 0")
            if s.local_offset + s.length > len(view):
                raise ValueError(f"slice {s} runs past the local buffer ({len(view)} bytes)")
            group = (s.segment, s.token)  # one token per job: slices merge only under the same one
            if group not in groups:
                if len(s.token) > 255:
                    raise ValueError(f"a slice's token is at most 255 characters, got {len(s.token)}")
                seg = self.segment(s.segment)
                groups[group] = (seg, self.backend_for(seg), [])
            seg = groups[group][0]
            if s.remote_offset + s.length > seg.size:
                raise ValueError(f"slice {s} runs past segment {seg.name!r} ({seg.size} bytes)")
            spans = groups[group][2]
            if spans and spans[-1][0] + spans[-1][2] == s.local_offset and spans[-1][1] + spans[-1][2] == s.remote_offset:
                lo, ro, n = spans[-1]
                spans[-1] = (lo, ro, n + s.length)  # contiguous on both sides: one copy
            else:
                spans.append((s.local_offset, s.remote_offset, s.length))
            total += s.length
        pieces: list[tuple[Segment, Backend, bytes, list[tuple[int, int, int]]]] = []
        num_jobs = 0
        chunk = self.config.tcp_chunk_bytes
        for (_, token), (seg, backend, spans) in groups.items():
            if backend is self._tcp:
                spans = [
                    (lo + i, ro + i, min(chunk, n - i)) for lo, ro, n in spans for i in range(0, n, chunk)
                ]  # fmt: skip
            pieces.append((seg, backend, token.encode(), spans))
            num_jobs += len(spans)
        batch = TransferBatch(kind, num_jobs, total)
        for seg, backend, token, spans in pieces:
            jobs = [Job(batch, kind, view[lo : lo + n], seg, ro, n, token) for lo, ro, n in spans]
            backend.submit(seg, jobs)
        return batch

    def close(self) -> None:
        """Fail anything in flight, stop serving, unmap and remove this node's segments."""
        if self._closed:
            return
        self._closed = True
        self._tcp.close()
        if self._server is not None:
            self._server.close()
        self._shm.close()
        for name in list(self._segments):
            try:
                self.registry.unregister(name)
            except Exception as e:  # a registry that is already gone must not block shutdown
                log.warning("could not unregister %s: %s", name, e)
        with self._lock:
            regions = list(self._regions.values())
            self._regions.clear()
            self._local.clear()
            self._segments.clear()
        for region in regions:
            region.close()

    def __enter__(self) -> "TransferEngine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
