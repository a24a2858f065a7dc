"""A pool node's KV cache in the twin: which blocks it holds, in which tier, and what it evicts.

Node cache (``NodeCache``): a DRAM tier of ``dram_blocks`` blocks (None: unbounded) and an
optional SSD tier, with the kvstore's own eviction policies (kvstore.eviction.make_policy)
driven as kvstore/store.py drives them: a put inserts the new blocks head first, a read
touches the blocks it uses tail first (so a prefix outlives its suffixes under LRU);
when DRAM use passes the high watermark it is brought back to the low one (StoreConfig's
0.95 / 0.85), evicted DRAM blocks are demoted to the SSD when there is one, and an
SSD block that is read is promoted back to DRAM. Every change is reported to a listener
(the Conductor) as a stored or removed event, so the Conductor's index is exact.
"""

from __future__ import annotations

from collections.abc import Callable

from kvstore.events import Tier
from kvstore.eviction import make_policy

HIGH_WATERMARK, LOW_WATERMARK = 0.95, 0.85  # kvstore.config.StoreConfig defaults

Event = tuple[
    bool, bytes, Tier, bytes | None
]  # (stored: True, removed: False), key, tier, parent (b"": a chain's first)
Sink = Callable[[str, list[Event]], None]  # (node, the events of one operation, in order)


class NodeCache:
    """One kvstore node's blocks: DRAM (``dram_blocks``; None: unbounded) and an optional SSD tier.

    ``sink`` hears every block entering or leaving a tier, one call per operation (a
    read or a put) with its events in order. Blocks in ``leased`` (the running
    prefill's) are never evicted. Not a byte store: only which keys are where.
    """

    def __init__(self, node: str, dram_blocks: int | None, ssd_blocks: int, eviction: str, sink: Sink) -> None:
        if dram_blocks is not None and dram_blocks <= 0:
            raise ValueError(f"dram_blocks must be positive (or None: unbounded), got {dram_blocks}")
        self.node = node
        self.dram_blocks, self.ssd_blocks = dram_blocks, ssd_blocks
        self.dram: set[bytes] = set()
        self.ssd: set[bytes] = set()
        self._dram_policy = make_policy(eviction)
        self._ssd_policy = make_policy(eviction)
        self._chain: dict[
            bytes, tuple[int, bytes]
        ] = {}  # key -> (its position, the block before it), as a pool node records them
        self._tick = 0
        self.leased: set[bytes] = set()
        self._sink = sink
        self._events: list[Event] = []
        self.evictions = 0

    def holds(self, key: bytes) -> bool:
        return key in self.dram or key in self.ssd

    def leading(self, keys: list[bytes], start: int = 0, end: int | None = None) -> int:
        """How many of ``keys[start:end]``, from ``start`` on, this node holds without a gap."""
        n = 0
        for key in keys[start:end]:
            if key not in self.dram and key not in self.ssd:
                break
            n += 1
        return n

    def read(self, keys: list[bytes]) -> int:
        """Use ``keys`` (all held): touch them tail first, promote SSD-only ones to DRAM; return how many came from
        SSD."""
        self._tick += 1
        from_ssd = 0
        for key in reversed(keys):
            if key in self.dram:
                self._dram_policy.touch(key, self._tick)
            elif key in self.ssd:
                from_ssd += 1
                self._ssd_policy.touch(key, self._tick)
                self._insert_dram(key)
        if from_ssd:
            self._enforce()
        self._flush()
        return from_ssd

    def put(self, keys: list[bytes]) -> int:
        """Store a prompt's blocks (chain order) in DRAM; return how many were new to this node."""
        new = 0
        for position, key in enumerate(keys):
            if key in self.dram:
                continue
            self._chain[key] = (position, keys[position - 1] if position else b"")
            if key in self.ssd:  # a copy on SSD: the fresh one goes to DRAM as well
                self._ssd_policy.touch(key, self._tick)
            else:
                new += 1
            self._insert_dram(key)
        self._enforce()
        self._flush()
        return new

    def _insert_dram(self, key: bytes) -> None:
        self._tick += 1
        self.dram.add(key)
        position, parent = self._chain.get(key, (0, None))
        self._dram_policy.insert(key, position, self._tick)
        self._events.append((True, key, Tier.DRAM, parent))

    def _flush(self) -> None:
        if self._events:
            events, self._events = self._events, []
            self._sink(self.node, events)

    def _enforce(self) -> None:
        """Bring DRAM back to the low watermark once it passes the high one (kvstore.store._after_insert)."""
        cap = self.dram_blocks
        if cap is None or len(self.dram) <= HIGH_WATERMARK * cap:
            return
        excess = len(self.dram) - int(LOW_WATERMARK * cap)
        leased = self.leased
        victims = self._dram_policy.victims(excess, lambda k: k not in leased)
        if len(self.dram) - len(victims) > cap:  # leases hold more than fits: the store would refuse the put;
            rest = len(self.dram) - len(victims) - cap  # here the most expendable leased blocks go instead
            chosen = set(victims)
            victims += self._dram_policy.victims(rest, lambda k: k not in chosen)
        self._evict_dram(victims)

    def _evict_dram(self, victims: list[bytes]) -> None:
        """Drop ``victims`` from DRAM, demoting each to the SSD when there is one and it has no copy there.

        Events go out grouped (the SSD's removals, its stores, then DRAM's removals): the
        keys differ, so the index ends the same, and a group of stores is one index update.
        """
        ssd_removed: list[bytes] = []
        ssd_stored: list[bytes] = []
        for key in victims:
            self._dram_policy.remove(key)
            self.dram.discard(key)
            if self.ssd_blocks <= 0 or key in self.ssd:
                continue
            if len(self.ssd) >= self.ssd_blocks:
                # 5% at a time, not one (the store's way): LFU's victim search scans the whole tier
                for victim in self._ssd_policy.victims(max(1, self.ssd_blocks // 20), lambda k: True):
                    self._ssd_policy.remove(victim)
                    self.ssd.discard(victim)
                    ssd_removed.append(victim)
            self._tick += 1
            self.ssd.add(key)
            self._ssd_policy.insert(key, self._chain.get(key, (0, None))[0], self._tick)
            ssd_stored.append(key)
        self.evictions += len(victims)
        events = self._events
        events += [(False, k, Tier.SSD, None) for k in ssd_removed if k not in self.ssd]
        events += [(True, k, Tier.SSD, self._chain.get(k, (0, None))[1]) for k in ssd_stored if k in self.ssd]
        events += [(False, k, Tier.DRAM, None) for k in victims]
        for key in (*ssd_removed, *victims):
            if key not in self.dram and key not in self.ssd:
                self._chain.pop(key, None)
