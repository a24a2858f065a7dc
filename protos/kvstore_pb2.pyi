from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Tier(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TIER_UNSPECIFIED: _ClassVar[Tier]
    DRAM: _ClassVar[Tier]
    SSD: _ClassVar[Tier]
TIER_UNSPECIFIED: Tier
DRAM: Tier
SSD: Tier

class SegmentInfo(_message.Message):
    __slots__ = ("name", "node", "size", "host", "pid", "shm_path", "tcp_addr", "rdma", "rdma_rkey", "rdma_addr")
    NAME_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    SHM_PATH_FIELD_NUMBER: _ClassVar[int]
    TCP_ADDR_FIELD_NUMBER: _ClassVar[int]
    RDMA_FIELD_NUMBER: _ClassVar[int]
    RDMA_RKEY_FIELD_NUMBER: _ClassVar[int]
    RDMA_ADDR_FIELD_NUMBER: _ClassVar[int]
    name: str
    node: str
    size: int
    host: str
    pid: int
    shm_path: str
    tcp_addr: str
    rdma: bool
    rdma_rkey: int
    rdma_addr: int
    def __init__(self, name: _Optional[str] = ..., node: _Optional[str] = ..., size: _Optional[int] = ..., host: _Optional[str] = ..., pid: _Optional[int] = ..., shm_path: _Optional[str] = ..., tcp_addr: _Optional[str] = ..., rdma: _Optional[bool] = ..., rdma_rkey: _Optional[int] = ..., rdma_addr: _Optional[int] = ...) -> None: ...

class SlotLocation(_message.Message):
    __slots__ = ("key", "offset", "length")
    KEY_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    key: bytes
    offset: int
    length: int
    def __init__(self, key: _Optional[bytes] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ...) -> None: ...

class ReserveRequest(_message.Message):
    __slots__ = ("keys", "positions", "block_bytes", "ttl_s", "owner", "parent")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    PARENT_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    positions: _containers.RepeatedScalarFieldContainer[int]
    block_bytes: int
    ttl_s: float
    owner: str
    parent: bytes
    def __init__(self, keys: _Optional[_Iterable[bytes]] = ..., positions: _Optional[_Iterable[int]] = ..., block_bytes: _Optional[int] = ..., ttl_s: _Optional[float] = ..., owner: _Optional[str] = ..., parent: _Optional[bytes] = ...) -> None: ...

class ReserveResponse(_message.Message):
    __slots__ = ("reservation_id", "segment", "slots", "existing")
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    EXISTING_FIELD_NUMBER: _ClassVar[int]
    reservation_id: str
    segment: SegmentInfo
    slots: _containers.RepeatedCompositeFieldContainer[SlotLocation]
    existing: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, reservation_id: _Optional[str] = ..., segment: _Optional[_Union[SegmentInfo, _Mapping]] = ..., slots: _Optional[_Iterable[_Union[SlotLocation, _Mapping]]] = ..., existing: _Optional[_Iterable[bytes]] = ...) -> None: ...

class CommitRequest(_message.Message):
    __slots__ = ("reservation_id",)
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    reservation_id: str
    def __init__(self, reservation_id: _Optional[str] = ...) -> None: ...

class CommitResponse(_message.Message):
    __slots__ = ("stored", "deduplicated")
    STORED_FIELD_NUMBER: _ClassVar[int]
    DEDUPLICATED_FIELD_NUMBER: _ClassVar[int]
    stored: int
    deduplicated: int
    def __init__(self, stored: _Optional[int] = ..., deduplicated: _Optional[int] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("reservation_id",)
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    reservation_id: str
    def __init__(self, reservation_id: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("keys",)
    KEYS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("prefix_blocks", "tiers")
    PREFIX_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    prefix_blocks: int
    tiers: _containers.RepeatedScalarFieldContainer[Tier]
    def __init__(self, prefix_blocks: _Optional[int] = ..., tiers: _Optional[_Iterable[_Union[Tier, str]]] = ...) -> None: ...

class GetRequest(_message.Message):
    __slots__ = ("keys", "lease_ttl_s", "block_bytes", "owner", "wait_s")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_S_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    WAIT_S_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    lease_ttl_s: float
    block_bytes: int
    owner: str
    wait_s: float
    def __init__(self, keys: _Optional[_Iterable[bytes]] = ..., lease_ttl_s: _Optional[float] = ..., block_bytes: _Optional[int] = ..., owner: _Optional[str] = ..., wait_s: _Optional[float] = ...) -> None: ...

class GetResponse(_message.Message):
    __slots__ = ("lease_id", "segment", "slots", "corrupt", "dram_hits", "ssd_hits")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    CORRUPT_FIELD_NUMBER: _ClassVar[int]
    DRAM_HITS_FIELD_NUMBER: _ClassVar[int]
    SSD_HITS_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    segment: SegmentInfo
    slots: _containers.RepeatedCompositeFieldContainer[SlotLocation]
    corrupt: _containers.RepeatedScalarFieldContainer[bytes]
    dram_hits: int
    ssd_hits: int
    def __init__(self, lease_id: _Optional[str] = ..., segment: _Optional[_Union[SegmentInfo, _Mapping]] = ..., slots: _Optional[_Iterable[_Union[SlotLocation, _Mapping]]] = ..., corrupt: _Optional[_Iterable[bytes]] = ..., dram_hits: _Optional[int] = ..., ssd_hits: _Optional[int] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("lease_id",)
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    def __init__(self, lease_id: _Optional[str] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReleaseOwnerRequest(_message.Message):
    __slots__ = ("owner",)
    OWNER_FIELD_NUMBER: _ClassVar[int]
    owner: str
    def __init__(self, owner: _Optional[str] = ...) -> None: ...

class ReleaseOwnerResponse(_message.Message):
    __slots__ = ("leases", "reservations")
    LEASES_FIELD_NUMBER: _ClassVar[int]
    RESERVATIONS_FIELD_NUMBER: _ClassVar[int]
    leases: int
    reservations: int
    def __init__(self, leases: _Optional[int] = ..., reservations: _Optional[int] = ...) -> None: ...

class PinRequest(_message.Message):
    __slots__ = ("keys", "pinned")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    pinned: bool
    def __init__(self, keys: _Optional[_Iterable[bytes]] = ..., pinned: _Optional[bool] = ...) -> None: ...

class PinResponse(_message.Message):
    __slots__ = ("changed",)
    CHANGED_FIELD_NUMBER: _ClassVar[int]
    changed: int
    def __init__(self, changed: _Optional[int] = ...) -> None: ...

class PullRequest(_message.Message):
    __slots__ = ("peer", "keys")
    PEER_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    peer: str
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, peer: _Optional[str] = ..., keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class PullResponse(_message.Message):
    __slots__ = ("pulled", "already", "missing")
    PULLED_FIELD_NUMBER: _ClassVar[int]
    ALREADY_FIELD_NUMBER: _ClassVar[int]
    MISSING_FIELD_NUMBER: _ClassVar[int]
    pulled: int
    already: int
    missing: int
    def __init__(self, pulled: _Optional[int] = ..., already: _Optional[int] = ..., missing: _Optional[int] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TierStats(_message.Message):
    __slots__ = ("capacity_blocks", "used_blocks", "reserved_blocks", "hits", "evictions")
    CAPACITY_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    USED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    RESERVED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    capacity_blocks: int
    used_blocks: int
    reserved_blocks: int
    hits: int
    evictions: int
    def __init__(self, capacity_blocks: _Optional[int] = ..., used_blocks: _Optional[int] = ..., reserved_blocks: _Optional[int] = ..., hits: _Optional[int] = ..., evictions: _Optional[int] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("node", "block_bytes", "eviction", "dram", "ssd", "leases", "reservations", "corrupt_blocks", "adopted_blocks", "event_seq", "segment", "control_port", "control_uds")
    NODE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    EVICTION_FIELD_NUMBER: _ClassVar[int]
    DRAM_FIELD_NUMBER: _ClassVar[int]
    SSD_FIELD_NUMBER: _ClassVar[int]
    LEASES_FIELD_NUMBER: _ClassVar[int]
    RESERVATIONS_FIELD_NUMBER: _ClassVar[int]
    CORRUPT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    ADOPTED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    EVENT_SEQ_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    CONTROL_PORT_FIELD_NUMBER: _ClassVar[int]
    CONTROL_UDS_FIELD_NUMBER: _ClassVar[int]
    node: str
    block_bytes: int
    eviction: str
    dram: TierStats
    ssd: TierStats
    leases: int
    reservations: int
    corrupt_blocks: int
    adopted_blocks: int
    event_seq: int
    segment: SegmentInfo
    control_port: int
    control_uds: str
    def __init__(self, node: _Optional[str] = ..., block_bytes: _Optional[int] = ..., eviction: _Optional[str] = ..., dram: _Optional[_Union[TierStats, _Mapping]] = ..., ssd: _Optional[_Union[TierStats, _Mapping]] = ..., leases: _Optional[int] = ..., reservations: _Optional[int] = ..., corrupt_blocks: _Optional[int] = ..., adopted_blocks: _Optional[int] = ..., event_seq: _Optional[int] = ..., segment: _Optional[_Union[SegmentInfo, _Mapping]] = ..., control_port: _Optional[int] = ..., control_uds: _Optional[str] = ...) -> None: ...

class SubscribeRequest(_message.Message):
    __slots__ = ("from_seq", "snapshot")
    FROM_SEQ_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    from_seq: int
    snapshot: bool
    def __init__(self, from_seq: _Optional[int] = ..., snapshot: _Optional[bool] = ...) -> None: ...

class Event(_message.Message):
    __slots__ = ("seq", "kind", "key", "tier", "time", "parent", "parent_known")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        KIND_UNSPECIFIED: _ClassVar[Event.Kind]
        STORED: _ClassVar[Event.Kind]
        REMOVED: _ClassVar[Event.Kind]
    KIND_UNSPECIFIED: Event.Kind
    STORED: Event.Kind
    REMOVED: Event.Kind
    SEQ_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    TIME_FIELD_NUMBER: _ClassVar[int]
    PARENT_FIELD_NUMBER: _ClassVar[int]
    PARENT_KNOWN_FIELD_NUMBER: _ClassVar[int]
    seq: int
    kind: Event.Kind
    key: bytes
    tier: Tier
    time: float
    parent: bytes
    parent_known: bool
    def __init__(self, seq: _Optional[int] = ..., kind: _Optional[_Union[Event.Kind, str]] = ..., key: _Optional[bytes] = ..., tier: _Optional[_Union[Tier, str]] = ..., time: _Optional[float] = ..., parent: _Optional[bytes] = ..., parent_known: _Optional[bool] = ...) -> None: ...

class EventBatch(_message.Message):
    __slots__ = ("node", "events", "reset", "next_seq")
    NODE_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    RESET_FIELD_NUMBER: _ClassVar[int]
    NEXT_SEQ_FIELD_NUMBER: _ClassVar[int]
    node: str
    events: _containers.RepeatedCompositeFieldContainer[Event]
    reset: bool
    next_seq: int
    def __init__(self, node: _Optional[str] = ..., events: _Optional[_Iterable[_Union[Event, _Mapping]]] = ..., reset: _Optional[bool] = ..., next_seq: _Optional[int] = ...) -> None: ...
