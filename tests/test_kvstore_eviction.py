"""Eviction: the pure policies, and which blocks a store evicts under each on a scripted access sequence."""

from __future__ import annotations

import pytest

from kvstore.config import StoreConfig
from kvstore.events import EventKind
from kvstore.eviction import LengthAwarePolicy, LFUPolicy, LRUPolicy, make_policy
from kvstore.records import StoreFull
from kvstore.store import BlockStore

BB = 64
A, B, C, D, E, F, G, H = (bytes([i]) * 16 for i in range(1, 9))
NAMES = {A: "A", B: "B", C: "C", D: "D"}


def make_store(eviction: str, dram_blocks: int = 4, **kw) -> BlockStore:
    cfg = StoreConfig(
        block_bytes=BB, dram_blocks=dram_blocks, eviction=eviction, high_watermark=1.0, low_watermark=1.0, **kw
    )
    return BlockStore(cfg, bytearray(BB * dram_blocks))


def hit(store: BlockStore, key: bytes) -> None:
    got = store.get([key])
    store.release(got.lease_id)


def scripted(store: BlockStore) -> None:
    """A (position 0), B (5), C (2), D (9) stored; then uses A A A B D C C."""
    for key, pos in ((A, 0), (B, 5), (C, 2), (D, 9)):
        store.put([key], bytes(BB), positions=[pos])
    for key in (A, A, A, B, D, C, C):
        hit(store, key)


def removed_since(store: BlockStore, seq: int) -> list[str]:
    events, _ = store.events.read(seq, timeout=0)
    return [NAMES.get(e.key, "?") for e in events if e.kind is EventKind.REMOVED]


@pytest.mark.parametrize(
    "eviction, order",
    [
        ("lru", ["A", "B", "D", "C"]),  # least recently used first
        ("lfu", ["B", "D", "C", "A"]),  # B and D used twice, B longer ago
        ("length", ["D", "B", "C", "A"]),  # B and D used twice, D later in its prompt
    ],
)
def test_eviction_order_per_policy(eviction, order):
    store = make_store(eviction)
    scripted(store)
    seq = store.events.next_seq
    store.put([E, F, G, H], bytes(4 * BB))  # needs all four slots: evicts everything, in policy order
    assert removed_since(store, seq) == order
    assert store.lookup([A]).prefix_blocks == 0 and store.lookup([E, F, G, H]).prefix_blocks == 4


@pytest.mark.parametrize("eviction", ["lru", "lfu", "length"])
def test_partial_eviction_takes_the_first_victims(eviction):
    store = make_store(eviction)
    scripted(store)
    expected_first = {"lru": "A", "lfu": "B", "length": "D"}[eviction]
    seq = store.events.next_seq
    store.put([E], bytes(BB))
    assert removed_since(store, seq) == [expected_first]


def test_lease_protects_a_block_from_eviction():
    store = make_store("lru")
    store.put([A, B, C, D], bytes(4 * BB))
    lease = store.get([A])  # a request is using A...
    for key in (B, C, D):
        hit(store, key)  # ...and A is now the least recently used
    with pytest.raises(StoreFull):
        store.put([E, F, G, H], bytes(4 * BB))  # only three slots can be freed
    assert store.lookup([A, B, C, D]).prefix_blocks == 4  # the refusal changed nothing
    seq = store.events.next_seq
    store.put([E], bytes(BB))
    assert removed_since(store, seq) == ["B"]  # the victim after A
    store.release(lease.lease_id)
    seq = store.events.next_seq
    store.put([F], bytes(BB))
    assert removed_since(store, seq) == ["A"]


def test_expired_lease_no_longer_protects():
    store = make_store("lru")
    store.put([A, B, C, D], bytes(4 * BB))
    store.get([A], lease_ttl_s=0.001)  # never released
    for key in (B, C, D):
        hit(store, key)
    assert store.expire(now=float("inf")) == (0, 1)
    seq = store.events.next_seq
    store.put([E], bytes(BB))
    assert removed_since(store, seq) == ["A"]


def test_pinned_block_is_never_evicted_until_unpinned():
    store = make_store("lfu")
    scripted(store)
    assert store.pin([B]) == 1
    seq = store.events.next_seq
    store.put([E, F, G], bytes(3 * BB))
    assert removed_since(store, seq) == ["D", "C", "A"]
    with pytest.raises(StoreFull):
        store.put([H, A, C, D], bytes(4 * BB))
    store.pin([B], pinned=False)
    store.put([H, A, C, D], bytes(4 * BB))
    assert store.lookup([B]).prefix_blocks == 0


def test_lru_keeps_a_shared_prefix_longer_than_its_tails():
    store = make_store("lru", dram_blocks=4)
    store.put([A, B, C], bytes(3 * BB))  # one prompt's chain
    got = store.get([A, B, C])  # a reuse touches the chain tail-first
    store.release(got.lease_id)
    seq = store.events.next_seq
    store.put([D, E], bytes(2 * BB))
    assert removed_since(store, seq) == ["C"]  # one slot was free; the tail goes, the prefix stays
    assert store.lookup([A, B]).prefix_blocks == 2


def test_policies_alone():
    for policy in (LRUPolicy(), LFUPolicy(), LengthAwarePolicy()):
        for tick, key in enumerate((A, B, C)):
            policy.insert(key, tick, tick)
        policy.touch(A, 10)
        policy.remove(C)
        assert len(policy) == 2
        assert policy.victims(5, lambda k: True) == [B, A]
        assert policy.victims(5, lambda k: k != B) == [A]
    with pytest.raises(ValueError):
        make_policy("fifo")
