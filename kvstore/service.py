"""A pool node as a process: the block store, its DRAM segment, and the gRPC control service.

:class:`KVStoreNode` wires a :class:`~kvstore.store.BlockStore` to a transfer engine (its
DRAM tier *is* a shared-memory transfer segment, so writers on the same host copy
straight into it and remote writers ``recv_into`` it) and runs the housekeeping thread
that expires leases and reservations. :class:`KVStoreServicer` is the thin gRPC adapter
(its hot methods are also served by the control fast path, :mod:`kvstore.control`):
it translates messages and maps errors to status codes (bad input INVALID_ARGUMENT,
unknown reservation or lease NOT_FOUND, full store RESOURCE_EXHAUSTED, an unreachable
peer UNAVAILABLE).
"""

from __future__ import annotations

import functools
import logging
import threading
from concurrent import futures
from dataclasses import dataclass

import grpc

from kvstore.config import StoreConfig
from kvstore.control import METHODS
from kvstore.errors import KVSTORE_STATUS, KVStoreUnavailable
from kvstore.ssd import SsdTier
from kvstore.store import BlockStore
from kvstore.wire import GRPC_OPTIONS, KIND_TO_PB, TIER_TO_PB, segment_from_pb, segment_to_pb
from mooncake import tls
from mooncake.runtime.channels import SERVER_OPTIONS
from mooncake.runtime.framed import ControlServer
from protos import kvstore_pb2 as pb
from protos import kvstore_pb2_grpc as pb_grpc
from transfer import Slice, TransferConfig, TransferEngine
from transfer.registry import SegmentRegistry

log = logging.getLogger(__name__)


class KVStoreNode:
    """A running pool node: store + DRAM segment + housekeeping. Call :meth:`close` to stop."""

    def __init__(self, config: StoreConfig, transfer: TransferConfig, registry: SegmentRegistry | None = None) -> None:
        self.config = config
        self.engine = TransferEngine(transfer, registry)
        self.store: BlockStore | None = None
        # over tcp, a peer touches only the slots a lease or reservation of this node granted it (BlockStore.authorize)
        self.segment = self.engine.allocate("dram", config.dram_blocks * config.block_bytes, guard=self._authorize)
        ssd = None
        if config.ssd_dir:
            ssd = SsdTier(
                config.ssd_dir, config.block_bytes, config.ssd_blocks, config.ssd_file_blocks, config.ssd_fsync
            )
        self.store = BlockStore(config, self.engine.buffer(self.segment.name), ssd)
        self._stop = threading.Event()
        self._peers: dict = {}  # gRPC address -> KVStoreClient: the nodes this one pulls from (``pull``)
        self._peers_lock = threading.Lock()
        self._housekeeper = threading.Thread(target=self._housekeep, name="kvstore-expire", daemon=True)
        self._housekeeper.start()

    def _housekeep(self) -> None:
        while not self._stop.wait(0.5):
            try:
                self.store.expire()
            except Exception:  # keep expiring; a bug here must not silently stop it
                log.exception("lease/reservation expiry failed")

    def _authorize(self, token: str, write: bool, offset: int, length: int) -> str | None:
        if self.store is None:
            return "the node is starting"
        return self.store.authorize(token, write, offset, length)

    def pull(self, peer: str, keys: list[bytes]) -> tuple[int, int, int]:
        """Copy the longest prefix of ``keys`` stored on ``peer`` into this node; return (pulled, already, missing)."""
        client = self._peer(peer)
        try:
            got = client.get_locations(keys)
        except KVStoreUnavailable:
            with self._peers_lock:  # connect again next time
                if self._peers.get(peer) is client:
                    del self._peers[peer]
            raise
        try:
            remote = segment_from_pb(got.segment)
            self.engine.add_segment(remote)
            found = [s.key for s in got.slots]
            res = self.store.reserve(found)
            try:
                where = {s.key: s for s in got.slots}
                bb = self.config.block_bytes
                slices = [Slice(slot * bb, remote.name, where[key].offset, bb, got.lease_id) for key, slot in res.slots]
                self.engine.read(self.segment.name, slices).wait(self.engine.config.io_timeout_s)
            except BaseException:
                self.store.abort(res.reservation_id)
                raise
            stored, _ = self.store.commit(res.reservation_id)
        finally:
            client.release(got.lease_id)
        return stored, len(res.existing), len(keys) - len(found)

    def _peer(self, address: str):
        """This node's client of the node at ``address`` (one per peer: a node leaving hands over its chains one Pull
        each)."""
        from kvstore.client import KVStoreClient  # the node is a client of its peer

        with self._peers_lock:
            client = self._peers.get(address)
            if client is None:
                client = self._peers[address] = KVStoreClient(address, engine=self.engine)
            return client

    def close(self) -> None:
        self._stop.set()
        with self._peers_lock:
            peers, self._peers = list(self._peers.values()), {}
        for client in peers:
            client.close()
        self.store.close()
        self.engine.close()


def _status(fn):
    """Answer the store's exceptions with their status codes (kvstore/errors.py); a peer's failed call during Pull
    with its own code."""

    answered = KVSTORE_STATUS.servicer(fn)

    @functools.wraps(fn)
    def wrapper(self, request, context):
        try:
            return answered(self, request, context)
        except grpc.RpcError as e:
            code = e.code() if hasattr(e, "code") else grpc.StatusCode.UNAVAILABLE
            context.abort(code, f"peer: {e.details() if hasattr(e, 'details') else e}")

    return wrapper


class KVStoreServicer(pb_grpc.KVStoreServicer):
    """gRPC adapter over a :class:`KVStoreNode`."""

    def __init__(self, node: KVStoreNode) -> None:
        self.node = node
        self.store = node.store
        self.seg = segment_to_pb(node.segment)
        self.bb = node.config.block_bytes
        self.control_port = 0  # set by start_server once the control fast path listens
        self.control_uds = ""

    def _slots(self, pairs) -> list[pb.SlotLocation]:
        return [pb.SlotLocation(key=k, offset=slot * self.bb, length=self.bb) for k, slot in pairs]

    @_status
    def Reserve(self, request, context):
        self.store.check_block_bytes(request.block_bytes)
        res = self.store.reserve(
            list(request.keys),
            list(request.positions) or None,
            request.ttl_s or None,
            request.owner,
            bytes(request.parent) or None,
        )
        return pb.ReserveResponse(
            reservation_id=res.reservation_id, segment=self.seg, slots=self._slots(res.slots), existing=res.existing
        )

    @_status
    def Commit(self, request, context):
        stored, dup = self.store.commit(request.reservation_id)
        return pb.CommitResponse(stored=stored, deduplicated=dup)

    @_status
    def Abort(self, request, context):
        self.store.abort(request.reservation_id)
        return pb.AbortResponse()

    @_status
    def Lookup(self, request, context):
        res = self.store.lookup(list(request.keys))
        return pb.LookupResponse(prefix_blocks=res.prefix_blocks, tiers=[TIER_TO_PB[t] for t in res.tiers])

    @_status
    def Get(self, request, context):
        self.store.check_block_bytes(request.block_bytes)
        res = self.store.get(list(request.keys), request.lease_ttl_s or None, request.owner, request.wait_s)
        return pb.GetResponse(
            lease_id=res.lease_id,
            segment=self.seg,
            slots=self._slots(res.slots),
            corrupt=res.corrupt,
            dram_hits=res.dram_hits,
            ssd_hits=res.ssd_hits,
        )

    @_status
    def Release(self, request, context):
        self.store.release(request.lease_id)
        return pb.ReleaseResponse()

    @_status
    def ReleaseOwner(self, request, context):
        leases, reservations = self.store.release_owner(request.owner)
        return pb.ReleaseOwnerResponse(leases=leases, reservations=reservations)

    @_status
    def Pin(self, request, context):
        return pb.PinResponse(changed=self.store.pin(list(request.keys), request.pinned))

    @_status
    def Pull(self, request, context):
        if not request.peer:
            raise ValueError("Pull needs the peer's address")
        pulled, already, missing = self.node.pull(request.peer, list(request.keys))
        return pb.PullResponse(pulled=pulled, already=already, missing=missing)

    @_status
    def Stats(self, request, context):
        s = self.store.stats()

        def tier(t):
            return pb.TierStats(
                capacity_blocks=t.capacity_blocks,
                used_blocks=t.used_blocks,
                reserved_blocks=t.reserved_blocks,
                hits=t.hits,
                evictions=t.evictions,
            )

        return pb.StatsResponse(
            node=s.node,
            block_bytes=s.block_bytes,
            eviction=s.eviction,
            dram=tier(s.dram),
            ssd=tier(s.ssd),
            leases=s.leases,
            reservations=s.reservations,
            corrupt_blocks=s.corrupt_blocks,
            adopted_blocks=s.adopted_blocks,
            event_seq=s.event_seq,
            segment=self.seg,
            control_port=self.control_port,
            control_uds=self.control_uds,
        )

    def Subscribe(self, request, context):
        node = self.node.config.node
        seq = max(1, request.from_seq)
        first = True
        while context.is_active():
            events, lost = self.store.events.read(seq, timeout=0.5)
            if (first and request.snapshot) or lost:
                blocks, seq = self.store.snapshot()
                yield pb.EventBatch(
                    node=node,
                    reset=True,
                    next_seq=seq,
                    events=[
                        pb.Event(
                            seq=0,
                            kind=pb.Event.STORED,
                            key=k,
                            tier=TIER_TO_PB[t],
                            parent=p or b"",
                            parent_known=p is not None,
                        )
                        for k, t, p in blocks
                    ],
                )
                first = False
                continue
            first = False
            if events:
                seq = events[-1].seq + 1
                yield pb.EventBatch(
                    node=node,
                    next_seq=seq,
                    events=[
                        pb.Event(
                            seq=e.seq,
                            kind=KIND_TO_PB[e.kind],
                            key=e.key,
                            tier=TIER_TO_PB[e.tier],
                            time=e.time,
                            parent=e.parent or b"",
                            parent_known=e.parent is not None,
                        )
                        for e in events
                    ],
                )


@dataclass
class Service:
    """A node's running services: gRPC (every call) and the control fast path (the hot calls)."""

    grpc_server: grpc.Server
    grpc_port: int
    control: ControlServer

    def stop(self, grace: float = 2.0) -> None:
        self.control.close()
        self.grpc_server.stop(grace=grace).wait()


def start_server(
    node: KVStoreNode,
    host: str = "127.0.0.1",
    port: int = 0,
    workers: int = 32,
    control_port: int = 0,
    control_uds: str | None = None,
) -> Service:
    """Start the gRPC service and the control fast path (tcp ``control_port``, Unix socket ``control_uds``) for
    ``node``."""
    servicer = KVStoreServicer(node)
    control = ControlServer(servicer, METHODS, host, control_port, control_uds, name="kvstore-control")
    servicer.control_port, servicer.control_uds = control.port, control_uds or ""
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kvstore-rpc"),
        options=GRPC_OPTIONS + list(SERVER_OPTIONS),
    )
    pb_grpc.add_KVStoreServicer_to_server(servicer, server)
    bound = tls.grpc_add_port(server, f"{host}:{port}")
    if bound == 0:
        control.close()
        raise ValueError(f"cannot bind the kvstore gRPC service to {host}:{port}")
    server.start()
    return Service(server, bound, control)
