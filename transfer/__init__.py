"""Transfer engine: one-sided batched reads/writes between registered memory segments (shm, tcp, rdma)."""

from transfer.batch import TransferBatch
from transfer.engine import TransferConfig, TransferEngine, TransportChoice, add_transport_args
from transfer.region import SharedRegion
from transfer.registry import MemoryRegistry, RedisRegistry, SegmentRegistry, make_registry
from transfer.types import BackendKind, OpKind, Segment, Slice, TransferError, TransferState, host_id

__all__ = [
    "BackendKind",
    "MemoryRegistry",
    "OpKind",
    "RedisRegistry",
    "Segment",
    "SegmentRegistry",
    "SharedRegion",
    "Slice",
    "TransferBatch",
    "TransferConfig",
    "TransferEngine",
    "TransferError",
    "TransferState",
    "TransportChoice",
    "add_transport_args",
    "host_id",
    "make_registry",
]
