"""The transfer engine: one-sided batched reads and writes over shm and tcp, registries, and failing fast."""

from __future__ import annotations

import os
import signal
import time

import pytest
from kvnodes import rdma_unavailable, start_node

from kvstore.client import KVStoreClient
from transfer import (
    BackendKind,
    MemoryRegistry,
    RedisRegistry,
    Segment,
    Slice,
    TransferConfig,
    TransferEngine,
    TransferError,
    TransferState,
)

MIB = 1 << 20


@pytest.fixture
def pair(shm_dir):
    """Node 'owner' with a 4 MiB segment of known bytes, and a peer engine per backend."""
    registry = MemoryRegistry()
    owner = TransferEngine(TransferConfig(node="owner", shm_dir=shm_dir), registry)
    owner.allocate("mem", 4 * MIB)
    owner.buffer("owner/mem")[:] = os.urandom(4 * MIB)
    kinds = ("tcp", "shm") + (("rdma",) if rdma_unavailable() is None else ())  # the rdma tests are skipped elsewhere
    peers = {
        kind: TransferEngine(
            TransferConfig(node=f"peer-{kind}", backend=kind, shm_dir=shm_dir, tcp_chunk_bytes=64 * 1024), registry
        )
        for kind in kinds
    }
    yield owner, peers
    for p in peers.values():
        p.close()
    owner.close()


@pytest.mark.parametrize("backend", ["tcp", "shm", pytest.param("rdma", marks=pytest.mark.rdma)])
def test_batched_read_and_write_move_the_exact_bytes(pair, backend):
    owner, peers = pair
    peer, remote = peers[backend], owner.buffer("owner/mem")
    local = bytearray(3 * MIB)
    # slices that cross chunk boundaries, are unaligned, and land out of order in the local buffer
    slices = [
        Slice(2 * MIB, "owner/mem", 12345, MIB),
        Slice(0, "owner/mem", 3 * MIB - 7, 300_001),
        Slice(MIB, "owner/mem", 0, 17),
    ]
    batch = peer.read(local, slices)
    batch.wait(10)
    assert batch.state is TransferState.DONE
    for s in slices:
        assert local[s.local_offset : s.local_offset + s.length] == remote[s.remote_offset : s.remote_offset + s.length]
    payload = os.urandom(2 * MIB)
    peer.write(payload, [Slice(0, "owner/mem", 5, MIB), Slice(MIB, "owner/mem", 2 * MIB + 3, MIB)]).wait(10)
    assert bytes(remote[5 : 5 + MIB]) == payload[:MIB]
    assert bytes(remote[2 * MIB + 3 : 3 * MIB + 3]) == payload[MIB:]


def test_backend_is_chosen_per_peer(pair, shm_dir):
    owner, peers = pair
    seg = owner.segment("owner/mem")
    auto = TransferEngine(TransferConfig(node="auto", shm_dir=shm_dir, serve=False), owner.registry)
    try:
        assert auto.backend_for(seg).kind is BackendKind.SHM  # same host
        elsewhere = Segment(**{**seg.to_dict(), "host": "other-host:boot"})
        assert auto.backend_for(elsewhere).kind is BackendKind.TCP
        assert peers["tcp"].backend_for(seg).kind is BackendKind.TCP
        with pytest.raises(ValueError, match="not on this host"):
            peers["shm"].backend_for(elsewhere)
    finally:
        auto.close()


def test_bad_requests_get_clear_errors(pair):
    owner, peers = pair
    peer = peers["tcp"]
    with pytest.raises(ValueError, match="unknown segment"):
        peer.read(bytearray(10), [Slice(0, "nobody/mem", 0, 10)])
    with pytest.raises(ValueError, match="past segment"):
        peer.read(bytearray(10), [Slice(0, "owner/mem", 4 * MIB - 5, 10)])
    with pytest.raises(ValueError, match="past the local buffer"):
        peer.read(bytearray(10), [Slice(5, "owner/mem", 0, 10)])
    with pytest.raises(ValueError, match="writable"):
        peer.read(b"0123456789", [Slice(0, "owner/mem", 0, 10)])
    with pytest.raises(ValueError, match="length > 0"):
        peer.read(bytearray(10), [Slice(0, "owner/mem", 0, 0)])
    with pytest.raises(ValueError, match="rdma"):
        TransferEngine(TransferConfig(node="x", backend="rdma"))
    with pytest.raises(ValueError, match="already registered"):
        owner.allocate("mem", 10)
    # a descriptor that lies about the size: the owner refuses, the batch fails with its reason
    liar = Segment(**{**owner.segment("owner/mem").to_dict(), "name": "owner/mem", "size": 8 * MIB})
    peer2 = TransferEngine(TransferConfig(node="p2", backend="tcp", serve=False), MemoryRegistry())
    try:
        peer2.add_segment(liar)
        batch = peer2.read(bytearray(MIB), [Slice(0, "owner/mem", 6 * MIB, MIB)])
        with pytest.raises(TransferError, match="past its end"):
            batch.wait(10)
        assert batch.state is TransferState.FAILED
        peer2.read(bytearray(10), [Slice(0, "owner/mem", 0, 10)]).wait(10)  # the connection is still good
    finally:
        peer2.close()


def test_redis_registry_shares_segments_between_engines(redis_url, shm_dir):
    owner = TransferEngine(TransferConfig(node="owner", shm_dir=shm_dir), RedisRegistry(redis_url))
    reader = TransferEngine(TransferConfig(node="reader", backend="tcp", serve=False), RedisRegistry(redis_url))
    try:
        seg = owner.allocate("mem", MIB)
        owner.buffer(seg.name)[:4] = b"moon"
        assert RedisRegistry(redis_url).get(seg.name) == seg
        assert [s.name for s in RedisRegistry(redis_url).list(node="owner")] == [seg.name]
        out = bytearray(4)
        reader.read(out, [Slice(0, seg.name, 0, 4)]).wait(10)
        assert out == b"moon"
    finally:
        reader.close()
        owner.close()
    assert RedisRegistry(redis_url).list() == []  # a closed engine unregisters its segments


def leased_slices(node, blocks: int, block_bytes: int) -> list[Slice]:
    """Put ``blocks`` blocks of 0xab into a pool node and lease them: one slice per block, each carrying the lease
    (the token the node's transfer port asks for), laid end to end in the local buffer."""
    with KVStoreClient(node.grpc) as kv:
        keys = [i.to_bytes(16, "little") for i in range(1, blocks + 1)]
        kv.put(keys, b"\xab" * (blocks * block_bytes))
        got = kv.get_locations(keys)
    assert len(got.slots) == blocks
    return [
        Slice(i * block_bytes, got.segment.name, s.offset, block_bytes, got.lease_id) for i, s in enumerate(got.slots)
    ]


def test_peer_killed_mid_transfer_fails_promptly(shm_dir):
    node = start_node("victim", 1 * MIB, 64, shm_dir=shm_dir)
    reader = TransferEngine(
        TransferConfig(node="reader", backend="tcp", serve=False, io_timeout_s=60), MemoryRegistry()
    )
    try:
        stats_seg = Segment(
            name="victim/dram",
            node="victim",
            size=64 * MIB,
            host="elsewhere",
            pid=node.proc.pid,
            tcp_addr=node.info["tcp"],
        )
        reader.add_segment(stats_seg)
        slices = leased_slices(node, 32, MIB)
        reader.read(bytearray(MIB), slices[:1]).wait(30)  # connected (and authenticated) first
        node.kill(signal.SIGSTOP)  # the peer stops answering with the batch on the wire
        batch = reader.read(bytearray(32 * MIB), slices)
        time.sleep(0.5)
        assert batch.state is TransferState.TRANSFERRING
        node.kill(signal.SIGKILL)
        with pytest.raises(TransferError, match="'victim'.*connection lost"):
            batch.wait(30)  # fails on the reset, long before io_timeout_s (60 s)
        with pytest.raises(TransferError, match="cannot connect"):
            reader.read(bytearray(10), [Slice(0, "victim/dram", 0, 10)]).wait(30)
    finally:
        node.stop()
        reader.close()


def test_shm_peer_that_died_fails_its_transfers(shm_dir):
    node = start_node("victim", 64 * 1024, 4, shm_dir=shm_dir)
    reader = TransferEngine(TransferConfig(node="reader", backend="shm", serve=False), MemoryRegistry())
    try:
        seg = Segment(
            name="victim/dram",
            node="victim",
            size=4 * 64 * 1024,
            host=reader.host,
            pid=node.proc.pid,
            shm_path=os.path.join(shm_dir, "victim--dram"),
        )
        reader.add_segment(seg)
        reader.read(bytearray(10), [Slice(0, "victim/dram", 0, 10)]).wait(10)
        node.kill(signal.SIGKILL)  # its shared-memory file outlives it
        assert os.path.exists(seg.shm_path)
        with pytest.raises(TransferError, match="owner process .* is gone"):
            reader.read(bytearray(10), [Slice(0, "victim/dram", 0, 10)]).wait(10)
    finally:
        node.stop()
        reader.close()


def test_timed_out_batch_is_cancelled_and_leaves_the_buffer_alone(shm_dir):
    node = start_node("slow", 1 * MIB, 16, shm_dir=shm_dir)
    reader = TransferEngine(TransferConfig(node="reader", backend="tcp", serve=False), MemoryRegistry())
    try:
        reader.add_segment(
            Segment(
                name="slow/dram",
                node="slow",
                size=16 * MIB,
                host="elsewhere",
                pid=node.proc.pid,
                tcp_addr=node.info["tcp"],
            )
        )
        slices = leased_slices(node, 12, MIB)  # the segment holds something that is not zeros, and we may read it
        node.kill(signal.SIGSTOP)  # alive but silent
        local = bytearray(12 * MIB)
        batch = reader.read(local, slices)
        with pytest.raises(TransferError, match="timed out"):
            batch.wait(0.5)
        assert batch.state is TransferState.FAILED
        node.kill(signal.SIGCONT)  # the peer wakes up and would answer now...
        time.sleep(0.5)
        assert local == bytearray(12 * MIB)  # ...but nothing lands in a buffer its owner got back
        out = bytearray(MIB)
        reader.read(out, slices[:1]).wait(10)  # and the next batch reconnects
        assert out == b"\xab" * MIB
    finally:
        node.stop()
        reader.close()


def test_metrics_count_bytes_by_the_backend_that_carried_them(pair):
    from prometheus_client import CollectorRegistry, generate_latest

    from transfer.metrics import TransferCollector

    owner, peers = pair
    for kind in ("tcp", "shm"):
        peers[kind].read(bytearray(3000), [Slice(0, "owner/mem", 0, 1000), Slice(1000, "owner/mem", 9000, 2000)]).wait(
            10
        )
        peers[kind].write(b"x" * 500, [Slice(0, "owner/mem", 0, 500)]).wait(10)
        assert peers[kind].moved() == {(kind, "read"): (1, 3000), (kind, "write"): (1, 500)}
    registry = CollectorRegistry()
    registry.register(TransferCollector(peers["tcp"]))
    text = generate_latest(registry).decode()
    assert 'mooncake_transfer_bytes_total{backend="tcp",op="read"} 3000.0' in text
    assert 'mooncake_transfer_batches_total{backend="tcp",op="write"} 1.0' in text


def test_a_link_meter_counts_the_bytes_that_crossed_the_network_over_the_time_some_were_under_way(pair, shm_dir):
    from transfer.linkrate import LinkMeter

    owner, peers = pair
    tcp, shm = peers["tcp"], peers["shm"]
    meter, local_only = LinkMeter(tcp, min_bytes=MIB), LinkMeter(shm, min_bytes=1)
    data = os.urandom(2 * MIB)
    # two batches under way together, then one alone a moment later: the overlap counts once, the gap not at all
    together = [tcp.write(data, [Slice(0, "owner/mem", i * MIB, MIB)]) for i in range(2)]
    for b in together:
        b.wait(10)
    time.sleep(0.05)
    alone = tcp.write(data, [Slice(0, "owner/mem", 2 * MIB, MIB)])
    alone.wait(10)
    one_slice = [Slice(0, "owner/mem", 0, MIB)]
    meter.settled([(b, one_slice) for b in together] + [(alone, one_slice)])
    first = min(b.started_at for b in together)
    busy = max(b.finished_at for b in together) - first + alone.finished_at - alone.started_at
    assert together[1].started_at < together[0].finished_at  # (the overlap is there to be counted once: a MiB in
    # 64 KiB chunks takes 16 round trips, a second write starts at once)
    assert alone.started_at > max(b.finished_at for b in together)  # (and the gap to be left out)
    got = meter.take()
    assert got is not None and got[0] == 3 * MIB and got[1] == pytest.approx(busy)
    assert meter.take() is None  # taken: nothing gathered since
    assert owner.buffer("owner/mem")[2 * MIB : 3 * MIB] == data[:MIB]

    for _ in range(2):  # a batch under min_bytes that found the link idle measured its latency, not its rate
        lone = tcp.write(data, [Slice(0, "owner/mem", 0, 600_000)])
        lone.wait(10)
        meter.settled([(lone, [Slice(0, "owner/mem", 0, 600_000)])])
    assert meter.take() is None  # (1.2 MB in all: counted, they would have made a sample)

    copied = shm.write(data, one_slice)  # a copy on this host through shared memory is not the network's
    copied.wait(10)
    local_only.settled([(copied, one_slice)])
    assert local_only.take() is None
