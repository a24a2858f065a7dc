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
