"""mooncake.runtime.channels: ByAddress, the one cache of clients by peer address (prefill and decode workers, the
write-behind), and Conductors, the one Conductor failover (the gateway and every worker's link)."""

from __future__ import annotations

import threading

import pytest

from mooncake.runtime.channels import ByAddress, Conductors


class Client:
    def __init__(self, address: str) -> None:
        self.address, self.closed = address, False

    def close(self) -> None:
        self.closed = True


def test_one_client_per_address_made_once_even_when_threads_race_for_it():
    made: list[str] = []

    def make(address: str) -> Client:
        made.append(address)
        return Client(address)

    cache = ByAddress(make)
    start = threading.Barrier(8)
    got: list[Client] = []

    def worker() -> None:
        start.wait()
        got.append(cache.get("10.0.0.1:7000"))

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert made == ["10.0.0.1:7000"] and all(c is got[0] for c in got)
    assert cache.get("10.0.0.2:7000") is not got[0] and made == ["10.0.0.1:7000", "10.0.0.2:7000"]


def test_close_closes_every_client_that_can_be_closed_and_a_later_get_makes_a_new_one():
    cache = ByAddress(Client)
    a, b = cache.get("a"), cache.get("b")
    stubs = ByAddress(lambda address: object())  # a gRPC stub has no close
    stubs.get("c")
    cache.close()
    stubs.close()
    assert a.closed and b.closed
    again = cache.get("a")
    assert again is not a and not again.closed


def test_conductors_move_to_the_next_once_however_many_callers_saw_the_failure():
    conductors = Conductors(" a:1 , b:2,c:3 ")
    assert conductors.addresses == ["a:1", "b:2", "c:3"] and conductors.current == "a:1"
    assert conductors.failed("a:1") is True and conductors.current == "b:2"
    assert conductors.failed("a:1") is False and conductors.current == "b:2"  # a second caller's stale failure
    assert conductors.failed("b:2") and conductors.failed("c:3") and conductors.current == "a:1"  # round the ring
    alone = Conductors("a:1")
    assert alone.failed("a:1") is False and alone.current == "a:1"
    with pytest.raises(ValueError, match="no Conductor address"):
        Conductors(" , ")


def test_a_new_connection_to_a_peer_slow_to_answer_waits_for_it_and_the_call_succeeds(tmp_path):
    """A peer that takes 0.5 s to answer a new connection (its process stopped meanwhile; under load, the TLS handshake
    on saturated cores): the call on a fresh channel gets its answer. With gRPC's least connect attempt at 100 ms, the
    attempt timed out before the server's SETTINGS frame and the call failed UNAVAILABLE at once (an abort storm saw
    prefill calls fail so)."""
    import os
    import signal
    import threading

    from kvnodes import start_node

    from mooncake import tls
    from mooncake.runtime.channels import client_options
    from protos import kvstore_pb2 as kpb
    from protos import kvstore_pb2_grpc as kpb_grpc

    node = start_node("slow", 4096, 8, shm_dir=str(tmp_path / "shm"))
    try:
        os.kill(node.proc.pid, signal.SIGSTOP)
        threading.Timer(0.5, os.kill, (node.proc.pid, signal.SIGCONT)).start()
        channel = tls.grpc_channel(node.grpc, options=client_options())
        stats = kpb_grpc.KVStoreStub(channel).Stats(kpb.StatsRequest(), timeout=10)
        assert stats.node == "slow"
        channel.close()
    finally:
        os.kill(node.proc.pid, signal.SIGCONT)
        node.stop()
