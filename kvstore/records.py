"""What a pool node's block store keeps and answers: an entry per block, reservations and leases with their owners
and grants, the results of its calls, its statistics, and the error of a node with nothing left to evict."""

from __future__ import annotations

from dataclasses import dataclass

from kvstore.events import Tier


class StoreFull(Exception):
    """No slot can be freed: everything is leased, pinned or reserved."""


@dataclass(slots=True)
class Entry:
    key: bytes
    position: int
    parent: bytes | None = None  # the block before it in its chain (b"": the chain's first; None: not known)
    dram_slot: int | None = None
    ssd_slot: int | None = None
    leases: int = 0
    pinned: bool = False


@dataclass(slots=True)
class Reservation:
    id: str
    slots: dict[bytes, int]  # key -> DRAM slot, for the keys the caller must write
    positions: dict[bytes, tuple[int, bytes | None]]  # key -> (position, parent)
    deadline: float
    owner: str = ""  # the worker that will write the slots ("": nobody in particular)
    granted: frozenset[int] = frozenset()  # the DRAM slots it lets its holder write (authorize)


@dataclass(slots=True)
class Lease:
    id: str
    keys: list[bytes]
    deadline: float
    owner: str = ""  # the worker reading the blocks ("": nobody in particular)
    granted: frozenset[int] = frozenset()  # the DRAM slots it lets its holder read (authorize)


@dataclass(frozen=True, slots=True)
class ReserveResult:
    reservation_id: str
    slots: list[tuple[bytes, int]]  # (key, DRAM slot) to write, in request order
    existing: list[bytes]  # keys already stored: nothing to write


@dataclass(frozen=True, slots=True)
class LookupResult:
    prefix_blocks: int  # the longest stored prefix of the chain
    tiers: list[Tier]  # the fastest tier of each block of that prefix


@dataclass(frozen=True, slots=True)
class GetResult:
    lease_id: str
    slots: list[tuple[bytes, int]]  # the prefix that is readable now, with its DRAM slots
    corrupt: list[bytes]  # blocks found corrupt (dropped; the prefix stops there)
    dram_hits: int
    ssd_hits: int  # of which promoted from SSD


@dataclass(slots=True)
class TierCounters:
    hits: int = 0
    evictions: int = 0


@dataclass(frozen=True, slots=True)
class TierStats:
    capacity_blocks: int
    used_blocks: int
    reserved_blocks: int
    hits: int
    evictions: int


@dataclass(frozen=True, slots=True)
class StoreStats:
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
