"""Pool nodes as real processes on loopback: put on one, read on the other; restart after kill -9; events; errors."""

from __future__ import annotations

import os
import signal
import struct
import subprocess
import sys
import threading
import urllib.request
import uuid

import grpc
import pytest
from kvnodes import REPO, free_port, start_node

from kvstore.client import KVStoreClient, KVStoreUnavailable
from kvstore.control import METHODS
from kvstore.events import Tier
from kvstore.records import StoreFull
from mooncake import tls
from mooncake.blocks import block_keys, model_fingerprint
from mooncake.runtime.framed import ControlAddress, ControlChannel, ControlError
from protos import kvstore_pb2 as pb
from transfer import RedisRegistry, TransferConfig, TransferEngine

BB = 256 * 1024  # bytes per block
FP = model_fingerprint("test-model")


def chain(n: int, seed: int) -> list[bytes]:
    """Real block keys: a chain over n blocks of 16 tokens."""
    return block_keys([(seed * 1000 + i) % 30000 for i in range(16 * n)], 16, FP)


@pytest.fixture
def nodes(shm_dir, transport):
    """Start pool nodes; every test using them runs over each transport (tests/conftest.py ``transport``)."""
    started = []

    def start(name, *extra, dram_blocks=32):
        node = start_node(name, BB, dram_blocks, *extra, shm_dir=shm_dir)
        started.append(node)
        return node

    yield start
    for node in started:
        node.stop()


def client_over(backend: str):
    """A function making clients whose engine is forced to ``backend`` (tcp or rdma: what a client on another host
    uses; shm: one on this host)."""

    def connect(address: str) -> KVStoreClient:
        engine = TransferEngine(TransferConfig(node=f"client-{uuid.uuid4().hex[:6]}", backend=backend, serve=False))
        client = KVStoreClient(address, engine=engine)
        client._own_engine = True  # closed with the client
        return client

    return connect


tcp_client = client_over("tcp")


@pytest.mark.parametrize("backend", ["tcp", "shm", None], ids=["tcp", "shm", "as-configured"])
def test_put_on_one_node_read_on_the_other(nodes, backend, transport):
    """b pulls a's blocks over ``backend`` (as configured: shm here, rdma in the transport's rdma ways)."""
    a = nodes("a")
    b = nodes("b", "--metrics-port", "0", *(["--backend", backend] if backend else []))  # how b reaches a when it pulls
    carrier = backend or ("shm" if transport == "auto" else "rdma")
    keys, data = chain(6, seed=1), os.urandom(6 * BB)
    connect = client_over(backend) if backend else KVStoreClient
    with connect(a.grpc) as ca, connect(b.grpc) as cb:
        assert ca.put(keys, data).stored == 6
        assert cb.lookup(keys).prefix_blocks == 0
        pulled = cb.pull(a.grpc, keys[:4] + chain(2, seed=9))  # a's prefix, then keys nobody has
        assert (pulled.pulled, pulled.missing) == (4, 2)
        got = cb.get(keys)
        assert got.num_blocks == 4 and bytes(got.data) == data[: 4 * BB]
        assert cb.stats().dram.used_blocks == 4
        assert cb.pull(a.grpc, keys).pulled == 2  # only what b lacks moves
        assert bytes(cb.get(keys).data) == data
        assert (
            ca.engine.moved()[(carrier, "write")] == (1, 6 * BB) and cb.engine.moved()[(carrier, "read")][1] == 10 * BB
        )
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://{b.info['metrics']}/metrics", timeout=10).read().decode()
    pulled_bytes = {
        tuple(s.labels.values()): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == "mooncake_transfer_bytes_total"
    }
    assert pulled_bytes == {(carrier, "read"): 6 * BB}  # b's pulls, all over the carrier


def test_client_errors_are_clear(nodes):
    a = nodes("a", "--high-watermark", "1", "--low-watermark", "1", dram_blocks=4)
    with KVStoreClient(a.grpc) as c:
        with pytest.raises(ValueError, match="bytes for 2 blocks"):
            c.put(chain(2, 1), b"x" * BB)
        c._block_bytes = BB // 2  # a worker configured for another model
        with pytest.raises(ValueError, match="does not match this store's"):
            c.put(chain(1, 1), b"x" * (BB // 2))
        c._block_bytes = None
        with pytest.raises(ValueError, match="16 bytes"):
            c.lookup([b"short"])
        with pytest.raises(KeyError, match="no lease"):
            c.release("nope")
        with pytest.raises(KeyError, match="no reservation"):
            c.commit("nope")
        keys = chain(4, 2)
        c.put(keys, os.urandom(4 * BB))
        lease = c.get_locations(keys)
        with pytest.raises(StoreFull):
            c.put(chain(1, 3), os.urandom(BB))
        c.release(lease.lease_id)
        assert c.put(chain(1, 3), os.urandom(BB)).stored == 1
    a.stop()
    with KVStoreClient(a.grpc, timeout_s=2) as c, pytest.raises(KVStoreUnavailable):
        c.stats()


def test_hot_calls_take_the_control_fast_path_with_the_same_answers(nodes):
    a = nodes("a")
    keys, data = chain(3, seed=5), os.urandom(3 * BB)
    with KVStoreClient(a.grpc) as fast, KVStoreClient(a.grpc, control="grpc") as slow:
        assert fast.put(keys, data).stored == 3
        assert fast._control.address.target == "unix:" + a.info["control_uds"]  # same host: the Unix socket
        assert slow._control is None
        assert bytes(slow.get(keys).data) == data  # one store behind both paths
        got = fast.get(keys)
        assert bytes(got.data) == data and got.dram_hits == 3
        assert fast.stats().leases == 0  # the get's one-way release was handled before the next call
        with pytest.raises(KeyError, match="no lease"):
            fast.release("nope")
    with KVStoreClient(a.grpc, control="tcp") as remote:  # the tcp port, as another host reaches it
        assert remote.get(keys).dram_hits == 3 and remote._control.address.target == a.info["control"]
    chan = ControlChannel(ControlAddress(a.info["control"]), METHODS)
    try:
        got = chan.call("Get", pb.GetRequest(keys=keys, block_bytes=BB), timeout=5)
        assert [s.key for s in got.slots] == keys and got.segment.name == a.info["segment"]
        with pytest.raises(ControlError) as err:
            chan.call("Get", pb.GetRequest(keys=keys, block_bytes=BB + 1), timeout=5)
        assert err.value.code is grpc.StatusCode.INVALID_ARGUMENT
        chan.call("Release", pb.ReleaseRequest(lease_id=got.lease_id), timeout=5)
        assert chan.call("Stats", pb.StatsRequest(), timeout=5).leases == 0
    finally:
        chan.close()


def test_control_port_survives_garbage(nodes):
    a = nodes("a")
    host, port = a.info["control"].rsplit(":", 1)
    with tls.create_connection((host, int(port)), 5) as s:
        s.sendall(struct.pack("<BBI", 99, 0, 0))  # a method that does not exist
        code, length = struct.unpack("<BI", s.recv(5))
        assert code == grpc.StatusCode.UNIMPLEMENTED.value[0] and b"unknown control method" in s.recv(length)
        s.sendall(struct.pack("<BBI", 1, 0, 1 << 30))  # a frame over the size limit: the node hangs up
        assert s.recv(16) == b""
    with KVStoreClient(a.grpc) as c:
        assert c.stats().node == "a"  # and keeps serving everyone else


def test_a_client_outlives_a_node_restart(nodes):
    ports = ["--port", str(free_port()), "--control-port", str(free_port())]
    a = nodes("a", *ports)
    keys, first, second = chain(2, seed=6), os.urandom(2 * BB), os.urandom(2 * BB)
    with KVStoreClient(a.grpc, timeout_s=3) as c:
        c.put(keys, first)
        a.kill(signal.SIGKILL)
        with pytest.raises(KVStoreUnavailable):
            c.get(keys)
        again = nodes("a", *ports)
        assert c.get(keys).num_blocks == 0  # DRAM died with the process; the client reconnected
        with KVStoreClient(again.grpc) as other:
            other.put(keys, second)
        assert bytes(c.get(keys).data) == second  # the new segment file, not a stale mapping of the old one


def test_kill_9_then_restart_re_adopts_ssd_blocks(nodes, tmp_path):
    ssd = ["--ssd-dir", str(tmp_path / "ssd"), "--ssd-blocks", "32"]
    a = nodes("a", *ssd, dram_blocks=4)
    keys, data = chain(10, seed=4), os.urandom(10 * BB)
    with KVStoreClient(a.grpc) as c:
        for i, k in enumerate(keys):  # one by one: the oldest are demoted to SSD as DRAM fills
            c.put([k], data[i * BB : (i + 1) * BB], positions=[i])
        tiers = c.lookup(keys).tiers
    on_ssd = [i for i, t in enumerate(tiers) if t is Tier.SSD]
    assert len(on_ssd) >= 6
    a.kill(signal.SIGKILL)
    again = nodes("a", *ssd, dram_blocks=8)
    assert again.info["adopted_blocks"] == len(on_ssd)
    with KVStoreClient(again.grpc) as c:
        snap = next(iter(c.subscribe(snapshot=True)))
        assert snap.reset and {e.key for e in snap.events} == {keys[i] for i in on_ssd}
        assert all(e.tier == pb.SSD for e in snap.events)
        prefix = on_ssd[: next((j for j, i in enumerate(on_ssd) if i != j), len(on_ssd))]
        got = c.get(keys)
        assert got.num_blocks == len(prefix) and bytes(got.data) == data[: len(prefix) * BB]
        assert got.ssd_hits == len(prefix)


def test_flipped_byte_in_an_ssd_block_is_a_reported_miss(nodes, tmp_path):
    ssd_dir = tmp_path / "ssd"
    a = nodes(
        "a",
        "--ssd-dir",
        str(ssd_dir),
        "--ssd-blocks",
        "8",
        "--high-watermark",
        "1",
        "--low-watermark",
        "1",
        dram_blocks=3,
    )
    keys, data = chain(3, seed=5), os.urandom(3 * BB)
    with KVStoreClient(a.grpc) as c:
        c.put(keys, data)
        c.put(chain(1, seed=50), os.urandom(BB))  # keys[0] goes to SSD slot 0
        assert c.lookup(keys[:1]).tiers == [Tier.SSD]
        with open(ssd_dir / "slots-0000.bin", "r+b") as f:
            f.seek(4096 + 777)
            b = f.read(1)
            f.seek(4096 + 777)
            f.write(bytes([b[0] ^ 0x80]))
        got = c.get(keys)
        assert got.num_blocks == 0 and got.corrupt == [keys[0]]
        assert c.stats().corrupt_blocks == 1
        assert c.lookup(keys).prefix_blocks == 0


def test_events_stream_what_is_stored_and_removed(nodes):
    a = nodes("a", "--high-watermark", "1", "--low-watermark", "1", dram_blocks=2)
    seen: list[pb.Event] = []
    done = threading.Event()
    with KVStoreClient(a.grpc) as c:
        keys = chain(3, seed=6)

        def follow():
            for batch in c.subscribe(from_seq=1):
                seen.extend(batch.events)
                if len(seen) >= 4:
                    done.set()
                    return

        t = threading.Thread(target=follow, daemon=True)
        t.start()
        c.put(keys[:2], os.urandom(2 * BB))
        c.put(keys[2:], os.urandom(BB))  # evicts keys[0] (no SSD tier: it is gone)
        assert done.wait(10)
    kinds = [(e.kind, e.key, e.tier) for e in seen[:4]]
    assert kinds == [
        (pb.Event.STORED, keys[0], pb.DRAM),
        (pb.Event.STORED, keys[1], pb.DRAM),
        (pb.Event.REMOVED, keys[0], pb.DRAM),
        (pb.Event.STORED, keys[2], pb.DRAM),
    ]
    assert [e.seq for e in seen[:4]] == [1, 2, 3, 4]


def test_nodes_publish_segments_in_redis(nodes, redis_url):
    a = nodes("a", "--redis-url", redis_url)
    b = nodes("b", "--redis-url", redis_url, "--backend", "tcp")
    registry = RedisRegistry(redis_url)
    assert {s.name for s in registry.list()} == {"a/dram", "b/dram"}
    assert registry.get("a/dram").tcp_addr == a.info["tcp"]
    keys, data = chain(2, seed=7), os.urandom(2 * BB)
    with KVStoreClient(a.grpc) as ca, tcp_client(b.grpc) as cb:
        ca.put(keys, data)
        assert cb.pull(a.grpc, keys).pulled == 2
        assert bytes(cb.get(keys).data) == data
    a.stop()  # a clean stop unregisters
    assert {s.name for s in registry.list()} == {"b/dram"}


# A worker process that leases and reserves under its id, says so, and waits to be killed.
HOLDER = """
import sys, time
from kvstore.client import KVStoreClient
address, owner, leased, reserved = sys.argv[1:]
kv = KVStoreClient(address, owner=owner)
lease = kv.get_locations([bytes.fromhex(k) for k in leased.split(",")])
res = kv.reserve([bytes.fromhex(k) for k in reserved.split(",")], ttl_s=600)
print("HELD", lease.lease_id, res.reservation_id, flush=True)
time.sleep(120)
"""


def hold(address: str, owner: str, leased: list[bytes], reserved: list[bytes]) -> tuple[subprocess.Popen, str, str]:
    """Start a holder; return it with its lease id and reservation id once it holds them."""
    args = [
        sys.executable,
        "-c",
        HOLDER,
        address,
        owner,
        ",".join(k.hex() for k in leased),
        ",".join(k.hex() for k in reserved),
    ]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    line = proc.stdout.readline().split()
    if line[:1] != ["HELD"]:
        proc.kill()
        raise RuntimeError(f"the holder did not hold: {proc.communicate(timeout=10)[1]}")
    return proc, line[1], line[2]


@pytest.mark.parametrize("control", ["auto", "grpc"])  # the control fast path's Unix socket, then gRPC alone
def test_a_restarted_worker_gets_back_at_once_what_its_killed_run_held(nodes, control):
    a = nodes("a", "--high-watermark", "1", "--low-watermark", "1", dram_blocks=5)  # full means full
    keys, data = chain(4, seed=11), os.urandom(4 * BB)
    with KVStoreClient(a.grpc) as c:
        c.put(keys[:2], data[: 2 * BB])
        idle = c.stats()
    dead, dead_lease, dead_res = hold(a.grpc, "prefill-0", keys[:1], keys[2:])
    live, _, _ = hold(a.grpc, "prefill-1", keys[1:2], chain(1, seed=12))
    try:
        dead.kill()  # kill -9 mid-prefill: nothing released, nothing committed
        dead.wait(10)
        with KVStoreClient(a.grpc, control=control, owner="prefill-0") as restarted:
            if control == "auto":
                assert restarted.block_bytes == BB and restarted._control.address.target.startswith("unix:")
            with pytest.raises(StoreFull):  # every slot is leased or reserved
                restarted.put(keys[2:], data[2 * BB :])
            assert restarted.release_owner() == (1, 1)
            stats = restarted.stats()
            assert (stats.leases, stats.reservations, stats.dram.reserved_blocks) == (1, 1, 1)  # prefill-1's stay
            with pytest.raises(KeyError, match="no reservation"):
                restarted.commit(dead_res)
            with pytest.raises(KeyError, match="no lease"):
                restarted.release(dead_lease)
            assert restarted.put(keys[2:], data[2 * BB :]).stored == 2  # the dead run's slots, free at once
            got = restarted.get(keys)
            assert got.num_blocks == 4 and bytes(got.data) == data
            assert restarted.release_owner() == (0, 0)
        with KVStoreClient(a.grpc, control=control) as anyone:
            if control == "auto":
                anyone.block_bytes  # noqa: B018  (learns the fast path)
            with pytest.raises(ValueError, match="owner"):
                anyone.release_owner()  # no owner: refused, nothing released
            assert anyone.stats().leases == 1
            live.kill()
            live.wait(10)
            assert anyone.release_owner("prefill-1") == (1, 1)
            stats = anyone.stats()
            assert (
                (stats.leases, stats.reservations, stats.dram.reserved_blocks)
                == (idle.leases, idle.reservations, 0)
                == (0, 0, 0)
            )
    finally:
        for proc in (dead, live):
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
