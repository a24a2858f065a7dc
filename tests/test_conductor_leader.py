"""Leader election among Conductors on a real Redis (conductor/leader.py)."""

from __future__ import annotations

import time

import redis

from conductor.leader import LEADER_KEY, LeaderLease

LEASE_S = 0.3


def lease(url: str, holder: str, log: list[tuple[str, bool]]) -> LeaderLease:
    return LeaderLease(redis.Redis.from_url(url), holder, LEASE_S, lambda leading: log.append((holder, leading)))


def wait_for(condition, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_one_conductor_leads_and_a_standby_takes_over_within_the_lease_when_it_dies(redis_url):
    log: list[tuple[str, bool]] = []
    first = lease(redis_url, "c0", log).start()
    wait_for(lambda: first.leading)
    second = lease(redis_url, "c1", log).start()
    time.sleep(3 * LEASE_S)
    assert not second.leading and first.current() == "c0"  # renewed all along: the standby never got it
    first._stop.set()  # dies: no renewal, no hand-over
    first._thread.join()
    died = time.monotonic()
    wait_for(lambda: second.leading)
    assert time.monotonic() - died < LEASE_S * 4 / 3 + 0.2
    assert second.current() == "c1" and log == [("c0", True), ("c1", True)]
    second.close()


def test_a_leader_that_stops_gives_the_lease_up_at_once(redis_url):
    log: list[tuple[str, bool]] = []
    first = lease(redis_url, "c0", log).start()
    wait_for(lambda: first.leading)
    first.close()
    assert redis.Redis.from_url(redis_url).get(LEADER_KEY) is None
    second = lease(redis_url, "c1", log).start()
    wait_for(lambda: second.leading, timeout_s=LEASE_S)
    second.close()


def test_a_leader_whose_lease_was_taken_steps_down(redis_url):
    log: list[tuple[str, bool]] = []
    first = lease(redis_url, "c0", log).start()
    wait_for(lambda: first.leading)
    redis.Redis.from_url(redis_url).set(LEADER_KEY, "someone-else", px=10_000)  # it paused past its lease; another won
    wait_for(lambda: not first.leading)
    assert log == [("c0", True), ("c0", False)]
    first.close()
    assert redis.Redis.from_url(redis_url).get(LEADER_KEY) == b"someone-else"  # not taken from its holder
