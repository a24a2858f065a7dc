"""The block store in one process: two-phase puts, bad input, a full store, watermarks, the SSD tier."""

from __future__ import annotations

import os
import struct
import threading
import time

import pytest
import xxhash

from kvstore.config import StoreConfig
from kvstore.events import EventKind, Tier
from kvstore.records import StoreFull
from kvstore.ssd import HEADER_V1, MAGIC, CorruptBlock, SsdTier
from kvstore.store import BlockStore

BB = 4096 + 100  # not a multiple of the SSD alignment on purpose


def keys(n: int, salt: int = 0) -> list[bytes]:
    return [bytes([salt]) + i.to_bytes(15, "big") for i in range(n)]


def blocks(n: int, seed: int = 0) -> bytes:
    return os.urandom(n * BB) if seed == 0 else bytes((i * 7 + seed) % 251 for i in range(n * BB))


def read(store: BlockStore, ks: list[bytes]) -> tuple[bytes, object]:
    got = store.get(ks)
    data = b"".join(bytes(store.slot_view(slot)) for _, slot in got.slots)
    store.release(got.lease_id)
    return data, got


def make(dram_blocks=8, ssd_dir=None, ssd_blocks=0, **kw) -> BlockStore:
    """A store; watermarks off (1.0) unless a test sets them, so tiny stores fill up exactly."""
    kw.setdefault("high_watermark", 1.0)
    kw.setdefault("low_watermark", 1.0)
    cfg = StoreConfig(
        block_bytes=BB,
        dram_blocks=dram_blocks,
        ssd_dir=str(ssd_dir) if ssd_dir else None,
        ssd_blocks=ssd_blocks,
        ssd_file_blocks=4,
        **kw,
    )
    ssd = SsdTier(ssd_dir, BB, ssd_blocks, 4) if ssd_dir else None
    return BlockStore(cfg, bytearray(BB * dram_blocks), ssd)


def test_put_then_get_returns_the_bytes_and_the_longest_prefix():
    store = make()
    ks, data = keys(3), blocks(3)
    assert store.put(ks, data) == (3, 0)
    assert store.put(ks[:2], data[: 2 * BB]) == (0, 2)  # already there: nothing written
    got, res = read(store, ks + keys(2, salt=9))
    assert got == data and len(res.slots) == 3 and res.dram_hits == 3
    assert store.lookup([ks[0], keys(1, salt=9)[0], ks[2]]).prefix_blocks == 1  # the chain stops at the first miss


def test_reserved_block_is_invisible_until_commit_and_abort_frees_it():
    store = make(dram_blocks=2)
    ks = keys(2)
    res = store.reserve(ks)
    for _, slot in res.slots:
        store.slot_view(slot)[:] = b"x" * BB
    assert store.lookup(ks).prefix_blocks == 0  # half-written is never visible
    assert store.stats().dram.reserved_blocks == 2
    with pytest.raises(StoreFull):
        store.reserve(keys(1, salt=1))  # reserved slots are not evictable
    store.abort(res.reservation_id)
    assert store.stats().dram.reserved_blocks == 0 and store.lookup(ks).prefix_blocks == 0
    with pytest.raises(KeyError, match="no reservation"):
        store.commit(res.reservation_id)
    res = store.reserve(ks)
    assert store.commit(res.reservation_id) == (2, 0)
    assert store.lookup(ks).prefix_blocks == 2


def test_a_get_waits_for_blocks_being_written_only_when_asked_and_only_until_the_write_ends():
    """A prefill of the same prompt that answered writes its blocks now: a get asked to wait leases them once the
    writer commits (the bytes it wrote), and stops waiting when the writer gives up; one not asked to wait, or for
    blocks nobody writes, answers at once."""
    store = make(dram_blocks=8)
    ks, data = keys(4), blocks(4)
    assert store.put(ks[:1], data[:BB]) == (1, 0)
    res = store.reserve(ks[1:], positions=[1, 2, 3], parent=ks[0])
    slot_of = dict(res.slots)
    for i, key in enumerate(ks[1:], start=1):
        store.slot_view(slot_of[key])[:] = data[i * BB : (i + 1) * BB]
    assert len(store.get(ks).slots) == 1  # not asked to wait: what is stored now
    threading.Timer(0.3, store.commit, [res.reservation_id]).start()
    start = time.monotonic()
    got = store.get(ks, wait_s=10.0)
    assert len(got.slots) == 4 and time.monotonic() - start >= 0.25
    assert b"".join(bytes(store.slot_view(slot)) for _, slot in got.slots) == data

    other = keys(3, salt=5)
    start = time.monotonic()
    assert len(store.get(other, wait_s=10.0).slots) == 0 and time.monotonic() - start < 1.0  # nobody writes them
    res = store.reserve(other)
    threading.Timer(0.3, store.abort, [res.reservation_id]).start()
    start = time.monotonic()
    assert len(store.get(other, wait_s=10.0).slots) == 0 and time.monotonic() - start < 5.0  # the writer gave up
    res = store.reserve(other)
    start = time.monotonic()
    assert len(store.get(other, wait_s=0.3).slots) == 0 and time.monotonic() - start >= 0.25  # waited its time, no more
    store.abort(res.reservation_id)


def test_bad_input_gets_clear_errors():
    store = make()
    with pytest.raises(ValueError, match="16 bytes"):
        store.reserve([b"short"])
    with pytest.raises(ValueError, match="same key twice"):
        store.reserve(keys(1) * 2)
    with pytest.raises(ValueError, match="positions"):
        store.reserve(keys(2), positions=[0])
    with pytest.raises(ValueError, match="block size 1000 does not match"):
        store.check_block_bytes(1000)
    with pytest.raises(ValueError, match="bytes for 2 blocks"):
        store.put(keys(2), b"x" * BB)
    with pytest.raises(KeyError):
        store.release("no-such-lease")
    with pytest.raises(ValueError):
        StoreConfig(block_bytes=BB, dram_blocks=4, low_watermark=0.9, high_watermark=0.5)


def test_reservation_times_out_and_its_slots_rest_before_reuse():
    store = make(dram_blocks=2, reservation_ttl_s=10)
    res = store.reserve(keys(2), ttl_s=0.001)
    now = time.monotonic() + 1
    assert store.expire(now=now) == (1, 0)
    with pytest.raises(KeyError):
        store.commit(res.reservation_id)
    with pytest.raises(StoreFull):  # a late writer may still be sending into them
        store.reserve(keys(1, salt=1))
    store.expire(now=now + 11)
    assert store.stats().dram.reserved_blocks == 0
    assert store.put(keys(2, salt=1), blocks(2)) == (2, 0)


def test_full_store_refuses_without_corrupting():
    store = make(dram_blocks=3)
    ks, data = keys(3), blocks(3)
    store.put(ks, data)
    lease = store.get(ks)
    with pytest.raises(StoreFull, match="leased, pinned or reserved"):
        store.put(keys(1, salt=1), blocks(1))
    store.release(lease.lease_id)
    assert read(store, ks)[0] == data


def test_watermarks_evict_down_to_the_low_mark():
    store = make(dram_blocks=10, high_watermark=0.8, low_watermark=0.5)
    ks = keys(9)
    for k in ks[:8]:
        store.put([k], blocks(1, seed=3))
    assert store.stats().dram.used_blocks == 8  # at the high mark, not past it
    store.put([ks[8]], blocks(1, seed=3))
    assert store.stats().dram.used_blocks == 5
    assert [store.lookup([k]).prefix_blocks for k in ks] == [0, 0, 0, 0, 1, 1, 1, 1, 1]  # LRU: oldest four went


def test_ssd_round_trip_demotion_and_promotion(tmp_path):
    store = make(dram_blocks=4, ssd_dir=tmp_path, ssd_blocks=8)
    ks, data = keys(6), blocks(6)
    seq = store.events.next_seq
    for i, k in enumerate(ks):
        store.put([k], data[i * BB : (i + 1) * BB])
    assert store.lookup(ks).tiers == [Tier.SSD, Tier.SSD, Tier.DRAM, Tier.DRAM, Tier.DRAM, Tier.DRAM]
    events, _ = store.events.read(seq, timeout=0)
    assert (EventKind.STORED, ks[0], Tier.SSD) in [(e.kind, e.key, e.tier) for e in events]
    assert (EventKind.REMOVED, ks[0], Tier.DRAM) in [(e.kind, e.key, e.tier) for e in events]
    got, res = read(store, ks[:1])  # a hit on SSD comes back through DRAM
    assert got == data[:BB] and res.ssd_hits == 1
    assert store.lookup(ks[:1]).tiers == [Tier.DRAM]
    got, res = read(store, ks[:4])  # a prefix, promoting what is still on SSD
    # ks[1] was still on SSD, and promoting ks[0] had demoted ks[2] (then least recently used)
    assert got == data[: 4 * BB] and (res.ssd_hits, res.dram_hits) == (2, 2)
    got, res = read(store, ks)  # more than DRAM holds at once: the lease stops at what fits
    assert len(res.slots) == 4 and got == data[: 4 * BB]
    stats = store.stats()
    assert stats.ssd.hits >= 2 and stats.dram.evictions >= 2


def test_flipped_byte_on_ssd_is_a_reported_miss(tmp_path):
    store = make(dram_blocks=2, ssd_dir=tmp_path, ssd_blocks=4)
    ks, data = keys(2), blocks(2)
    store.put(ks, data)
    store.put(keys(1, salt=3), blocks(1))  # demotes ks[0] to SSD slot 0
    assert store.lookup(ks[:1]).tiers == [Tier.SSD]
    path = tmp_path / "slots-0000.bin"
    with open(path, "r+b") as f:  # slot 0's data starts at 4096
        f.seek(4096 + 1234)
        byte = f.read(1)
        f.seek(4096 + 1234)
        f.write(bytes([byte[0] ^ 0x01]))
    _, res = read(store, ks)
    assert res.slots == [] and res.corrupt == [ks[0]]
    assert store.stats().corrupt_blocks == 1
    assert store.lookup(ks).prefix_blocks == 0  # dropped: later lookups miss instead of serving bad bytes


def test_ssd_write_interrupted_by_a_crash_never_reads_back_valid(tmp_path, monkeypatch):
    ssd = SsdTier(tmp_path, BB, 4, 4)
    old, new = b"o" * BB, b"n" * BB
    ssd.write(0, keys(1)[0], memoryview(old))
    real = os.pwrite
    calls = []

    def crash_before_header(fd, data, offset):  # a process killed after the data, before the header
        calls.append(offset)
        if len(calls) == 3:
            raise KeyboardInterrupt("killed")
        return real(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", crash_before_header)
    with pytest.raises(KeyboardInterrupt):
        ssd.write(0, keys(1, salt=5)[0], memoryview(new))
    monkeypatch.setattr(os, "pwrite", real)
    ssd.close()
    again = SsdTier(tmp_path, BB, 4, 4)
    assert again.adopt() == []  # neither the old block nor the half-written new one
    with pytest.raises(CorruptBlock):
        again.read(0, keys(1, salt=5)[0], memoryview(bytearray(BB)))


def test_restart_re_adopts_ssd_blocks(tmp_path):
    store = make(dram_blocks=2, ssd_dir=tmp_path, ssd_blocks=8)
    ks, data = keys(5), blocks(5)
    for i, k in enumerate(ks):
        store.put([k], data[i * BB : (i + 1) * BB])
    on_ssd = [k for k, t in zip(ks, store.lookup(ks).tiers) if t is Tier.SSD]
    store.close()  # no flush, no shutdown hook: what is on disk is what a kill would leave
    again = make(dram_blocks=4, ssd_dir=tmp_path, ssd_blocks=8)
    assert again.adopted == len(on_ssd) == 3
    got, res = read(again, on_ssd)
    assert got == data[: 3 * BB] and res.ssd_hits == 3
    with pytest.raises(ValueError, match="another geometry"):
        SsdTier(tmp_path, BB * 2, 8, 4)


def test_each_block_keeps_its_parent_in_events_snapshots_and_across_a_restart(tmp_path):
    """The Conductor's index counts a block only below its whole chain, so the store records each block's parent:
    the key before it in the same put (positions that follow on), the caller's ``parent`` for the first, none for
    position 0, and unknown otherwise. SSD headers keep it, so a restarted node reports it again."""
    store = make(dram_blocks=2, ssd_dir=tmp_path, ssd_blocks=8)
    ks, data = keys(5), blocks(5)
    store.put(ks[:2], data[: 2 * BB])
    store.put(ks[2:4], data[2 * BB : 4 * BB], positions=[2, 3], parent=ks[1])
    store.put(ks[4:], data[4 * BB :], positions=[4])  # no parent given: unknown
    events, _ = store.events.read(1, timeout=0)
    parents = {e.key: e.parent for e in events if e.kind is EventKind.STORED and e.tier is Tier.DRAM}
    assert parents == {ks[0]: b"", ks[1]: ks[0], ks[2]: ks[1], ks[3]: ks[2], ks[4]: None}
    with pytest.raises(ValueError, match="16-byte"):
        store.reserve(keys(1, salt=9), positions=[3], parent=b"short")
    store.close()
    again = make(dram_blocks=8, ssd_dir=tmp_path, ssd_blocks=8)
    snapshot, _ = again.snapshot()
    adopted = {k: p for k, t, p in snapshot}
    assert adopted and all(adopted[k] == parents[k] for k in adopted)  # the demoted blocks, parents and all
    assert set(adopted) == {ks[0], ks[1], ks[2]}
    orphan = keys(1, salt=7)
    again.put(orphan, blocks(1), positions=[4])  # unknown until a caller names it: then the node says so again
    again.reserve(orphan, positions=[4], parent=ks[3])
    events, _ = again.events.read(1, timeout=0)
    assert (events[-1].key, events[-1].parent) == (orphan[0], ks[3])


def test_a_version_1_ssd_header_is_still_read_with_its_parent_unknown(tmp_path):
    ssd = SsdTier(tmp_path, BB, 4, 4)
    key, data = keys(1)[0], blocks(1)
    fd, base = ssd._where(0)
    os.pwrite(fd, data, base + ssd.data_offset)
    head = HEADER_V1.pack(MAGIC, 1, 0, key, BB, xxhash.xxh3_64_intdigest(data), 7)
    os.pwrite(fd, head + struct.pack("<Q", xxhash.xxh3_64_intdigest(head)), base)
    (block,) = ssd.adopt()
    assert (block.key, block.parent, block.position) == (key, None, 0)
    out = bytearray(BB)
    ssd.read(0, key, memoryview(out))
    assert bytes(out) == data


def test_release_owner_frees_exactly_that_owners_leases_and_reservations_at_once():
    store = make(dram_blocks=5)
    stored = keys(2)
    store.put(stored, blocks(2))
    idle = store.stats()
    dead_lease = store.get(stored[:1], owner="prefill-0")  # a worker killed mid-prefill holds these
    dead_res = store.reserve(keys(2, salt=1), owner="prefill-0")
    live_lease = store.get(stored[1:], owner="prefill-1")
    live_res = store.reserve(keys(1, salt=2), owner="prefill-1")
    with pytest.raises(StoreFull):  # every slot is leased or reserved
        store.reserve(keys(1, salt=3))
    assert store.release_owner("prefill-0") == (1, 1)
    stats = store.stats()
    assert (stats.leases, stats.reservations, stats.dram.reserved_blocks) == (1, 1, 1)  # prefill-1's stay
    with pytest.raises(KeyError, match="no reservation"):
        store.commit(dead_res.reservation_id)
    with pytest.raises(KeyError, match="no lease"):
        store.release(dead_lease.lease_id)
    # the dead run's two reserved slots are free at once (not quarantined), and its leased block may be evicted
    assert store.put(keys(3, salt=4), blocks(3)) == (3, 0)
    assert store.lookup(stored).prefix_blocks == 0 and store.lookup(stored[1:]).prefix_blocks == 1
    assert store.commit(live_res.reservation_id) == (1, 0)
    store.release(live_lease.lease_id)
    assert store.release_owner("prefill-0") == (0, 0)
    stats = store.stats()
    assert (
        (stats.leases, stats.reservations, stats.dram.reserved_blocks)
        == (idle.leases, idle.reservations, 0)
        == (0, 0, 0)
    )


def test_release_owner_refuses_an_empty_owner_and_keeps_anonymous_holdings():
    store = make(dram_blocks=2)
    res = store.reserve(keys(1))
    with pytest.raises(ValueError, match="owner"):
        store.release_owner("")
    assert store.stats().reservations == 1
    assert store.commit(res.reservation_id) == (1, 0)


def test_the_event_log_keeps_as_many_events_as_the_node_holds_blocks_and_a_subscriber_further_behind_is_told():
    """A busy node stores and evicts for hours: its event log must not grow with that (a fixed 2**20 events let it
    reach hundreds of MB). It keeps as many as the node holds blocks (4096 at least); a subscriber that fell
    further behind is told (``lost``) and takes a snapshot instead."""
    from kvstore.config import MIN_EVENTS

    store = make(dram_blocks=8)
    for k in keys(MIN_EVENTS):  # once full, every put evicts a block: two events each
        store.put([k], blocks(1, seed=3))
    events, lost = store.events.read(1, timeout=0)
    assert lost and events[0].seq == store.events.next_seq - MIN_EVENTS
    assert make(dram_blocks=8, ssd_dir=None).config.events_kept == MIN_EVENTS
    assert StoreConfig(block_bytes=BB, dram_blocks=6000, ssd_dir="/x", ssd_blocks=4000).events_kept == 10000
    assert StoreConfig(block_bytes=BB, dram_blocks=8, max_events=100).events_kept == 100
