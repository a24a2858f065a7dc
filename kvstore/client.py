"""The client library workers use to talk to a pool node.

Control calls go over gRPC, the hot ones over the node's control fast path
(:mod:`kvstore.control`); block bytes go through a transfer engine (shared memory
when the node is on this host, tcp otherwise), straight between the caller's buffer and
the node's DRAM segment::

    with KVStoreClient("10.0.0.5:7100") as kv:
        kv.put(keys, kv_bytes)              # reserve -> write slots -> commit (abort on failure)
        hit = kv.get(keys)                  # lease -> read slots -> release
        hit.num_blocks, hit.data            # the longest stored prefix and its bytes

Errors: ``ValueError`` for bad input (wrong block size, bad keys), ``KeyError`` for an
unknown reservation or lease, :class:`~kvstore.records.StoreFull` when the node cannot make
room, :class:`KVStoreUnavailable` when the node cannot be reached,
:class:`~transfer.TransferError` when the bytes could not be moved.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import grpc

from kvstore.control import METHOD_IDS, METHODS
from kvstore.errors import KVSTORE_STATUS, KVStoreUnavailable
from kvstore.records import LookupResult, StoreFull
from kvstore.wire import GRPC_OPTIONS, PB_TO_TIER, segment_from_pb
from mooncake import tls
from mooncake.runtime.framed import ControlAddress, ControlChannel, ControlError
from protos import kvstore_pb2 as pb
from protos import kvstore_pb2_grpc as pb_grpc
from transfer import Segment, Slice, TransferConfig, TransferEngine, TransferError
from transfer.types import host_id


@dataclass(frozen=True, slots=True)
class PutResult:
    stored: int  # blocks written and committed
    existing: int  # blocks the node already had (not sent)


@dataclass(frozen=True, slots=True)
class ReadResult:
    num_blocks: int  # the longest stored prefix that was read
    data: memoryview  # num_blocks * block_bytes bytes, in chain order
    dram_hits: int
    ssd_hits: int
    corrupt: list[bytes]  # blocks the node found corrupt (reported, dropped, never returned)


def _raise(code: grpc.StatusCode, details: str) -> None:
    raise KVSTORE_STATUS.error(code, details) from None


class KVStoreClient:
    """A connection to one kvstore node. ``engine`` moves the bytes (a private one by default).

    The first call asks the node (over gRPC) for its block size and its control fast
    path; from then on the hot calls go over that (its Unix socket when the node is on
    this host, its tcp port otherwise). ``control`` chooses: ``auto`` (that), ``tcp``
    (the tcp port even on the same host), ``grpc`` (every call over gRPC).

    ``owner`` (a worker's instance id; empty: nobody in particular) goes with every
    lease and reservation this client makes, so that :meth:`release_owner` can end
    them all when that worker restarts.
    """

    def __init__(
        self,
        address: str,
        engine: TransferEngine | None = None,
        timeout_s: float = 10.0,
        control: str = "auto",
        owner: str = "",
    ) -> None:
        if control not in ("auto", "tcp", "grpc"):
            raise ValueError(f"control must be auto, tcp or grpc, not {control!r}")
        self.address = address
        self.owner = owner
        self.timeout_s = timeout_s
        self._channel = tls.grpc_channel(address, options=GRPC_OPTIONS)
        self._stub = pb_grpc.KVStoreStub(self._channel)
        self._own_engine = engine is None
        self.engine = engine or TransferEngine(
            TransferConfig(node=f"client-{os.getpid()}-{uuid.uuid4().hex[:8]}", serve=False)
        )
        self._control_mode = control
        self._control: ControlChannel | None = None
        self._block_bytes: int | None = None
        self._segments: dict[str, Segment] = {}

    def _call(self, name: str, request, timeout: float | None = None, oneway: bool = False):
        timeout = timeout or self.timeout_s
        if self._control is not None and name in METHOD_IDS:
            try:
                return self._control.call(name, request, timeout, oneway)
            except ControlError as e:
                _raise(e.code, e.details)
            except OSError as e:
                raise KVStoreUnavailable(f"kvstore {self._control.address.target}: {e or type(e).__name__}") from None
        try:
            return getattr(self._stub, name)(request, timeout=timeout)
        except grpc.RpcError as e:
            _raise(e.code(), e.details())

    @property
    def block_bytes(self) -> int:
        """The node's block size (asked once, with where its control fast path is)."""
        if self._block_bytes is None:
            stats = self._call("Stats", pb.StatsRequest())
            if self._control_mode != "grpc":
                self._control = self._control_channel(stats)
            self._block_bytes = stats.block_bytes
        return self._block_bytes

    def _control_channel(self, stats: pb.StatsResponse) -> ControlChannel | None:
        local = bool(stats.control_uds) and stats.segment.host == host_id() and os.path.exists(stats.control_uds)
        if self._control_mode == "auto" and local:
            return ControlChannel(ControlAddress("unix:" + stats.control_uds), METHODS)
        if stats.control_port:
            return ControlChannel(ControlAddress(f"{self.address.rpartition(':')[0]}:{stats.control_port}"), METHODS)
        return None

    # -- control calls (one RPC each) -----------------------------------------------

    def stats(self) -> pb.StatsResponse:
        return self._call("Stats", pb.StatsRequest())

    def reserve(
        self,
        keys: Sequence[bytes],
        positions: Sequence[int] | None = None,
        ttl_s: float = 0,
        parent: bytes | None = None,
    ) -> pb.ReserveResponse:
        """Reserve slots for ``keys`` (``positions``: their indices in their chain; ``parent``: the key before
        ``keys[0]`` when that is not the chain's first block, so the Conductor's index can count them)."""
        request = pb.ReserveRequest(
            keys=keys,
            positions=positions or [],
            block_bytes=self.block_bytes,
            ttl_s=ttl_s,
            owner=self.owner,
            parent=parent or b"",
        )
        return self._call("Reserve", request)

    def commit(self, reservation_id: str) -> pb.CommitResponse:
        return self._call("Commit", pb.CommitRequest(reservation_id=reservation_id))

    def abort(self, reservation_id: str) -> None:
        self._call("Abort", pb.AbortRequest(reservation_id=reservation_id))

    def lookup(self, keys: Sequence[bytes]) -> LookupResult:
        r = self._call("Lookup", pb.LookupRequest(keys=keys))
        return LookupResult(r.prefix_blocks, [PB_TO_TIER[t] for t in r.tiers])

    def get_locations(self, keys: Sequence[bytes], lease_ttl_s: float = 0, wait_s: float = 0) -> pb.GetResponse:
        """Lease the longest stored prefix and return where its bytes are. Release the lease after reading.
        ``wait_s``: wait up to that long for blocks after the prefix that are being written (``KVStore.get``)."""
        request = pb.GetRequest(
            keys=keys, lease_ttl_s=lease_ttl_s, block_bytes=self.block_bytes, owner=self.owner, wait_s=wait_s
        )
        return self._call("Get", request, timeout=self.timeout_s + wait_s if wait_s else None)

    def release(self, lease_id: str, wait: bool = True) -> None:
        """End a lease. ``wait=False`` does not wait for the answer on the fast path (an unknown lease is then not
        reported)."""
        self._call("Release", pb.ReleaseRequest(lease_id=lease_id), oneway=not wait and self._control is not None)

    def release_owner(self, owner: str | None = None) -> tuple[int, int]:
        """End every lease and abort every reservation ``owner`` (default: this client's) holds on the node.

        Returns (leases, reservations) released. A worker calls it once at start, for what a
        killed predecessor under its id left behind; the aborted reservations' slots are
        free at once. Raises ValueError when the owner is empty (the node refuses it).
        """
        got = self._call("ReleaseOwner", pb.ReleaseOwnerRequest(owner=self.owner if owner is None else owner))
        return got.leases, got.reservations

    def pin(self, keys: Sequence[bytes], pinned: bool = True) -> int:
        return self._call("Pin", pb.PinRequest(keys=keys, pinned=pinned)).changed

    def pull(self, peer: str, keys: Sequence[bytes], timeout_s: float | None = None) -> pb.PullResponse:
        """Ask this node to copy the prefix of ``keys`` that node ``peer`` (a gRPC address) holds."""
        return self._call("Pull", pb.PullRequest(peer=peer, keys=keys), timeout_s)

    def subscribe(self, from_seq: int = 0, snapshot: bool = False) -> Iterator[pb.EventBatch]:
        """Stream the node's events from ``from_seq`` (blocks; cancel by closing the client)."""
        try:
            yield from self._stub.Subscribe(pb.SubscribeRequest(from_seq=from_seq, snapshot=snapshot))
        except grpc.RpcError as e:
            if e.code() is not grpc.StatusCode.CANCELLED:
                _raise(e.code(), e.details())

    # -- data calls (control + transfer) --------------------------------------------

    def _segment(self, msg: pb.SegmentInfo) -> Segment:
        """The node's DRAM segment as the engine knows it (converted and taught once per segment and owner)."""
        seg = self._segments.get(msg.name)
        if seg is None or seg.pid != msg.pid or seg.tcp_addr != (msg.tcp_addr or None):
            seg = self._segments[msg.name] = segment_from_pb(msg)
            self.engine.add_segment(seg)
        return seg

    def put(
        self, keys: Sequence[bytes], data, positions: Sequence[int] | None = None, parent: bytes | None = None
    ) -> PutResult:
        """Store ``len(keys)`` blocks from ``data`` (block i at ``i * block_bytes``)."""
        view = memoryview(data).cast("B")
        bb = self.block_bytes
        if len(view) != len(keys) * bb:
            raise ValueError(f"{len(view)} bytes for {len(keys)} blocks of {bb} bytes")
        res = self.reserve(keys, positions, parent=parent)
        try:
            if res.slots:
                seg = self._segment(res.segment)
                index = {bytes(k): i for i, k in enumerate(keys)}
                slices = [Slice(index[s.key] * bb, seg.name, s.offset, bb, res.reservation_id) for s in res.slots]
                self.engine.write(view, slices).wait(self.engine.config.io_timeout_s)
        except BaseException:
            try:
                self.abort(res.reservation_id)
            except (KeyError, KVStoreUnavailable):
                pass  # the reservation times out on the node
            raise
        self.commit(res.reservation_id)
        return PutResult(len(res.slots), len(res.existing))

    def get(self, keys: Sequence[bytes], out=None) -> ReadResult:
        """Read the longest stored prefix of ``keys`` into ``out`` (or a new buffer)."""
        got = self.get_locations(keys)
        bb = self.block_bytes
        try:
            n = len(got.slots)
            view = memoryview(out).cast("B") if out is not None else memoryview(bytearray(n * bb))
            if len(view) < n * bb:
                raise ValueError(f"output buffer of {len(view)} bytes cannot hold {n} blocks of {bb}")
            if n:
                seg = self._segment(got.segment)
                slices = [Slice(i * bb, seg.name, s.offset, bb, got.lease_id) for i, s in enumerate(got.slots)]
                self.engine.read(view, slices).wait(self.engine.config.io_timeout_s)
        finally:
            try:
                self.release(got.lease_id, wait=False)
            except (KeyError, KVStoreUnavailable):
                pass  # expired or node gone: nothing left to free
        return ReadResult(n, view[: n * bb], got.dram_hits, got.ssd_hits, [bytes(k) for k in got.corrupt])

    def close(self) -> None:
        if self._control is not None:
            self._control.close()
        self._channel.close()
        if self._own_engine:
            self.engine.close()

    def __enter__(self) -> "KVStoreClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["KVStoreClient", "KVStoreUnavailable", "PutResult", "ReadResult", "StoreFull", "TransferError"]
