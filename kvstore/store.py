"""The block store of one pool node: which block is where, who may evict what, and when.

Owns the index (key -> entry), the two tiers' slot allocators and eviction policies,
reservations (the first phase of a put), leases and pins, and the event log. Each lease
and reservation remembers its owner (a worker's instance id), so a restarted worker can
hand back at once what its killed predecessor held. Bytes live in the DRAM tier's memory
(a transfer segment other processes write into directly) and in the
:class:`~kvstore.ssd.SsdTier`; the store only copies them when it demotes to SSD or
promotes back. Thread-safe (one lock); the gRPC service is a thin adapter over it.

Life of a block::

    reserve -> (caller writes the slot) -> commit -> DRAM --evict--> SSD --evict--> gone
                                  abort / timeout -> slot freed     <--hit (promote)--

A reserved slot is invisible until committed, so a half-written block is never served.
Leased and pinned blocks are never evicted. When DRAM use passes the high watermark
after a commit, blocks are demoted until it is back at the low watermark; a reservation
that finds no free slot evicts what it needs first or fails with :class:`StoreFull`,
without touching anything.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvstore.config import StoreConfig
from kvstore.events import EventKind, EventLog, Tier
from kvstore.eviction import EvictionPolicy, make_policy
from kvstore.records import (
    Entry,
    GetResult,
    Lease,
    LookupResult,
    Reservation,
    ReserveResult,
    StoreFull,
    StoreStats,
    TierCounters,
    TierStats,
)
from kvstore.ssd import CorruptBlock, SsdTier
from mooncake.blocks import KEY_BYTES

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Free:
    """A tier's free slots: lowest first, so a fresh store fills from the start."""

    capacity: int
    free: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.free = list(range(self.capacity - 1, -1, -1))

    def take(self) -> int:
        return self.free.pop()

    def give(self, slot: int) -> None:
        self.free.append(slot)

    def claim(self, slot: int) -> None:
        self.free.remove(slot)


class BlockStore:
    """The index, tiers, reservations, leases and events of one node.

    ``dram`` is the DRAM tier's memory (``config.dram_blocks * config.block_bytes``
    bytes; a shared-memory segment in a node, a bytearray in unit tests). ``ssd`` is
    the SSD tier or None. Construct with both in memory for fast tests.
    """

    def __init__(self, config: StoreConfig, dram: memoryview, ssd: SsdTier | None = None) -> None:
        view = memoryview(dram).cast("B")
        if len(view) < config.dram_blocks * config.block_bytes:
            raise ValueError(
                f"DRAM buffer is {len(view)} bytes; {config.dram_blocks} blocks need "
                f"{config.dram_blocks * config.block_bytes}"
            )
        self.config = config
        self.block_bytes = config.block_bytes
        self.dram = view
        self.ssd = ssd
        self._entries: dict[bytes, Entry] = {}
        self._dram_free = _Free(config.dram_blocks)
        self._ssd_free = _Free(ssd.num_blocks if ssd else 0)
        self._dram_policy: EvictionPolicy = make_policy(config.eviction)
        self._ssd_policy: EvictionPolicy = make_policy(config.eviction)
        self._reservations: dict[str, Reservation] = {}
        self._leases: dict[str, Lease] = {}
        self._reserved_slots = 0  # slots held by reservations, and by expired ones in quarantine
        self._quarantine: deque[tuple[float, list[int]]] = deque()
        self._dram_count = TierCounters()
        self._ssd_count = TierCounters()
        self._corrupt = 0
        self._tick = itertools.count(1)
        self._lock = threading.RLock()
        self._settled = threading.Condition(self._lock)  # a reservation ended (committed, aborted, expired)
        self.events = EventLog(config.events_kept)
        self.adopted = self._adopt() if ssd else 0

    # -- helpers --------------------------------------------------------------------

    def _check_keys(self, keys: Sequence[bytes]) -> list[bytes]:
        out = [bytes(k) for k in keys]
        for k in out:
            if len(k) != KEY_BYTES:
                raise ValueError(f"a block key is {KEY_BYTES} bytes, got {len(k)}")
        return out

    def check_block_bytes(self, block_bytes: int) -> None:
        """Raise ValueError unless a caller's block size (0: unspecified) is this store's."""
        if block_bytes and block_bytes != self.block_bytes:
            raise ValueError(f"block size {block_bytes} does not match this store's {self.block_bytes} bytes")

    def slot_view(self, slot: int) -> memoryview:
        """The DRAM bytes of ``slot``."""
        return self.dram[slot * self.block_bytes : (slot + 1) * self.block_bytes]

    def _adopt(self) -> int:
        assert self.ssd is not None
        for block in self.ssd.adopt():
            self._ssd_free.claim(block.slot)
            self._entries[block.key] = Entry(block.key, block.position, block.parent, ssd_slot=block.slot)
            self._ssd_policy.insert(block.key, block.position, next(self._tick))
            self.events.append(EventKind.STORED, block.key, Tier.SSD, block.parent)
        count = len(self._entries)
        if count:
            log.info("re-adopted %d blocks from %s", count, self.ssd.dir)
        return count

    def _drop(self, entry: Entry) -> None:
        if entry.dram_slot is None and entry.ssd_slot is None:
            del self._entries[entry.key]

    # -- eviction -------------------------------------------------------------------

    def _dram_victims(self, count: int, protect: frozenset[bytes] = frozenset()) -> list[bytes]:
        def evictable(key: bytes) -> bool:
            e = self._entries[key]
            return e.leases == 0 and not e.pinned and key not in protect

        return self._dram_policy.victims(count, evictable)

    def _evict_dram(
        self, count: int, protect: frozenset[bytes] = frozenset(), victims: list[bytes] | None = None
    ) -> int:
        """Demote up to ``count`` DRAM blocks (to SSD when there is one); return how many left DRAM."""
        if victims is None:
            victims = self._dram_victims(count, protect)
        for key in victims:
            entry = self._entries[key]
            slot = entry.dram_slot
            if self.ssd is not None and entry.ssd_slot is None:
                self._demote(entry)
            self._dram_policy.remove(key)
            entry.dram_slot = None
            self._dram_free.give(slot)
            self._dram_count.evictions += 1
            self.events.append(EventKind.REMOVED, key, Tier.DRAM)
            self._drop(entry)
        return len(victims)

    def _demote(self, entry: Entry) -> None:
        assert self.ssd is not None and entry.dram_slot is not None
        if not self._ssd_free.free and not self._evict_ssd(1):
            return  # SSD full of protected blocks: the block is simply dropped from DRAM
        slot = self._ssd_free.take()
        try:
            self.ssd.write(slot, entry.key, self.slot_view(entry.dram_slot), entry.parent, entry.position)
        except OSError as e:
            log.error("SSD write failed, block %s dropped: %s", entry.key.hex(), e)
            self._ssd_free.give(slot)
            return
        entry.ssd_slot = slot
        self._ssd_policy.insert(entry.key, entry.position, next(self._tick))
        self.events.append(EventKind.STORED, entry.key, Tier.SSD, entry.parent)

    def _evict_ssd(self, count: int) -> int:
        victims = self._ssd_policy.victims(count, lambda key: not self._entries[key].pinned)
        for key in victims:
            self._remove_ssd(self._entries[key])
            self._ssd_count.evictions += 1
        return len(victims)

    def _remove_ssd(self, entry: Entry) -> None:
        assert self.ssd is not None and entry.ssd_slot is not None
        self.ssd.invalidate(entry.ssd_slot)
        self._ssd_free.give(entry.ssd_slot)
        self._ssd_policy.remove(entry.key)
        entry.ssd_slot = None
        self.events.append(EventKind.REMOVED, entry.key, Tier.SSD)
        self._drop(entry)

    def _take_dram(self, count: int, protect: frozenset[bytes] = frozenset()) -> list[int]:
        short = count - len(self._dram_free.free)
        if short > 0:
            victims = self._dram_victims(short, protect)
            if len(victims) < short:  # refuse before evicting anything
                raise StoreFull(
                    f"need {count} DRAM slots; {len(self._dram_free.free)} are free and only {len(victims)} more can "
                    f"be freed (the rest are leased, pinned or reserved)"
                )
            self._evict_dram(short, victims=victims)
        return [self._dram_free.take() for _ in range(count)]

    def _after_insert(self) -> None:
        used = self.config.dram_blocks - len(self._dram_free.free)
        if used > self.config.high_watermark * self.config.dram_blocks:
            self._evict_dram(used - int(self.config.low_watermark * self.config.dram_blocks))

    # -- two-phase put --------------------------------------------------------------

    def reserve(
        self,
        keys: Sequence[bytes],
        positions: Sequence[int] | None = None,
        ttl_s: float | None = None,
        owner: str = "",
        parent: bytes | None = None,
    ) -> ReserveResult:
        """Reserve DRAM slots for the keys not yet stored; the caller writes them, then commits.

        ``positions`` are the blocks' indices in their key chains (default: 0..n-1),
        used by the length-aware policy and, with ``parent`` (the key before ``keys[0]``
        in its chain, when ``positions[0] > 0``), to record each block's parent for the
        Conductor's index: a key's parent is the key before it here when their positions
        follow on, none for position 0, else unknown (the block then never counts in the
        index, conductor/index.py). ``owner`` (a worker's instance id) lets
        :meth:`release_owner` abort it. Raises ``StoreFull`` when the slots cannot be
        found, ``ValueError`` for bad keys.
        """
        keys = self._check_keys(keys)
        if len(set(keys)) != len(keys):
            raise ValueError("a reservation lists the same key twice")
        pos = list(positions) if positions else list(range(len(keys)))
        if len(pos) != len(keys):
            raise ValueError(f"{len(pos)} positions for {len(keys)} keys")
        if parent is not None and len(parent) != 16:
            raise ValueError(f"parent must be a 16-byte block key, not {len(parent)} bytes")
        parents = [
            b"" if p == 0 else keys[i - 1] if i and pos[i - 1] == p - 1 else parent if i == 0 else None
            for i, p in enumerate(pos)
        ]
        with self._lock:
            existing = [k for k in keys if k in self._entries]
            for key, position, parent_of in zip(keys, pos, parents):
                entry = self._entries.get(key)
                if entry is not None and entry.parent is None and parent_of is not None:
                    self._learn_parent(entry, parent_of, position)
            todo = [k for k in keys if k not in self._entries]
            slots = self._take_dram(len(todo))
            rid = uuid.uuid4().hex
            deadline = time.monotonic() + (ttl_s or self.config.reservation_ttl_s)
            self._reservations[rid] = Reservation(
                rid, dict(zip(todo, slots)), dict(zip(keys, zip(pos, parents))), deadline, owner, frozenset(slots)
            )
            self._reserved_slots += len(slots)
            return ReserveResult(rid, list(zip(todo, slots)), existing)

    def _learn_parent(self, entry: Entry, parent: bytes, position: int) -> None:
        """A stored block whose parent was not known (a v1 SSD header, a caller that did not say) learns it: the
        index hears it again, now with the parent, and can count it."""
        entry.parent, entry.position = parent, position
        for tier, slot in ((Tier.DRAM, entry.dram_slot), (Tier.SSD, entry.ssd_slot)):
            if slot is not None:
                self.events.append(EventKind.STORED, entry.key, tier, parent)

    def _pop_reservation(self, reservation_id: str) -> Reservation:
        res = self._reservations.pop(reservation_id, None)
        if res is None:
            raise KeyError(
                f"no reservation {reservation_id!r} (never made, already committed or aborted, or timed out)"
            )
        self._reserved_slots -= len(res.slots)
        self._settled.notify_all()
        return res

    def commit(self, reservation_id: str) -> tuple[int, int]:
        """Make a reservation's blocks visible; return (stored, deduplicated). Raises KeyError if unknown."""
        with self._lock:
            res = self._pop_reservation(reservation_id)
            stored = dup = 0
            for key, slot in res.slots.items():
                entry = self._entries.get(key)
                if entry is not None and entry.dram_slot is not None:
                    self._dram_free.give(slot)  # another put stored it meanwhile
                    dup += 1
                    continue
                position, parent = res.positions.get(key, (0, None))
                if entry is None:
                    entry = self._entries[key] = Entry(key, position, parent)
                elif entry.parent is None and parent is not None:  # stored meanwhile by a caller that did not say
                    self._learn_parent(entry, parent, position)
                entry.dram_slot = slot
                self._dram_policy.insert(key, entry.position, next(self._tick))
                self.events.append(EventKind.STORED, key, Tier.DRAM, entry.parent)
                stored += 1
            self._after_insert()
            return stored, dup

    def abort(self, reservation_id: str) -> None:
        """Free a reservation's slots. Raises KeyError if unknown."""
        with self._lock:
            res = self._pop_reservation(reservation_id)
            for slot in res.slots.values():
                self._dram_free.give(slot)

    def put(
        self, keys: Sequence[bytes], data, positions: Sequence[int] | None = None, parent: bytes | None = None
    ) -> tuple[int, int]:
        """Store blocks from this process's memory (reserve, copy, commit). Returns (stored, already there)."""
        view = memoryview(data).cast("B")
        if len(view) != len(keys) * self.block_bytes:
            raise ValueError(f"{len(view)} bytes for {len(keys)} blocks of {self.block_bytes}")
        res = self.reserve(keys, positions, parent=parent)
        index = {k: i for i, k in enumerate(self._check_keys(keys))}
        for key, slot in res.slots:
            i = index[key]
            self.slot_view(slot)[:] = view[i * self.block_bytes : (i + 1) * self.block_bytes]
        stored, _ = self.commit(res.reservation_id)
        return stored, len(res.existing)

    # -- reads ----------------------------------------------------------------------

    def lookup(self, keys: Sequence[bytes]) -> LookupResult:
        """Return the longest stored prefix of a key chain and each block's fastest tier. No side effects."""
        keys = self._check_keys(keys)
        tiers: list[Tier] = []
        with self._lock:
            for key in keys:
                entry = self._entries.get(key)
                if entry is None:
                    break
                tiers.append(Tier.DRAM if entry.dram_slot is not None else Tier.SSD)
        return LookupResult(len(tiers), tiers)

    def get(
        self, keys: Sequence[bytes], lease_ttl_s: float | None = None, owner: str = "", wait_s: float = 0.0
    ) -> GetResult:
        """Lease the longest stored prefix of ``keys`` in DRAM (promoting SSD blocks) and return its slots.

        The caller reads the slots (through the transfer engine or the shared memory)
        and then :meth:`release` s the lease; until then, until the lease times out, or
        until :meth:`release_owner` ends ``owner``'s leases, none of these blocks is
        evicted. A block whose SSD copy fails its checksum is dropped, reported in
        ``corrupt``, and ends the prefix. ``wait_s``: while the block after the prefix is
        being written (a reservation holds it: a prefill of the same prompt answered and
        writes its blocks now), wait up to that long for the write to end, rather than
        have the caller compute the block again.
        """
        keys = self._check_keys(keys)
        deadline = time.monotonic() + wait_s
        with self._lock:
            while True:
                prefix: list[Entry] = []
                for key in keys:
                    entry = self._entries.get(key)
                    if entry is None:
                        break
                    prefix.append(entry)
                left = deadline - time.monotonic()
                if len(prefix) == len(keys) or left <= 0 or not self._being_written(keys[len(prefix)]):
                    break
                self._settled.wait(left)
            for entry in prefix:
                entry.leases += 1  # nothing in the prefix may be evicted to make room for the rest
            corrupt: list[bytes] = []
            ssd_hits = 0
            for i, entry in enumerate(prefix):
                if entry.dram_slot is not None:
                    continue
                try:
                    self._promote(entry, frozenset(e.key for e in prefix))
                    ssd_hits += 1
                except CorruptBlock as e:
                    log.warning("corrupt block %s on SSD, dropped: %s", entry.key.hex(), e)
                    self._corrupt += 1
                    corrupt.append(entry.key)
                    entry.leases -= 1
                    self._remove_ssd(entry)
                    for later in prefix[i + 1 :]:
                        later.leases -= 1
                    prefix = prefix[:i]
                    break
                except StoreFull:
                    for later in prefix[i:]:
                        later.leases -= 1
                    prefix = prefix[:i]
                    break
            tick = next(self._tick)
            for entry in reversed(prefix):  # tail first: the head ends up most recent
                self._dram_policy.touch(entry.key, tick)
                if entry.ssd_slot is not None:
                    self._ssd_policy.touch(entry.key, tick)
            self._dram_count.hits += len(prefix) - ssd_hits
            self._ssd_count.hits += ssd_hits
            lid = uuid.uuid4().hex
            deadline = time.monotonic() + (lease_ttl_s or self.config.lease_ttl_s)
            self._leases[lid] = Lease(
                lid, [e.key for e in prefix], deadline, owner, frozenset(e.dram_slot for e in prefix)
            )
            return GetResult(lid, [(e.key, e.dram_slot) for e in prefix], corrupt, len(prefix) - ssd_hits, ssd_hits)

    def _being_written(self, key: bytes) -> bool:
        return any(key in r.slots for r in self._reservations.values())

    def authorize(self, token: str, write: bool, offset: int, length: int) -> str | None:
        """Whether ``token`` grants bytes ``[offset, offset + length)`` of the DRAM tier: None if so, else why not.

        A read needs a live lease (its id, from ``get``) on every slot the bytes touch, a
        write a live reservation (its id, from ``reserve``) of them: so a peer that can
        reach the node's transfer port still reads only blocks it was granted and writes
        only slots it reserved, and only until it releases, commits or aborts them (or
        they expire). A reservation also lets its holder read its slots back (a prefill
        group's stages read the blocks their worker pulled in before it commits them).
        The node's tcp server calls this for every request.
        """
        if length <= 0:
            return "an empty range"
        bb = self.block_bytes
        first, last = offset // bb, (offset + length - 1) // bb
        with self._lock:
            grant = (
                self._reservations.get(token) if write else (self._leases.get(token) or self._reservations.get(token))
            )
            if grant is None:
                what = "reservation" if write else "lease"
                return f"no live {what} with that token (a {what} id this node issued, not yet ended, is needed)"
            if not all(slot in grant.granted for slot in range(first, last + 1)):
                return f"slots {first}..{last} are not all held by that {'reservation' if write else 'lease'}"
        return None

    def _promote(self, entry: Entry, protect: frozenset[bytes]) -> None:
        assert self.ssd is not None and entry.ssd_slot is not None
        (slot,) = self._take_dram(1, protect)
        try:
            self.ssd.read(entry.ssd_slot, entry.key, self.slot_view(slot))
        except (CorruptBlock, OSError) as e:
            self._dram_free.give(slot)
            raise CorruptBlock(str(e)) from e
        entry.dram_slot = slot
        self._dram_policy.insert(entry.key, entry.position, next(self._tick))
        self.events.append(EventKind.STORED, entry.key, Tier.DRAM, entry.parent)

    def release(self, lease_id: str) -> None:
        """End a lease. Raises KeyError if unknown (never granted, released, or expired)."""
        with self._lock:
            lease = self._leases.pop(lease_id, None)
            if lease is None:
                raise KeyError(f"no lease {lease_id!r} (never granted, already released, or expired)")
            self._unlease(lease)
            self._after_insert()

    def release_owner(self, owner: str) -> tuple[int, int]:
        """End every lease and abort every reservation ``owner`` holds; return (leases, reservations).

        Called when a worker starts, with its instance id, so that what a killed
        predecessor under the same id held comes back now rather than when the TTLs run
        out (a reservation's is minutes long). Unlike an expired reservation's slots
        (:meth:`expire` quarantines those for a TTL, since their writer may still be
        sending), a released reservation's slots are free at once: the owner is a
        restarted process, so its old process, the only writer into those slots, is
        dead. That rests on instance ids being unique in the cluster. The released
        reservations can no longer be committed (KeyError). Scans every lease and
        reservation. Raises ValueError for an empty owner, which would release
        everyone's anonymous holdings.
        """
        if not owner:
            raise ValueError(
                "release_owner needs an owner (an empty one would release every anonymous lease and reservation)"
            )
        with self._lock:
            leases = [l for l in self._leases.values() if l.owner == owner]
            for lease in leases:
                del self._leases[lease.id]
                self._unlease(lease)
            reservations = [r.id for r in self._reservations.values() if r.owner == owner]
            for rid in reservations:
                for slot in self._pop_reservation(rid).slots.values():
                    self._dram_free.give(slot)
            if leases:
                self._after_insert()  # blocks the leases kept above the high watermark may go now
            if leases or reservations:
                log.info("released %d leases and %d reservations of %s", len(leases), len(reservations), owner)
            return len(leases), len(reservations)

    def _unlease(self, lease: Lease) -> None:
        for key in lease.keys:
            entry = self._entries.get(key)
            if entry is not None and entry.leases > 0:
                entry.leases -= 1

    def pin(self, keys: Sequence[bytes], pinned: bool = True) -> int:
        """Pin (or unpin) stored blocks so no eviction takes them; return how many changed."""
        keys = self._check_keys(keys)
        changed = 0
        with self._lock:
            for key in keys:
                entry = self._entries.get(key)
                if entry is not None and entry.pinned != pinned:
                    entry.pinned = pinned
                    changed += 1
        return changed

    def expire(self, now: float | None = None) -> tuple[int, int]:
        """Abort timed-out reservations and end timed-out leases; return how many of each. Called periodically."""
        now = time.monotonic() if now is None else now
        with self._lock:
            dead_res = [r.id for r in self._reservations.values() if r.deadline <= now]
            for rid in dead_res:
                # A writer that overran its reservation may still be sending into these slots:
                # keep them out of use for one more TTL before they can hold another block.
                res = self._pop_reservation(rid)
                self._quarantine.append((now + self.config.reservation_ttl_s, list(res.slots.values())))
                self._reserved_slots += len(res.slots)
            while self._quarantine and self._quarantine[0][0] <= now:
                _, slots = self._quarantine.popleft()
                self._reserved_slots -= len(slots)
                for slot in slots:
                    self._dram_free.give(slot)
            dead_leases = [l for l in self._leases.values() if l.deadline <= now]
            for lease in dead_leases:
                del self._leases[lease.id]
                self._unlease(lease)
            if dead_res or dead_leases:
                log.info("expired %d reservations and %d leases", len(dead_res), len(dead_leases))
            return len(dead_res), len(dead_leases)

    # -- introspection --------------------------------------------------------------

    def snapshot(self) -> tuple[list[tuple[bytes, Tier, bytes | None]], int]:
        """Every (block, tier, parent) stored now, and the sequence number the event stream continues from."""
        with self._lock:
            out = []
            for e in self._entries.values():
                if e.dram_slot is not None:
                    out.append((e.key, Tier.DRAM, e.parent))
                if e.ssd_slot is not None:
                    out.append((e.key, Tier.SSD, e.parent))
            return out, self.events.next_seq

    def stats(self) -> StoreStats:
        with self._lock:
            dram_used = self.config.dram_blocks - len(self._dram_free.free)
            ssd_cap = self.ssd.num_blocks if self.ssd else 0
            return StoreStats(
                node=self.config.node,
                block_bytes=self.block_bytes,
                eviction=self.config.eviction.value,
                dram=TierStats(
                    self.config.dram_blocks,
                    dram_used - self._reserved_slots,
                    self._reserved_slots,
                    self._dram_count.hits,
                    self._dram_count.evictions,
                ),
                ssd=TierStats(
                    ssd_cap, ssd_cap - len(self._ssd_free.free), 0, self._ssd_count.hits, self._ssd_count.evictions
                ),
                leases=len(self._leases),
                reservations=len(self._reservations),
                corrupt_blocks=self._corrupt,
                adopted_blocks=self.adopted,
                event_seq=self.events.next_seq - 1,
            )

    def close(self) -> None:
        self.events.wake()
        if self.ssd is not None:
            self.ssd.close()
