"""The transfer engine: register memory as segments, move slices to and from peers' segments.

    engine = TransferEngine(TransferConfig(node="node-a"), registry)
    seg = engine.allocate("dram", 1 << 30)             # shm-backed, served to peers
    batch = engine.read(local_buf, [Slice(0, "node-b/dram", 4096, 65536)])
    batch.wait(timeout=5)                               # or poll() for the state

Each batch is split into jobs (slices contiguous on both sides merged, then cut to
``tcp_chunk_bytes`` on tcp, so one large slice is pipelined over several connections),
grouped by remote segment, and handed to
the backend chosen for that segment's owner: shm when it lives on this host (and shm is
allowed), then rdma when this engine has an RDMA port and the segment is registered for
RDMA (transfer/rdma.py), tcp otherwise. Every engine also runs a tcp server for its own
segments (which also carries the RDMA connection handshake).
:attr:`TransferEngine.transport` says which remote transport it uses, and why not rdma.
Segments are resolved through the registry and cached for ``segment_cache_ttl_s``;
:meth:`add_segment` teaches the engine a segment learnt some other way (a control RPC),
which it then uses until taught a newer version.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from pydantic import BaseModel, Field

from transfer.backend import Backend, Job, ShmBackend
from transfer.batch import TransferBatch
from transfer.handshake import load_identity
from transfer.rdma import DeviceChoice, RdmaBackend, RdmaUnavailable, probe
from transfer.rdma_structs import buffer_address
from transfer.region import SharedRegion
from transfer.registry import MemoryRegistry, SegmentRegistry
from transfer.tcp import Guard, TcpBackend, TcpServer
from transfer.types import BackendKind, OpKind, Segment, Slice, TransferError, host_id
from transfer.verbs import QPSettings

log = logging.getLogger(__name__)

BACKEND_ENV = "MOONCAKE_TRANSFER_BACKEND"  # the default backend where a config or flag names none (auto unset)
SHM_DIR = "/dev/shm/mooncake"  # where shared-memory segments live when a config names no other tmpfs directory
TLS_ENV = "MOONCAKE_TLS_DIR"  # the default certificate directory (mooncake.tls: the whole cluster's identity)


def default_backend() -> BackendKind:
    """``$MOONCAKE_TRANSFER_BACKEND`` (auto when unset): one switch for every engine of a process and its children."""
    value = os.environ.get(BACKEND_ENV, "auto")
    try:
        return BackendKind(value)
    except ValueError:
        raise ValueError(f"{BACKEND_ENV}={value!r} is not one of {', '.join(k.value for k in BackendKind)}") from None


class TransferConfig(BaseModel):
    """Configuration of one node's transfer engine."""

    node: str = Field(min_length=1, description="this node's name; segment names are '<node>/<label>'")
    backend: BackendKind = Field(
        default_factory=default_backend,
        description="auto: shm on the same host, then rdma "
        "where both ends have an RDMA port, else tcp; rdma: refuse to start without one "
        f"(default: ${BACKEND_ENV}, else auto)",
    )
    rdma_device: str | None = Field(None, description="RDMA device (default: the first with an active port)")
    rdma_port: int | None = Field(None, ge=1, description="its port (default: its first active one)")
    rdma_gid_index: int = Field(
        0, ge=0, description="GID table index (RoCE v2: the entry carrying the IP; see show_gids)"
    )
    rdma_qp_depth: int = Field(256, ge=1, description="send queue depth of each queue pair (capped by the device)")
    rdma_signal_every: int = Field(16, ge=1, description="one signalled completion per this many work requests")
    rdma_queue_pairs: int = Field(1, ge=1, le=16, description="queue pairs per peer")
    shm_dir: str = Field(SHM_DIR, description="where shared-memory segments live (a tmpfs)")
    listen_host: str = Field("127.0.0.1", description="address the tcp server binds")
    advertise_host: str | None = Field(None, description="address peers dial (default: listen_host)")
    port: int = Field(0, ge=0, le=65535, description="tcp server port (0: any free port)")
    serve: bool = Field(True, description="run a tcp server for this node's segments")
    tcp_connections: int = Field(2, ge=1, le=64, description="connections per peer")
    tcp_chunk_bytes: int = Field(2 << 20, ge=4096, description="large slices are cut into chunks of this size")
    connect_timeout_s: float = Field(3.0, gt=0)
    io_timeout_s: float = Field(30.0, gt=0, description="an answer overdue by this long fails the connection")
    shm_threads: int = Field(2, ge=1, le=64, description="threads that copy large shm batches")
    shm_inline_bytes: int = Field(
        4 << 20, ge=0, description="shm batches up to this size are copied by the caller, before read/write returns"
    )
    segment_cache_ttl_s: float = Field(5.0, ge=0)
    tls_dir: str | None = Field(
        default_factory=lambda: os.environ.get(TLS_ENV) or None,
        description="the cluster's "
        "certificate directory (ca.crt, tls.crt, tls.key): every tcp connection, made or "
        f"accepted, shows it and asks the peer for one from the same CA (default: ${TLS_ENV}, "
        "else none: unauthenticated)",
    )


class TransportChoice(BaseModel):
    """What a process's flags say about how it moves KV to other hosts (the rest of TransferConfig is its own)."""

    backend: BackendKind = Field(default_factory=default_backend)
    rdma_device: str | None = None
    rdma_port: int | None = Field(None, ge=1)
    rdma_gid_index: int = Field(TransferConfig.model_fields["rdma_gid_index"].default, ge=0)

    @classmethod
    def from_args(cls, args) -> "TransportChoice":
        return cls(
            backend=BackendKind(args.transfer_backend),
            rdma_device=args.rdma_device,
            rdma_port=args.rdma_port,
            rdma_gid_index=args.rdma_gid_index,
        )


def add_transport_args(parser, backend_flag: str = "--transfer-backend") -> None:
    """The flags of :class:`TransportChoice` (a pool node keeps its older ``--backend`` name for the first)."""
    parser.add_argument(
        backend_flag,
        dest="transfer_backend",
        choices=[k.value for k in BackendKind],
        default=default_backend().value,
        help="how KV moves to other processes: auto (shm on this host, "
        "then rdma where both ends have an RDMA port, else tcp), or forced: shm, tcp, rdma (refuses to "
        f"start without an active RDMA port); default ${BACKEND_ENV}, else auto",
    )
    parser.add_argument("--rdma-device", help="RDMA device, e.g. mlx5_0 (default: the first with an active port)")
    parser.add_argument("--rdma-port", type=int, help="its port number (default: its first active port)")
    parser.add_argument(
        "--rdma-gid-index",
        type=int,
        default=0,
        help="GID index (RoCE v2: the entry with the IP; `show_gids` lists them; default 0)",
    )


@functools.cache
def _probe(device: str | None, port: int | None, gid_index: int) -> tuple[DeviceChoice | None, str]:
    try:
        return probe(device, port, gid_index), ""
    except RdmaUnavailable as e:
        return None, str(e)


def _rdma_choice(config: TransferConfig) -> tuple[DeviceChoice | None, str]:
    """The RDMA port an engine uses (None under shm/tcp, or under auto without one) and why none."""
    if config.backend not in (BackendKind.AUTO, BackendKind.RDMA):
        return None, f"backend {config.backend.value}"
    choice, why_not = _probe(config.rdma_device, config.rdma_port, config.rdma_gid_index)
    if choice is None and config.backend is BackendKind.RDMA:
        raise ValueError(f"the rdma backend cannot start: {why_not}")
    if choice is None and why_not not in _said:
        _said.add(why_not)
        log.info("no rdma, tcp between hosts: %s", why_not)
    return choice, why_not


_said: set[str] = set()


def _pin_name(view: memoryview) -> str:
    return f"pinned@{buffer_address(view):x}+{len(view)}"  # no segment name has an '@'


class TransferEngine:
    """One node's endpoint: owns its segments, its tcp server, and a backend per transport."""

    def __init__(self, config: TransferConfig, registry: SegmentRegistry | None = None) -> None:
        self.config = config
        choice, why_not = _rdma_choice(config)  # before anything starts: a forced rdma without a port fails here
        self.registry = registry if registry is not None else MemoryRegistry()
        self.host = host_id()
        self._local: dict[str, memoryview] = {}
        self._guards: dict[str, Guard] = {}  # segment -> who may touch which bytes of it over tcp (allocate)
        self._regions: dict[str, SharedRegion] = {}
        self._segments: dict[str, Segment] = {}
        self._cache: dict[str, tuple[float, Segment]] = {}  # from the registry, for segment_cache_ttl_s
        self._taught: dict[str, Segment] = {}  # from add_segment
        self._lock = threading.Lock()
        identity = load_identity(config.tls_dir) if config.tls_dir else None
        self._server = (
            TcpServer(config.listen_host, config.port, self._local.get, self._guards.get, identity)
            if config.serve
            else None
        )
        self._shm = ShmBackend(config.shm_threads, self._local.get, config.shm_inline_bytes)
        self._tcp = TcpBackend(config.tcp_connections, config.connect_timeout_s, config.io_timeout_s, identity)
        self._rdma: RdmaBackend | None = None
        if choice is not None:
            self._rdma = RdmaBackend(
                choice,
                QPSettings(port_num=choice.port, gid_index=config.rdma_gid_index),
                self._tcp.rdma_handshake,
                config.rdma_qp_depth,
                config.rdma_signal_every,
                config.rdma_queue_pairs,
            )
            if self._server is not None:
                self._server.rdma_accept = self._rdma.accept
        self.transport = f"rdma: {choice.describe()}" if choice is not None else f"tcp ({why_not})"
        self._moved: dict[tuple[str, str], list[int]] = {}  # (backend, read|write) -> [batches, bytes] (moved())
        self._moved_lock = threading.Lock()
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

    def pin(self, buffer) -> None:
        """Register a long-lived local buffer (a worker's KV cache, a mapped pool segment) with the RDMA device once.

        Batches reading into it or writing from it then use that registration; any other
        local buffer is registered for its batch alone, which pins its pages every time
        (slow for a large buffer). It must stay allocated until :meth:`unpin` or
        :meth:`close`. Without an RDMA port it does nothing.
        """
        if self._rdma is not None:
            view = memoryview(buffer).cast("B")
            self._rdma.register(_pin_name(view), view)

    def unpin(self, buffer) -> None:
        if self._rdma is not None:
            self._rdma.unregister(_pin_name(memoryview(buffer).cast("B")))

    def _name(self, label: str) -> str:
        if not label or "/" in label:
            raise ValueError(f"segment label must be non-empty without '/', got {label!r}")
        name = f"{self.config.node}/{label}"
        if name in self._local:
            raise ValueError(f"segment {name!r} is already registered")
        return name

    def _publish(self, name: str, view: memoryview, shm_path: str | None) -> Segment:
        rkey, addr = (
            self._rdma.register(name, view) if self._rdma is not None and self._server is not None else (None, 0)
        )
        segment = Segment(
            name=name,
            node=self.config.node,
            size=len(view),
            host=self.host,
            pid=os.getpid(),
            shm_path=shm_path,
            tcp_addr=self.tcp_addr,
            rdma_rkey=rkey,
            rdma_addr=addr,
        )
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
        if self._rdma is not None:
            self._rdma.unregister(name)
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
        if mode is BackendKind.RDMA or (self._rdma is not None and segment.rdma_rkey is not None):
            return self._rdma  # forced: a segment not registered for RDMA fails its jobs with that reason
        return self._tcp

    def networked(self, name: str) -> bool:
        """Whether a transfer with segment ``name`` crosses the network (tcp or rdma), not a copy on this host."""
        return self.backend_for(self.segment(name)) is not self._shm

    def mapped(self, segment: Segment) -> memoryview | None:
        """``segment``'s memory mapped into this process where shared memory reaches it (its owner is on this host), so
        a caller can copy into it with tensor operations instead of slices; None where only the network reaches it.
        Raises TransferError when its owner is gone."""
        backend = self.backend_for(segment)
        return backend.mapping(segment) if backend is self._shm else None

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
            if (
                spans
                and spans[-1][0] + spans[-1][2] == s.local_offset
                and spans[-1][1] + spans[-1][2] == s.remote_offset
            ):
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
                spans = [(lo + i, ro + i, min(chunk, n - i)) for lo, ro, n in spans for i in range(0, n, chunk)]
            pieces.append((seg, backend, token.encode(), spans))
            num_jobs += len(spans)
        batch = TransferBatch(kind, num_jobs, total)
        with self._moved_lock:
            for _, backend, _, spans in pieces:
                count = self._moved.setdefault((backend.kind.value, kind.value), [0, 0])
                count[0] += 1
                count[1] += sum(n for _, _, n in spans)
        for seg, backend, token, spans in pieces:
            jobs = [Job(batch, kind, view[lo : lo + n], seg, ro, n, token) for lo, ro, n in spans]
            backend.submit(seg, jobs)
        return batch

    def moved(self) -> dict[tuple[str, str], tuple[int, int]]:
        """(backend, read|write) -> (batches, bytes) this engine has submitted: which transport carried the KV."""
        with self._moved_lock:
            return {k: (v[0], v[1]) for k, v in self._moved.items()}

    def close(self) -> None:
        """Fail anything in flight, stop serving, unmap and remove this node's segments."""
        if self._closed:
            return
        self._closed = True
        self._tcp.close()
        if self._server is not None:
            self._server.close()
        self._shm.close()
        if self._rdma is not None:
            self._rdma.close()
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
