"""The rdma transfer backend (transfer/rdma.py) where there is no RDMA NIC, and over one where there is.

Here (no device, pyverbs installed by `make rdma`): it reports the missing device, a forced
rdma engine refuses to start and starts nothing, auto falls back to tcp and says so in the
READY line, segments carry their RDMA registration through Redis and protobuf, and the
structs it hands to libibverbs (QP attributes, work-request chains) hold exactly what
transfer/verbs.py decided.

Then the whole backend runs on tests/fakeverbs.py's fabric, which has pyverbs' interface
and moves the bytes where a NIC would DMA them: in one process (queue pairs brought up
over the real tcp handshake, posting under the queue depth, the completion thread, an
error and the reconnect, the peer's half freed), and across real processes
(``fake-rdma``: a pool node that serves while stopped and fails by name once killed, the
transfer benchmark, and a serving cluster whose KV moves only over rdma with one engine's
tokens). The ``rdma`` variants run the same over a real port and are skipped, with the
reason, wherever none is active.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest
from kvnodes import REPO, rdma_unavailable, start_node, wait_for

from kvstore.client import KVStoreClient
from kvstore.wire import segment_from_pb, segment_to_pb
from transfer import MemoryRegistry, RedisRegistry, Segment, TransferConfig, TransferEngine
from transfer.rdma import RdmaUnavailable, _pyverbs, probe
from transfer.rdma_structs import CONSTANTS, qp_attr, send_chain
from transfer.verbs import PortInfo, QPSettings, rc_transitions

needs_pyverbs = pytest.mark.skipif(
    "pyverbs cannot be imported" in (rdma_unavailable() or ""), reason="pyverbs is not installed (make rdma)"
)
no_device = pytest.mark.skipif(rdma_unavailable() is None, reason="this machine has an active RDMA port")


def test_without_pyverbs_the_backend_says_where_to_get_it():
    """pyverbs made unimportable in a fresh interpreter (it is installed here): the reason names the way to install
    it."""
    code = (
        "import sys; sys.modules['pyverbs'] = None\n"
        "from transfer.rdma import RdmaUnavailable, probe\n"
        "try:\n    probe()\nexcept RdmaUnavailable as e:\n    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert "pyverbs cannot be imported" in out.stdout and "make rdma" in out.stdout, out.stdout + out.stderr


@needs_pyverbs
@no_device
def test_probe_reports_no_rdma_device():
    with pytest.raises(RdmaUnavailable, match="no RDMA device"):
        probe()


@no_device
def test_forcing_rdma_without_a_port_fails_with_the_reason_and_starts_nothing(tmp_path):
    threads = {t.name for t in threading.enumerate()}
    with pytest.raises(ValueError, match="the rdma backend cannot start: (no RDMA device|pyverbs)"):
        TransferEngine(TransferConfig(node="forced", backend="rdma", shm_dir=str(tmp_path)), MemoryRegistry())
    assert {t.name for t in threading.enumerate()} <= threads  # no server thread left behind
    assert list(tmp_path.iterdir()) == []  # no segment file
    # the pool node's command line says the same and exits 2 before it binds anything
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvstore",
            "--node",
            "kvr",
            "--block-bytes",
            "4096",
            "--dram-blocks",
            "4",
            "--shm-dir",
            str(tmp_path),
            "--backend",
            "rdma",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and "the rdma backend cannot start" in out.stderr and "READY" not in out.stdout
    assert list(tmp_path.iterdir()) == []


@no_device
def test_auto_falls_back_to_tcp_between_two_pool_nodes_and_says_so(shm_dir):
    a = start_node("a", 4096, 8, shm_dir=shm_dir)
    b = start_node("b", 4096, 8, shm_dir=shm_dir)
    try:
        for node in (a, b):
            assert node.info["transport"].startswith("tcp (no RDMA device") or "pyverbs" in node.info["transport"]
        keys = [bytes([i]) * 16 for i in range(1, 4)]
        data = os.urandom(3 * 4096)
        with KVStoreClient(a.grpc) as ca, KVStoreClient(b.grpc) as cb:
            ca.put(keys, data)
            assert cb.pull(a.grpc, keys).pulled == 3  # b copies a's blocks (not over rdma: neither has a port)
            assert cb.get(keys).data.tobytes() == data
    finally:
        a.stop()
        b.stop()


def test_segments_carry_their_rdma_registration_through_redis_and_protobuf(redis_url):
    seg = Segment(
        name="n/dram",
        node="n",
        size=1 << 20,
        host="h",
        pid=1,
        shm_path=None,
        tcp_addr="10.0.0.1:7000",
        rdma_rkey=0,
        rdma_addr=0x7F00_0000_1000,
    )
    plain = Segment(name="n/landing", node="n", size=4096, host="h", pid=1, tcp_addr="10.0.0.1:7000")
    registry = RedisRegistry(redis_url)
    for s in (seg, plain):
        registry.register(s)
        assert registry.get(s.name) == s  # rkey 0 is a key like any other, and None stays None
        assert segment_from_pb(segment_to_pb(s)) == s


@needs_pyverbs
def test_every_libibverbs_constant_the_backend_uses_resolves_in_this_pyverbs():
    e = _pyverbs()["e"]
    assert {name: isinstance(getattr(e, name), int) for name in CONSTANTS} == dict.fromkeys(CONSTANTS, True)
    assert e.IBV_QPS_RTS == 3 and e.IBV_WR_RDMA_READ == 4 and e.IBV_SEND_SIGNALED == 2  # libibverbs' values


@needs_pyverbs
def test_qp_attributes_hold_what_the_transitions_decided():
    v = _pyverbs()
    e = v["e"]
    local = PortInfo(lid=0, gid="fe800000000000000000000000000001", qp_num=11, psn=0x123, mtu=5, roce=True)
    remote = PortInfo(lid=0, gid="00000000000000000000ffff0a000002", qp_num=22, psn=0x456, mtu=3, roce=True)
    init, rtr, rts = (qp_attr(v, t) for t in rc_transitions(local, remote, QPSettings(port_num=2, gid_index=3), 8))
    attr, mask = init
    assert attr.qp_state == e.IBV_QPS_INIT and attr.port_num == 2
    assert attr.qp_access_flags == e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_READ | e.IBV_ACCESS_REMOTE_WRITE
    assert mask == e.IBV_QP_STATE | e.IBV_QP_PKEY_INDEX | e.IBV_QP_PORT | e.IBV_QP_ACCESS_FLAGS
    attr, mask = rtr
    assert attr.qp_state == e.IBV_QPS_RTR and attr.dest_qp_num == 22 and attr.rq_psn == 0x456 and attr.path_mtu == 3
    assert attr.max_dest_rd_atomic == 8 and mask & e.IBV_QP_AV and mask & e.IBV_QP_DEST_QPN
    ah = attr.ah_attr
    assert ah.is_global == 1 and ah.port_num == 2 and ah.sgid_index == 3 and ah.hop_limit == 64
    assert ah.dgid.replace(":", "") == remote.gid  # the peer's GID, byte for byte
    attr, mask = rts
    assert attr.qp_state == e.IBV_QPS_RTS and attr.sq_psn == 0x123 and attr.max_rd_atomic == 8
    assert mask & e.IBV_QP_SQ_PSN and mask & e.IBV_QP_MAX_QP_RD_ATOMIC and not mask & e.IBV_QP_AV


@needs_pyverbs
def test_work_request_chains_signal_where_the_plan_says():
    v = _pyverbs()
    e = v["e"]
    reqs = [(7, e.IBV_WR_RDMA_READ, 0x1000 + i * 64, 0xAA, 0x9000 + i * 64, 0xBB, 64) for i in range(4)]
    chain = send_chain(v, reqs, {1: 41, 3: 42})
    assert [w.wr_id for w in chain] == [0, 41, 0, 42]
    assert [w.send_flags for w in chain] == [0, e.IBV_SEND_SIGNALED, 0, e.IBV_SEND_SIGNALED]
    assert all(w.opcode == e.IBV_WR_RDMA_READ and w.num_sge == 1 for w in chain)


# -- over a real port (skipped where there is none) --------------------------------------------


@pytest.mark.rdma
def test_a_pool_node_serves_blocks_over_rdma(shm_dir):
    node = start_node("kv-rdma", 1 << 20, 16, "--backend", "rdma", shm_dir=shm_dir)
    engine = TransferEngine(TransferConfig(node="reader", backend="rdma", serve=False), MemoryRegistry())
    try:
        assert node.info["transport"].startswith("rdma")
        keys = [bytes([i]) * 16 for i in range(1, 9)]
        data = os.urandom(8 << 20)
        with KVStoreClient(node.grpc, engine=engine) as client:
            assert client.put(keys, data).stored == 8
            assert client.get(keys).data.tobytes() == data
    finally:
        engine.close()
        node.stop()


def test_the_chart_gives_rdma_pods_the_nic_ipc_lock_and_the_flags():
    from charts import mooncake_containers, render

    for component, c, _ in mooncake_containers(render()):  # off by default: nothing of it
        assert "IPC_LOCK" not in str(c["securityContext"]) and not any("rdma" in a for a in c["args"]), component
    docs = render("--set", "rdma.enabled=true", "--set", "rdma.device=mlx5_0", "--set", "rdma.gidIndex=3")
    movers = {
        component: c for component, c, _ in mooncake_containers(docs) if component in ("prefill", "kvstore", "decode")
    }
    assert set(movers) == {"prefill", "kvstore", "decode"}
    for component, c in movers.items():
        flag = "--backend" if component == "kvstore" else "--transfer-backend"
        assert {f"{flag}=rdma", "--rdma-device=mlx5_0", "--rdma-gid-index=3"} <= set(c["args"]), component
        assert c["resources"]["limits"]["rdma/rdma_shared_device_a"] == 1, component
        assert c["resources"]["requests"]["rdma/rdma_shared_device_a"] == 1, component
        assert c["securityContext"]["capabilities"]["add"] == ["IPC_LOCK"], component
        assert c["securityContext"]["capabilities"]["drop"] == ["ALL"], component
    # the flags are ones the components accept
    from kvstore.__main__ import parse_args as kv_args
    from prefill.server import parse_args as prefill_args

    got = kv_args(
        ["--block-bytes", "4096", "--dram-blocks", "4", "--backend=rdma", "--rdma-device=mlx5_0", "--rdma-gid-index=3"]
    )
    assert (got.transfer_backend, got.rdma_device, got.rdma_gid_index) == ("rdma", "mlx5_0", 3)
    got = prefill_args(["--model", "m", "--kvstore", "k:1", "--transfer-backend=rdma", "--rdma-gid-index=3"])
    assert (got.transfer_backend, got.rdma_gid_index) == ("rdma", 3)


# -- the whole backend on an in-process fabric (tests/fakeverbs.py: pyverbs' interface, no NIC) ------


@pytest.fixture
def rdma_pair(fabric, shm_dir):
    registry = MemoryRegistry()
    owner = TransferEngine(TransferConfig(node="owner", shm_dir=shm_dir), registry)  # auto: registers its segments
    owner.allocate("mem", 4 << 20)
    owner.buffer("owner/mem")[:] = os.urandom(4 << 20)
    peer = TransferEngine(
        TransferConfig(node="peer", backend="rdma", shm_dir=shm_dir, rdma_qp_depth=8, rdma_signal_every=3), registry
    )
    yield owner, peer
    peer.close()
    owner.close()


def test_reads_and_writes_move_the_exact_bytes_over_queue_pairs(rdma_pair, fabric):
    from transfer import Slice

    owner, peer = rdma_pair
    assert owner.segment("owner/mem").rdma_rkey is not None and peer.transport.startswith("rdma: fake0 port 1 (RoCE")
    remote = owner.buffer("owner/mem")
    local = bytearray(3 << 20)
    # 1 MiB slices cut into 16 requests of 64 KiB each, 3 slices: 33 requests through an 8-deep send queue
    slices = [
        Slice(2 << 20, "owner/mem", 12345, 1 << 20),
        Slice(0, "owner/mem", (3 << 20) - 7, 300_001),
        Slice(1 << 20, "owner/mem", 0, 17),
    ]
    peer.read(local, slices).wait(10)
    for s in slices:
        assert local[s.local_offset : s.local_offset + s.length] == remote[s.remote_offset : s.remote_offset + s.length]
    payload = os.urandom(2 << 20)
    peer.write(payload, [Slice(0, "owner/mem", 5, 1 << 20), Slice(1 << 20, "owner/mem", (2 << 20) + 3, 1 << 20)]).wait(
        10
    )
    assert bytes(remote[5 : 5 + (1 << 20)]) == payload[: 1 << 20]
    assert bytes(remote[(2 << 20) + 3 : (3 << 20) + 3]) == payload[1 << 20 :]
    assert fabric.errors == [] and 0 < fabric.most_outstanding <= 8  # never past the queue depth
    assert fabric.posted == 16 + 5 + 1 + 2 * 16  # every request cut to 64 KiB: 54 went over the fabric
    assert peer.moved()[("rdma", "read")] == (1, sum(s.length for s in slices))
    assert fabric.open_regions() == 1  # the caller's buffers were registered per batch, and deregistered after it


def test_a_pinned_buffer_is_registered_once_for_every_batch(rdma_pair, fabric):
    """A worker's KV cache or mapped pool segment: registered once, not per batch (pinning a large buffer each time
    is slow on a NIC); an unpinned buffer is registered for its batch alone."""
    from transfer import Slice

    owner, peer = rdma_pair
    cache = bytearray(8 << 20)
    peer.pin(cache)
    registered = len(fabric.regions)
    for i in range(4):
        peer.read(cache, [Slice(i << 20, "owner/mem", i * 4096, 1 << 20)]).wait(10)
        peer.write(cache, [Slice(i << 20, "owner/mem", (2 << 20) + i * 8192, 4096)]).wait(10)
    assert len(fabric.regions) == registered  # no region per batch
    assert bytes(cache[3 << 20 : 4 << 20]) == bytes(owner.buffer("owner/mem")[3 * 4096 : 3 * 4096 + (1 << 20)])
    peer.unpin(cache)
    assert fabric.open_regions() == registered - 1
    peer.read(cache, [Slice(0, "owner/mem", 0, 4096)]).wait(10)  # unpinned: a region for the batch, dropped after
    assert len(fabric.regions) == registered + 1 and fabric.open_regions() == registered - 1


def test_an_error_fails_exactly_the_batch_on_that_queue_pair_names_the_peer_and_the_next_batch_reconnects(
    rdma_pair, fabric
):
    from transfer import Slice, TransferError

    owner, peer = rdma_pair
    out = bytearray(1 << 20)
    peer.read(out, [Slice(0, "owner/mem", 0, 1 << 20)]).wait(10)  # connected
    qps_before = set(fabric.qps)
    fabric.fail_next = True
    with pytest.raises(TransferError, match="peer 'owner' .*RDMA work failed"):
        peer.read(out, [Slice(0, "owner/mem", 0, 1 << 20)]).wait(10)
    fresh = bytearray(1 << 20)
    peer.read(fresh, [Slice(0, "owner/mem", 4096, 1 << 20)]).wait(10)  # a new queue pair for the next batch
    assert bytes(fresh) == bytes(owner.buffer("owner/mem")[4096 : 4096 + (1 << 20)])
    assert set(fabric.qps) - qps_before  # the broken one was replaced
    # the owner frees its half of the broken pair (its session ended), and of the live one once the peer is gone
    wait_for(lambda: len(owner._rdma._accepted) == 1)
    assert len(fabric.qps) == 2
    peer.close()
    wait_for(lambda: not owner._rdma._accepted)
    assert not fabric.qps
    assert not peer._rdma._poller.is_alive()  # its completion thread ended with it


def test_a_timed_out_batch_stops_its_queue_pair_and_the_next_batch_gets_a_new_one(rdma_pair, fabric):
    """Completions 0.3 s late (a NIC's latency, much magnified): a batch waited on for 50 ms fails as timed out, its
    queue pair goes to the error state (the NIC may no longer touch the buffer), the late completions change
    nothing, and the next batch reads the right bytes over a new pair."""
    import time

    from transfer import Slice, TransferError, TransferState

    owner, peer = rdma_pair
    peer.read(bytearray(4096), [Slice(0, "owner/mem", 0, 4096)]).wait(10)  # connected
    qps_before = set(fabric.qps)
    fabric.completion_delay_s = 0.3
    batch = peer.read(bytearray(1 << 20), [Slice(0, "owner/mem", 0, 1 << 20)])
    with pytest.raises(TransferError, match="timed out"):
        batch.wait(0.05)
    assert batch.state is TransferState.FAILED
    time.sleep(0.5)  # every late completion is in by now
    fresh = bytearray(1 << 20)
    peer.read(fresh, [Slice(0, "owner/mem", 4096, 1 << 20)]).wait(10)  # waits out the delay: the thread polls on
    assert bytes(fresh) == bytes(owner.buffer("owner/mem")[4096 : 4096 + (1 << 20)])
    assert set(fabric.qps) - qps_before and fabric.errors == []


def test_a_pool_node_serves_puts_and_gets_over_rdma_in_process(fabric, shm_dir):
    """KVStoreNode and its gRPC service in this process, a client whose engine is forced to rdma: every block's
    bytes go over the fabric's queue pairs, and read back equal."""
    from kvstore.config import StoreConfig
    from kvstore.service import KVStoreNode, start_server

    node = KVStoreNode(
        StoreConfig(node="kvf", block_bytes=256 << 10, dram_blocks=16),
        TransferConfig(node="kvf", shm_dir=shm_dir),
        MemoryRegistry(),
    )
    service = start_server(node, "127.0.0.1", 0)
    engine = TransferEngine(TransferConfig(node="client", backend="rdma", serve=False), MemoryRegistry())
    try:
        assert node.segment.rdma_rkey is not None
        keys = [bytes([i]) * 16 for i in range(1, 9)]
        data = os.urandom(8 * (256 << 10))
        with KVStoreClient(f"127.0.0.1:{service.grpc_port}", engine=engine) as client:
            assert client.put(keys, data).stored == 8
            assert client.get(keys).data.tobytes() == data
        assert engine.moved()[("rdma", "write")][1] == len(data) and engine.moved()[("rdma", "read")][1] == len(data)
        assert fabric.errors == []
    finally:
        engine.close()
        service.stop()
        node.close()


# -- a pool node in its own process, over rdma ---------------------------------------------------------


@pytest.mark.parametrize("transport", ["fake-rdma", pytest.param("rdma", marks=pytest.mark.rdma)], indirect=True)
def test_a_stopped_pool_node_still_serves_over_rdma_and_a_killed_one_fails_naming_it(transport, shm_dir):
    """One-sided: the owner's CPU takes no part, so a node stopped with SIGSTOP still serves a read (over tcp the
    same read stalls: test_transfer.py). Killed, its queue pair fails the batch with its name, and so does the
    next batch's reconnect."""
    import signal

    from transfer import Slice, TransferError

    mib = 1 << 20
    node = start_node("victim", mib, 16, shm_dir=shm_dir)
    reader = TransferEngine(TransferConfig(node="reader", serve=False), MemoryRegistry())
    try:
        with KVStoreClient(node.grpc) as kv:
            keys = [i.to_bytes(16, "little") for i in range(1, 9)]
            kv.put(keys, bytes(range(256)) * (8 * mib // 256))
            got = kv.get_locations(keys)
        reader.add_segment(segment_from_pb(got.segment))
        slices = [Slice(i * mib, got.segment.name, s.offset, mib, got.lease_id) for i, s in enumerate(got.slots)]
        out = bytearray(8 * mib)
        reader.read(out, slices[:1]).wait(30)  # connected first (the handshake needs the node's CPU)
        node.kill(signal.SIGSTOP)
        reader.read(out, slices).wait(30)
        assert out == bytes(range(256)) * (8 * mib // 256) and reader.moved()[("rdma", "read")] == (2, 9 * mib)
        node.kill(signal.SIGKILL)
        with pytest.raises(TransferError, match="peer 'victim' at .*RDMA work failed"):
            reader.read(out, slices[:1]).wait(30)
        with pytest.raises(TransferError, match="peer 'victim' at .*RDMA connection failed"):
            reader.read(out, slices[:1]).wait(30)
    finally:
        node.stop()
        reader.close()


@pytest.mark.parametrize("transport", ["fake-rdma", pytest.param("rdma", marks=pytest.mark.rdma)], indirect=True)
def test_the_transfer_benchmark_measures_rdma(transport, tmp_path):
    """``python -m benchmarks.transfer_bench --backend rdma`` end to end, briefly: its owner process registers the
    segment, and rdma reads and writes are measured without error (on the fake fabric, the figures are
    process_vm_readv's, not a NIC's)."""
    import json

    out = tmp_path / "bench.json"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.transfer_bench",
            "--backend",
            "rdma",
            "--no-tune",
            "--seconds",
            "0.1",
            "--rounds",
            "1",
            "--sizes",
            "64KiB",
            "--batch-slices",
            "0",
            "--no-progress",
            "--json",
            str(out),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    cells = [c for c in json.loads(out.read_text())["cells"] if c["system"] == "rdma"]
    assert {c["op"] for c in cells} == {"read", "write"}
    assert all(c["error"] is None and c["ops"] > 0 for c in cells), cells


# -- a serving cluster whose KV moves over rdma ------------------------------------------------------


@pytest.mark.parametrize("transport", ["fake-rdma", pytest.param("rdma", marks=pytest.mark.rdma)], indirect=True)
def test_a_cluster_whose_kv_moves_over_rdma_serves_one_engines_tokens(transport, tiny_dir, tmp_path):
    """Every component forced to rdma ($MOONCAKE_TRANSFER_BACKEND): a prefill worker writes each request's KV into the
    decode worker's landing slots and into its pool node over queue pairs; the other prefill worker reads that
    prefix from the first one's pool node over them; every answer is one engine's tokens."""
    import random

    import httpx
    from clusters import backend, conductor, generate, instances, reference_tokens, start_cluster, tokens
    from prometheus_client.parser import text_string_to_metric_families

    from protos import conductor_pb2 as cpb

    cluster = start_cluster(tiny_dir, tmp_path / "run", prefill=2, decode=1)
    try:
        for name in ("prefill-0", "prefill-1", "decode-0", "kv0", "kv1"):
            assert cluster.components[name].info["transport"].startswith("rdma: "), name  # what each READY line says
        rng = random.Random(22)
        shared = [rng.randrange(10, 290) for _ in range(160)]  # 10 blocks of 16
        stub, listed, be = conductor(cluster), instances(cluster), backend(cluster)
        got = {}
        for i, (draining, tail) in enumerate((("prefill-1", [5, 6, 7]), ("prefill-0", [8, 9, 10, 11]))):
            stub.Drain(cpb.DrainRequest(id=draining), timeout=5)  # the request goes to the other prefill worker
            got[i] = generate(be, f"rdma-{i}", shared + tail, 12, temperature=0.0, ignore_eos=True)
            assert tokens(got[i]) == reference_tokens(tiny_dir, shared + tail, 12)
            w = listed[draining]  # a drained worker comes back by registering again
            stub.Register(
                cpb.RegisterRequest(
                    id=w.id, role=w.role, address=w.address, node=w.node, model=w.model, capacity=w.capacity
                ),
                timeout=5,
            )
        assert got[1][-1].cached_tokens_by_tier == {"remote": 160}  # prefill-1 read prefill-0's blocks from kv0

        def moved(component: str) -> dict:
            text = httpx.get(f"http://{cluster.components[component].info['metrics']}/metrics", timeout=5).text
            return {
                tuple(s.labels.values()): s.value
                for f in text_string_to_metric_families(text)
                for s in f.samples
                if s.name == "mooncake_transfer_bytes_total"
            }

        first, second = moved("prefill-0"), moved("prefill-1")
        assert {b for b, _ in first} | {b for b, _ in second} == {"rdma"}  # nothing went over tcp or shm
        block = cluster.components["prefill-0"].info["block_bytes"]
        assert second[("rdma", "read")] == 10 * block  # the prefix, over queue pairs
        assert first[("rdma", "write")] > 0 and second[("rdma", "write")] > 0  # each request's KV to the decode worker
    finally:
        cluster.stop()
