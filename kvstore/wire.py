"""The pool's wire conversions: what crosses gRPC as a message and what it is on each side.

The node's service, its client, the workers that hand landing segments to each other and the
tests all convert here, so a field added to ``SegmentInfo`` is added once.
"""

from __future__ import annotations

from kvstore.events import EventKind, Tier
from protos import kvstore_pb2 as pb
from transfer import Segment

# a Put or Get batch of blocks is one message; gRPC's 4 MiB default is too small for it
GRPC_OPTIONS = [("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)]

TIER_TO_PB = {Tier.DRAM: pb.DRAM, Tier.SSD: pb.SSD}
PB_TO_TIER = {v: k for k, v in TIER_TO_PB.items()}
KIND_TO_PB = {EventKind.STORED: pb.Event.STORED, EventKind.REMOVED: pb.Event.REMOVED}


def segment_to_pb(seg: Segment) -> pb.SegmentInfo:
    return pb.SegmentInfo(
        name=seg.name,
        node=seg.node,
        size=seg.size,
        host=seg.host,
        pid=seg.pid,
        shm_path=seg.shm_path or "",
        tcp_addr=seg.tcp_addr or "",
        rdma=seg.rdma_rkey is not None,
        rdma_rkey=seg.rdma_rkey or 0,
        rdma_addr=seg.rdma_addr,
    )


def segment_from_pb(msg: pb.SegmentInfo) -> Segment:
    return Segment(
        name=msg.name,
        node=msg.node,
        size=msg.size,
        host=msg.host,
        pid=msg.pid,
        shm_path=msg.shm_path or None,
        tcp_addr=msg.tcp_addr or None,
        rdma_rkey=msg.rdma_rkey if msg.rdma else None,
        rdma_addr=msg.rdma_addr,
    )
