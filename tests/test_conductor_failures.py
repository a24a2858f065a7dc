"""The Conductor hears of a failed instance from a retry and stops using it at once (issue 17)."""

from __future__ import annotations

import hashlib

from conductor.config import ConductorConfig
from conductor.core import Conductor
from conductor.types import Decision, Instance, InstanceState, Rejection, RejectReason, Role, ScheduleRequest

BT = 16
KEYS = [hashlib.blake2b(i.to_bytes(8, "little"), digest_size=16).digest() for i in range(4)]


def cluster(suspect_hold_s: float = 1.0) -> Conductor:
    c = Conductor(ConductorConfig(suspect_hold_s=suspect_hold_s, heartbeat_timeout_s=10.0))
    for i in range(2):
        c.register(Instance(f"p{i}", Role.PREFILL, f"10.0.0.{i}:7000", node=f"kv{i}"), 0.0)
        c.register(Instance(f"d{i}", Role.DECODE, f"10.0.1.{i}:7000", node=f"kv{i}"), 0.0)
    return c


def schedule(c: Conductor, rid: str, now: float, failed: tuple[str, ...] = ()) -> Decision | Rejection:
    return c.schedule(ScheduleRequest(rid, KEYS, len(KEYS) * BT, BT, failed=failed), now)


def test_a_retry_reporting_an_instance_sends_nothing_more_to_it_until_it_heartbeats_again():
    c = cluster()
    placements = {schedule(c, f"r{i}", 1.0, failed=("p0", "d1")).prefill for i in range(6)}
    assert placements == {"p1"}
    assert {schedule(c, f"s{i}", 1.0).decode for i in range(6)} == {"d0"}
    assert c.instances["p0"].state is InstanceState.SUSPECT
    c.heartbeat("p0", c.instances["p0"].load, 1.5)  # sent before the hold ended: may predate the failure
    assert c.instances["p0"].state is InstanceState.SUSPECT
    c.heartbeat("p0", c.instances["p0"].load, 2.5)
    assert c.instances["p0"].state is InstanceState.ALIVE


def test_a_suspect_that_stays_silent_is_dead_after_the_heartbeat_timeout_and_a_restart_brings_it_back():
    c = cluster()
    schedule(c, "r", 1.0, failed=("d0",))
    for iid in ("p0", "p1", "d1"):
        c.heartbeat(iid, c.instances[iid].load, 9.0)
    assert c.expire(11.0) == ["d0"]
    c.register(Instance("d0", Role.DECODE, "10.0.1.0:7001", node="kv0"), 12.0)  # the launcher restarted it
    assert {schedule(c, f"s{i}", 12.0).decode for i in range(8)} == {"d0", "d1"}


def test_when_every_instance_of_a_role_is_suspect_the_request_is_told_none_is_alive():
    c = cluster()
    out = schedule(c, "r", 1.0, failed=("d0", "d1"))
    assert isinstance(out, Rejection) and out.reason is RejectReason.NO_DECODE


def test_unknown_or_draining_instances_reported_as_failed_are_left_as_they_are():
    c = cluster()
    c.drain("p1")
    out = schedule(c, "r", 1.0, failed=("p1", "nobody"))
    assert isinstance(out, Decision) and out.prefill == "p0"
    assert c.instances["p1"].state is InstanceState.DRAINING
