"""The Conductor as a real process: registration, event-fed index, Schedule, dead instances, Redis recovery, metrics."""

from __future__ import annotations

import os
import signal
import threading
import time
import urllib.request

import grpc
import pytest
from kvnodes import start_conductor, start_node, wait_for

from kvstore.client import KVStoreClient
from mooncake import tls
from mooncake.blocks import block_keys, model_fingerprint
from protos import conductor_pb2 as pb
from protos import conductor_pb2_grpc as pb_grpc

BB = 64 * 1024
BLOCK_TOKENS = 16
FP = model_fingerprint("conductor-test")


def chain(n: int, seed: int) -> list[bytes]:
    return block_keys([(seed * 997 + i) % 30000 for i in range(BLOCK_TOKENS * n)], BLOCK_TOKENS, FP)


class Beater:
    """Heartbeats for the given instance ids, as their workers would, until told to stop one."""

    def __init__(self) -> None:
        self.stub: pb_grpc.ConductorStub | None = None
        self.ids: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            stub = self.stub
            for instance_id in list(self.ids):
                try:
                    stub.Heartbeat(pb.HeartbeatRequest(id=instance_id, load=pb.Load()), timeout=2)
                except (grpc.RpcError, AttributeError):
                    pass

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


@pytest.fixture
def cluster(shm_dir):
    """A conductor, kvstore nodes kvA and kvB, prefill p0 (on kvA) and p1 (on kvB), decode d0; all heartbeating."""
    procs = []
    beater = Beater()

    class Cluster:
        def start_conductor(self, *extra):
            # the prefill placement algorithms: every prompt on a prefill worker
            # (test_conductor_local: the decode worker)
            self.conductor = start_conductor("--heartbeat-timeout", "1.5", "--local-prefill", "never", *extra)
            procs.append(self.conductor)
            self.channel = tls.grpc_channel(self.conductor.info["grpc"])
            self.stub = pb_grpc.ConductorStub(self.channel)
            beater.stub = self.stub
            return self.stub

        def register_all(self):
            for node in (self.kv_a, self.kv_b):
                self.register(node.info["node"], pb.KVSTORE, node.grpc, node.info["node"])
            self.register("p0", pb.PREFILL, "127.0.0.1:1", "kvA")
            self.register("p1", pb.PREFILL, "127.0.0.1:2", "kvB")
            self.register("d0", pb.DECODE, "127.0.0.1:3", "kvA", capacity=64)

        def register(self, instance_id, role, address, node, capacity=0):
            self.stub.Register(
                pb.RegisterRequest(id=instance_id, role=role, address=address, node=node, capacity=capacity)
            )
            beater.ids.add(instance_id)

        def instances(self):
            return {i.id: i for i in self.stub.ListInstances(pb.ListInstancesRequest()).instances}

        def wait_indexed(self, instance_id, blocks, timeout=10):
            deadline = time.monotonic() + timeout
            while self.instances()[instance_id].indexed_blocks != blocks:
                if time.monotonic() > deadline:
                    raise AssertionError(
                        f"{instance_id} never had {blocks} indexed blocks: {self.instances()[instance_id]}"
                    )
                time.sleep(0.05)

        def schedule(self, keys, extra_tokens=5, **kw):
            return self.stub.Schedule(
                pb.ScheduleRequest(
                    request_id=os.urandom(4).hex(),
                    keys=keys,
                    prompt_tokens=len(keys) * BLOCK_TOKENS + extra_tokens,
                    block_tokens=BLOCK_TOKENS,
                    **kw,
                ),
                timeout=5,
            )

    c = Cluster()
    c.beater = beater
    c.kv_a = start_node("kvA", BB, 64, shm_dir=shm_dir)
    c.kv_b = start_node("kvB", BB, 64, shm_dir=shm_dir)
    procs += [c.kv_a, c.kv_b]
    yield c
    beater.stop()
    for p in procs:
        p.stop()


def test_a_chain_stored_in_parts_counts_whole_only_when_each_part_names_its_parent(cluster):
    """A prefill worker stores a prompt's new blocks after the ones the pool had (positions k.., parent = block k-1):
    the pool node's events carry each block's parent, and the index counts the chain to its end. A part stored
    without its parent does not count (the index cannot tell it belongs below the prefix) until a later put names it."""
    cluster.start_conductor()
    cluster.register_all()
    keys = chain(10, seed=3)
    with KVStoreClient(cluster.kv_b.grpc) as kv:
        kv.put(keys[:4], os.urandom(4 * BB))
        kv.put(keys[4:7], os.urandom(3 * BB), positions=[4, 5, 6], parent=keys[3])
        kv.put(keys[7:], os.urandom(3 * BB), positions=[7, 8, 9])  # no parent: these three never count
    cluster.wait_indexed("kvB", 10)
    assert cluster.schedule(keys).placement.plan.local_blocks == 7
    with KVStoreClient(cluster.kv_b.grpc) as kv:
        kv.put(
            keys[7:], os.urandom(3 * BB), positions=[7, 8, 9], parent=keys[6]
        )  # stored already: the node learns the parent
    deadline = time.monotonic() + 10
    while cluster.schedule(keys).placement.plan.local_blocks != 10:
        assert time.monotonic() < deadline, "the index never counted the blocks whose parent came later"
        time.sleep(0.05)


def test_schedule_uses_the_index_fed_by_kvstore_events(cluster):
    stub = cluster.start_conductor()
    cluster.register_all()
    keys = chain(8, seed=1)
    with KVStoreClient(cluster.kv_b.grpc) as kv:
        kv.put(keys, os.urandom(8 * BB))
    cluster.wait_indexed("kvB", 8)

    placed = cluster.schedule(keys).placement
    assert (placed.prefill_id, placed.prefill_node, placed.decode_id) == ("p1", "kvB", "d0")
    same = cluster.schedule(
        [], extra_tokens=len(keys) * BLOCK_TOKENS + 5, key_chain=b"".join(keys)
    ).placement  # keys as one blob
    assert same.plan.local_blocks + same.plan.fetch_blocks == 8 and same.plan.compute_tokens == 5
    assert (placed.plan.local_blocks, placed.plan.fetch_blocks, placed.plan.compute_tokens) == (8, 0, 5)

    stub.Drain(pb.DrainRequest(id="p1"))  # only p0 is left: it must pull kvB's prefix (Algorithm 1)
    placed = cluster.schedule(keys).placement
    assert placed.prefill_id == "p0"
    assert (placed.plan.fetch_node, placed.plan.fetch_address, placed.plan.fetch_blocks) == (
        "kvB",
        cluster.kv_b.grpc,
        8,
    )
    assert placed.plan.keep_fetched

    stub.SetPolicy(pb.SetPolicyRequest(policy="cache_aware_local"))
    placed = cluster.schedule(keys).placement
    assert (placed.prefill_id, placed.plan.fetch_blocks, placed.plan.compute_tokens) == ("p0", 0, 8 * BLOCK_TOKENS + 5)

    listed = stub.ListInstances(pb.ListInstancesRequest())
    assert listed.policy == "cache_aware_local" and listed.scheduled == 4 and listed.index_blocks == 8

    with KVStoreClient(cluster.kv_b.grpc) as kv:  # fill kvB past its watermark: evicted blocks leave the index
        for i in range(60):
            kv.put(chain(1, seed=100 + i), os.urandom(BB))
        used = kv.stats().dram.used_blocks
        cluster.wait_indexed("kvB", used)
        still_held = kv.lookup(keys).prefix_blocks
    assert used < 68 and still_held < 8
    stub.SetPolicy(pb.SetPolicyRequest(policy="kvcache_centric"))
    assert cluster.schedule(keys).placement.plan.fetch_blocks == still_held

    metrics = urllib.request.urlopen(f"http://{cluster.conductor.info['metrics']}/metrics", timeout=5).read().decode()
    assert 'mooncake_conductor_decisions_total{outcome="scheduled",policy="kvcache_centric"} 4.0' in metrics
    assert 'mooncake_conductor_decisions_total{outcome="scheduled",policy="cache_aware_local"} 1.0' in metrics
    assert f"mooncake_conductor_index_blocks {float(used)}" in metrics


def test_bad_requests_get_clear_errors(cluster):
    stub = cluster.start_conductor()
    cluster.register_all()

    def code_and_details(call):
        with pytest.raises(grpc.RpcError) as err:
            call()
        return err.value.code(), err.value.details()

    code, details = code_and_details(lambda: cluster.schedule([], extra_tokens=64))
    assert code is grpc.StatusCode.INVALID_ARGUMENT and "empty key chain for a 64-token prompt" in details
    code, details = code_and_details(lambda: cluster.schedule(chain(2, 3), slo_class="platinum"))
    assert code is grpc.StatusCode.INVALID_ARGUMENT and "unknown SLO class 'platinum'" in details
    code, details = code_and_details(lambda: cluster.schedule([b"short"]))
    assert code is grpc.StatusCode.INVALID_ARGUMENT and "16 bytes" in details
    code, details = code_and_details(lambda: stub.SetPolicy(pb.SetPolicyRequest(policy="fastest")))
    assert code is grpc.StatusCode.INVALID_ARGUMENT and "unknown policy 'fastest'" in details
    code, details = code_and_details(lambda: cluster.schedule([], key_chain=b"x" * 20))
    assert code is grpc.StatusCode.INVALID_ARGUMENT and "whole 16-byte keys" in details
    code, _ = code_and_details(lambda: stub.Drain(pb.DrainRequest(id="nobody")))
    assert code is grpc.StatusCode.NOT_FOUND
    code, details = code_and_details(lambda: stub.Register(pb.RegisterRequest(id="x", role=pb.PREFILL, address="h:1")))
    assert code is grpc.StatusCode.INVALID_ARGUMENT and "node is required" in details
    assert not stub.Heartbeat(pb.HeartbeatRequest(id="never-registered")).known
    assert cluster.schedule([], extra_tokens=3).HasField("placement")  # a prompt shorter than a block has no keys


def test_a_worker_whose_kv_differs_from_the_clusters_is_refused_at_registration(cluster):
    """A native prefill feeding a vLLM decode would exchange KV of different engines: refused, with both named."""
    stub = cluster.start_conductor()
    native, vllm = model_fingerprint("native:model"), model_fingerprint("vllm:model")

    def register(instance_id, role, fingerprint, engine):
        return stub.Register(
            pb.RegisterRequest(
                id=instance_id,
                role=role,
                address="127.0.0.1:9",
                node="kvA",
                model="m",
                fingerprint=fingerprint,
                engine=engine,
            ),
            timeout=5,
        )

    register("p0", pb.PREFILL, native, "native")
    with pytest.raises(grpc.RpcError) as err:
        register("d0", pb.DECODE, vllm, "vllm")
    assert err.value.code() is grpc.StatusCode.FAILED_PRECONDITION
    assert "d0 (vllm engine" in err.value.details() and "p0 runs the native engine" in err.value.details()
    register("d1", pb.DECODE, native, "native")  # the same engine and model joins
    register("p0", pb.PREFILL, native, "native")  # and a restarted worker registers again under its id
    listed = {i.id: i for i in stub.ListInstances(pb.ListInstancesRequest()).instances}
    assert set(listed) == {"p0", "d1"} and listed["p0"].engine == "native"


def test_a_worker_whose_engine_lays_out_blocks_unlike_the_pool_is_refused_at_registration(cluster):
    """The pool nodes hold blocks of the bytes they registered; a worker's engine reports its own (vLLM's from the
    cache it built): one that differs (another --block-size, a layout vLLM chose) is refused, both named."""
    stub = cluster.start_conductor()
    stub.Register(
        pb.RegisterRequest(id="kvB", role=pb.KVSTORE, address="127.0.0.1:8", node="kvB", block_bytes=4096), timeout=5
    )

    def register(instance_id, block_bytes):
        return stub.Register(
            pb.RegisterRequest(
                id=instance_id,
                role=pb.PREFILL,
                address="127.0.0.1:9",
                node="kvB",
                model="m",
                fingerprint=FP,
                engine="vllm",
                block_bytes=block_bytes,
            ),
            timeout=5,
        )

    with pytest.raises(grpc.RpcError) as err:
        register("p0", 8192)
    assert err.value.code() is grpc.StatusCode.FAILED_PRECONDITION
    assert "blocks are 8192 bytes, kvB's are 4096" in err.value.details()
    register("p1", 4096)  # the pool's layout joins
    register("p2", 0)  # and a worker that does not say


def test_dead_instances_leave_scheduling_and_their_blocks_leave_the_index(cluster):
    stub = cluster.start_conductor()
    cluster.register_all()
    keys = chain(6, seed=2)
    with KVStoreClient(cluster.kv_b.grpc) as kv:
        kv.put(keys, os.urandom(6 * BB))
    cluster.wait_indexed("kvB", 6)
    assert cluster.schedule(keys).placement.prefill_id == "p1"

    cluster.beater.ids -= {"kvB", "p1"}  # both go silent; kvB's process dies too
    cluster.kv_b.kill(signal.SIGKILL)
    deadline = time.monotonic() + 10
    while {cluster.instances()[i].state for i in ("kvB", "p1")} != {pb.DEAD}:
        assert time.monotonic() < deadline, cluster.instances()
        time.sleep(0.1)
    assert stub.ListInstances(pb.ListInstancesRequest()).index_blocks == 0
    placed = cluster.schedule(keys).placement
    assert placed.prefill_id == "p0" and placed.plan.local_blocks == 0 and placed.plan.fetch_blocks == 0

    cluster.beater.ids -= {"p0"}
    deadline = time.monotonic() + 10
    while cluster.instances()["p0"].state != pb.DEAD:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    rejected = cluster.schedule(keys).rejection
    assert rejected.reason == "no_prefill_instance" and rejected.retry_after_s >= 1


def test_a_restarted_conductor_recovers_from_redis(cluster, redis_url):
    stub = cluster.start_conductor("--redis-url", redis_url)
    cluster.register_all()
    stub.SetPolicy(pb.SetPolicyRequest(policy="least_loaded", admission="none"))
    keys = chain(5, seed=3)
    with KVStoreClient(cluster.kv_a.grpc) as kv:
        kv.put(keys, os.urandom(5 * BB))
    cluster.wait_indexed("kvA", 5)

    cluster.conductor.kill(signal.SIGKILL)
    stub = cluster.start_conductor("--redis-url", redis_url)  # workers keep heartbeating the new address
    assert cluster.conductor.info["recovered_instances"] == 5
    assert (cluster.conductor.info["policy"], cluster.conductor.info["admission"]) == ("least_loaded", "none")
    cluster.wait_indexed("kvA", 5)  # rebuilt from kvA's snapshot
    listed = stub.ListInstances(pb.ListInstancesRequest())
    assert {i.id for i in listed.instances if i.state == pb.ALIVE} == {"kvA", "kvB", "p0", "p1", "d0"}
    stub.SetPolicy(pb.SetPolicyRequest(policy="cache_aware_local"))
    placed = cluster.schedule(keys).placement
    assert (placed.prefill_id, placed.plan.local_blocks) == ("p0", 5)


def test_a_pool_node_stopping_hands_its_chains_to_the_node_that_stays(shm_dir):
    """SIGTERM to a pool node (--hand-off-s, on by default: the helm chart's pool nodes, as their pod is deleted):
    before it stops, the Conductor has the other node copy every chain it holds. The copies hold the same bytes, and
    the Conductor's index has them on the node that stays."""
    procs = [start_conductor("--heartbeat-timeout", "1.5")]
    try:
        address = procs[0].info["grpc"]
        kv_a = start_node("kvA", BB, 64, "--conductor", address, shm_dir=shm_dir)
        kv_b = start_node("kvB", BB, 64, "--conductor", address, shm_dir=shm_dir)
        procs += [kv_a, kv_b]
        stub = pb_grpc.ConductorStub(tls.grpc_channel(address))

        def indexed() -> dict[str, int]:
            listed = stub.ListInstances(pb.ListInstancesRequest(role=pb.KVSTORE)).instances
            return {i.id: i.indexed_blocks for i in listed}

        chains = {tuple(chain(6, seed=5)): os.urandom(6 * BB), tuple(chain(3, seed=6)): os.urandom(3 * BB)}
        with KVStoreClient(kv_a.grpc) as kv:
            for keys, data in chains.items():
                kv.put(list(keys), data)
        wait_for(lambda: indexed() == {"kvA": 9, "kvB": 0})
        kv_a.proc.send_signal(signal.SIGTERM)
        assert kv_a.proc.wait(30) == 0
        with KVStoreClient(kv_b.grpc) as kv:
            for keys, data in chains.items():
                got = kv.get(list(keys))
                assert got.num_blocks == len(keys) and bytes(got.data) == data
        wait_for(lambda: indexed() == {"kvB": 9})
    finally:
        for p in procs:
            p.stop()
