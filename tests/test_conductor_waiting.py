"""early_wait's queue, priorities and tenants' fair shares (conductor.waiting, conductor.overload), a pool node's block
size, and which admission asks again at decode. Answers worked out by hand from conductor_helpers' round-number
predictors: 1 ms to prefill a token, 1 ms to move a block, a decode step of 10 ms + 10 ms per running request.
"""

from __future__ import annotations

import dataclasses

import pytest
from conductor_helpers import KEYS, PARENTS, cluster, conductor, decode, prefill, request

from conductor.admission import AdmissionKind
from conductor.core import Conductor
from conductor.overload import MAX_WAIT_S
from conductor.types import Decision, Instance, Load, Rejection, RejectReason, Role, ScheduleRequest, Wait
from conductor.waiting import WAIT_GAP_S, WAIT_GRACE_S, FairShare, WaitQueue
from kvstore.events import Tier


def ask(
    rid: str, prompt: int = 160, priority: int = 0, tenant: str = "", weight: float = 1.0, waited_s: float = 0.0
) -> ScheduleRequest:
    """request() (10 blocks) with the fields early_wait, priorities and tenants read."""
    return dataclasses.replace(
        request(rid, prompt=prompt), priority=priority, tenant=tenant, tenant_weight=weight, waited_s=waited_s
    )


# -- WaitQueue ---------------------------------------------------------------------------------


def test_a_request_goes_after_every_waiter_of_a_higher_priority_and_none_of_its_own():
    q = WaitQueue()
    assert q.hold(ask("a"), 1.0, 0.0) and q.hold(ask("b"), 2.0, 0.0) and q.hold(ask("vip", priority=1), 0.5, 0.0)
    assert q.ahead_until(ask("new"), 0.0) == 0.5  # vip is ahead of a newcomer of priority 0; a and b are not
    assert q.ahead_until(ask("a"), 0.0) == 0.5
    assert q.ahead_until(ask("new-vip", priority=1), 0.0) == 0.0  # nothing of a higher priority waits
    assert q.ahead_until(ask("vip", priority=1), 0.0) == 0.0
    assert q.ahead_until(ask("shed", priority=-1), 0.0) == 2.0  # a sheddable one goes after everybody
    assert q.ahead_until(ask("new"), 0.5) == 0.0  # vip has had its turn by now
    assert q.by_priority() == {0: 2, 1: 1}


def test_a_waiter_asked_to_wait_again_keeps_its_room_and_one_released_stops_counting():
    q = WaitQueue(max_per_priority=1)
    q.hold(ask("vip", priority=1), 1.0, 0.0)
    assert q.hold(ask("vip", priority=1), 3.0, 1.0)  # the queue is full, but it is already in it
    assert q.ahead_until(ask("low"), 1.0) == 3.0
    q.release("vip")
    assert q.ahead_until(ask("low"), 1.0) == 0.0 and len(q) == 0
    q.release("no-such-request")  # leaving twice, or never having waited, is fine
    assert q.hold(ask("other", priority=1), 2.0, 1.0)


def test_a_waiter_that_does_not_come_back_stops_counting_a_grace_period_after_its_time():
    q = WaitQueue(max_per_priority=1)
    q.hold(ask("gone"), 1.0, 0.0)
    assert not q.hold(ask("next"), 2.0, 1.0 + WAIT_GRACE_S / 2)  # late, but it may still come back: the queue is full
    assert q.hold(ask("next"), 3.0, 1.0 + WAIT_GRACE_S + 0.01)  # past its grace: taken to have left
    assert set(q.waiters) == {"next"}


def test_the_queue_is_bounded_per_priority():
    q = WaitQueue(max_per_priority=2)
    assert q.hold(ask("a"), 1.0, 0.0) and q.hold(ask("b"), 1.0, 0.0)
    assert not q.hold(ask("c"), 1.0, 0.0)  # priority 0 is full
    assert q.hold(ask("vip", priority=1), 1.0, 0.0)  # priority 1 has its own room
    assert q.by_priority() == {0: 2, 1: 1}
    with pytest.raises(ValueError):
        WaitQueue(max_per_priority=0)


# -- FairShare ---------------------------------------------------------------------------------


def test_a_tenant_alone_at_its_priority_is_never_over_its_share():
    shares = FairShare()
    for n in range(10):
        shares.admitted(ask(f"a{n}", tenant="a"), 0.0)
    assert shares.over_share(ask("a10", tenant="a")) == ""
    shares.admitted(ask("b0", tenant="b", priority=1), 0.0)  # another priority is not its company
    assert shares.over_share(ask("a10", tenant="a")) == ""
    assert shares.over_share(ask("anon")) == ""  # a request with no tenant is never counted against one


def test_two_tenants_of_weight_one_share_half_and_a_finished_request_frees_its_place():
    shares = FairShare()
    for rid, tenant in (("a0", "a"), ("a1", "a"), ("b0", "b")):
        shares.admitted(ask(rid, tenant=tenant), 0.0)
    assert shares.over_share(ask("a2", tenant="a")) == (
        "tenant a would hold 3 of the 4 requests in flight at priority 0, over its weighted share of 2.0"
    )
    assert shares.over_share(ask("b1", tenant="b")) == ""  # 2 of 4: its half
    shares.admitted(ask("b1", tenant="b"), 0.0)
    shares.admitted(ask("b1", tenant="b"), 0.1)  # placed again (a retry): it counts once
    assert (shares.in_flight("a"), shares.in_flight("b")) == (2, 2)
    assert shares.over_share(ask("a2", tenant="a")) != ""  # 3 of 5 is over 2.5
    shares.finished("a0")
    shares.finished("a0")  # a second report frees nothing more
    assert shares.in_flight("a") == 1
    assert shares.over_share(ask("a2", tenant="a")) == ""  # 2 of 4: its half again


def test_a_tenant_of_weight_three_holds_three_quarters_beside_one_of_weight_one():
    shares = FairShare()
    shares.admitted(ask("l0", tenant="light"), 0.0)
    for n in range(3):
        assert shares.over_share(ask(f"h{n}", tenant="heavy", weight=3.0)) == ""
        shares.admitted(ask(f"h{n}", tenant="heavy", weight=3.0), 0.0)
    assert shares.over_share(ask("h3", tenant="heavy", weight=3.0)).startswith(
        "tenant heavy would hold 4 of the 5 requests in flight at priority 0"  # over 3/4 of 5
    )
    assert shares.over_share(ask("l1", tenant="light")).startswith(
        "tenant light would hold 2 of the 5"  # over 1/4 of 5: the light tenant's weight is 1 as its requests said
    )


def test_flights_older_than_the_age_limit_are_forgotten():
    """A lost FINISHED must not hold a tenant's share forever."""
    shares = FairShare()
    shares.admitted(ask("old", tenant="a"), 0.0)
    shares.admitted(ask("new", tenant="a"), 90.0)
    shares.expire(100.0, max_age_s=50.0)
    assert shares.in_flight("a") == 1
    shares.finished("old")  # its report comes after all: nothing more to free
    assert shares.in_flight("a") == 1


# -- the Conductor under early_wait ------------------------------------------------------------


def full_until(admission: str, t_d: float = 1.75, **kw) -> Conductor:
    """d0's batch cap is 2 and it runs r0 and r1, decoding since 0.35 for t_d = 1.75 s: full until 2.1 by the forecast.

    A 400-token prompt takes 0.4 s on p0, whose queue is empty from 0.32 on. Asked at 1.0 its prefill would end at
    1.4 with the batch full until well past one TBT budget (0.1 s) later: early_predictive refuses it. Under early_wait
    the waits tried double from MIN_WAIT_S: 0.05, 0.1, 0.2, 0.4, 0.8, 1.6 s (the longest its 2 s SLO allows: 1.6 s).
    """
    c = conductor(admission, default_decode_s=t_d, **kw)
    cluster(c)
    c.heartbeat("d0", Load(batch_cap=2), 0.0)
    assert all(isinstance(c.schedule(request(rid), 0.0), Decision) for rid in ("r0", "r1"))
    for rid in ("r0", "r1"):
        c.decode_started(rid, 0.35)
    c.heartbeat("d0", Load(running_requests=2, context_tokens=320, batch_cap=2), 0.35)
    return c


def test_early_wait_tells_a_request_the_decode_side_would_refuse_to_wait_and_places_it_when_it_asks_again():
    c = full_until("early_wait")
    # placed after 0.4 s its prefill would end at 1.8, the batch full until 2.1 (past 1.9); after 0.8 s it ends at 2.2,
    # the batch empty: it runs alone at 20 ms a step
    w = c.schedule(ask("w", prompt=400), 1.0)
    assert isinstance(w, Wait) and w.wait_s == pytest.approx(0.8)
    assert w.message == "waiting 0.80 s: decode d0's batch of 2 is full in 0.4 s"
    assert w.predicted.ttft_s == pytest.approx(1.2) and w.predicted.queue_s == pytest.approx(0.8)
    assert w.predicted.tbt_s == pytest.approx(0.02)
    # another of its priority, full too, is not held behind w: it waits for its own placement (at 1.9 it ends at 2.3)
    x = c.schedule(ask("x", prompt=400), 1.1)
    assert isinstance(x, Wait) and x.wait_s == pytest.approx(0.8) and "batch of 2 is full" in x.message
    assert c.waiting.by_priority() == {0: 2}
    for rid in ("r0", "r1"):  # the room frees
        c.finished(rid, 1.75)
    again = c.schedule(ask("w", prompt=400, waited_s=w.wait_s), 1.8)
    assert isinstance(again, Decision) and again.decode == "d0"
    assert again.predicted.ttft_s == pytest.approx(0.4)
    assert set(c.waiting.waiters) == {"x"}  # w left the queue


def test_a_long_wait_is_told_at_most_max_wait_s_at_a_time():
    c = full_until("early_wait", t_d=2.0)  # full until 2.35: after 0.8 s w's prefill would end at 2.2, too soon
    w = c.schedule(ask("w", prompt=400), 1.0)
    assert isinstance(w, Wait) and w.wait_s == MAX_WAIT_S  # 1.6 s would do; it asks again after 1 s
    assert w.predicted.ttft_s == pytest.approx(2.0)  # placed after 1.6 s
    again = c.schedule(ask("w", prompt=400, waited_s=w.wait_s), 2.0)  # ends at 2.4: the batch has emptied
    assert isinstance(again, Decision) and again.predicted.ttft_s == pytest.approx(0.4)


def test_under_early_predictive_the_same_request_is_refused_and_nothing_waits():
    c = full_until("early_predictive")
    for rid, now in (("w", 1.0), ("x", 1.1)):
        outcome = c.schedule(ask(rid, prompt=400), now)
        assert isinstance(outcome, Rejection) and outcome.reason is RejectReason.TBT_SLO, outcome
        assert outcome.message == "decode d0's batch of 2 is full in 0.4 s"
    assert len(c.waiting) == 0


def test_a_request_no_wait_within_its_ttft_slo_helps_is_refused_at_once():
    c = full_until("early_wait")
    c.heartbeat("p0", Load(queued_s=1.7), 1.0)  # 1.7 s of queue + 0.4 s of prefill: past the 2 s SLO, wait or not
    outcome = c.schedule(ask("w", prompt=400), 1.0)
    assert isinstance(outcome, Rejection) and outcome.reason is RejectReason.TTFT_SLO
    assert outcome.message == "predicted TTFT 2.10 s is over the 2.0 s SLO"
    assert outcome.retry_after_s == pytest.approx(1.7)  # its queue's time
    c = full_until("early_wait", t_d=60.0)  # the batch stays full long past the TTFT SLO
    outcome = c.schedule(ask("w", prompt=400), 1.0)
    assert isinstance(outcome, Rejection) and outcome.reason is RejectReason.TBT_SLO
    assert len(c.waiting) == 0


@pytest.mark.parametrize("priority", [0, 1])
def test_a_request_that_can_be_placed_now_is_placed_while_one_of_its_own_or_a_lower_priority_waits(priority):
    c = full_until("early_wait")
    assert isinstance(c.schedule(ask("w", prompt=400), 1.0), Wait)
    c.finished("r0", 1.1)  # a place frees before w asks again
    outcome = c.schedule(ask("now", prompt=400, priority=priority), 1.2)
    assert isinstance(outcome, Decision) and outcome.decode == "d0"
    assert set(c.waiting.waiters) == {"w"}


def test_a_request_waits_behind_a_higher_priority_waiter_until_just_after_it_asks_again():
    c = full_until("early_wait")
    vip = c.schedule(ask("vip", prompt=400, priority=1), 1.0)
    assert isinstance(vip, Wait) and vip.wait_s == pytest.approx(0.8)  # it asks again at 1.8
    c.finished("r0", 1.1)  # a place frees: a request of priority 0 could go now, but vip goes first
    low = c.schedule(ask("low"), 1.2)
    assert isinstance(low, Wait) and low.wait_s == pytest.approx(1.8 + WAIT_GAP_S - 1.2)
    assert low.message == "waiting 0.61 s: behind requests of a higher priority"
    assert low.predicted.queue_s == pytest.approx(low.wait_s)  # placed then: its 0.16 s prefill after the wait
    assert isinstance(c.schedule(ask("vip", prompt=400, priority=1, waited_s=0.8), 1.8), Decision)
    # vip's 0.4 s prefill is 0.39 s from done: low's 0.16 s follows it
    placed = c.schedule(ask("low", waited_s=low.wait_s), 1.81)
    assert isinstance(placed, Decision) and placed.predicted.queue_s == pytest.approx(0.39)
    assert len(c.waiting) == 0


def test_a_request_that_would_wait_is_refused_when_its_prioritys_queue_is_full():
    c = full_until("early_wait", wait_queue=1)
    assert isinstance(c.schedule(ask("w", prompt=400), 1.0), Wait)
    full = c.schedule(ask("x", prompt=400), 1.1)
    assert isinstance(full, Rejection) and full.reason is RejectReason.QUEUE_FULL
    assert full.message == "1 requests of priority 0 are waiting already (decode d0's batch of 2 is full in 0.4 s)"
    assert full.retry_after_s == 1.0  # its 0.8 s wait, clamped
    vip = c.schedule(ask("vip", prompt=400, priority=1), 1.1)  # priority 1's queue has room
    assert isinstance(vip, Wait) and vip.wait_s == pytest.approx(0.8)
    assert c.waiting.by_priority() == {0: 1, 1: 1}
    assert c.counters.rejected["queue_full"] == 1


def test_a_request_told_to_wait_is_not_counted_as_refused():
    c = full_until("early_wait", wait_queue=1)
    assert isinstance(c.schedule(ask("w", prompt=400), 1.0), Wait)
    assert isinstance(c.schedule(ask("x", prompt=400), 1.1), Rejection)  # queue full
    assert c.counters.rejected == {"queue_full": 1}


def test_the_time_a_request_has_waited_counts_against_its_ttft_slo():
    c = conductor("early_wait")
    cluster(c)
    spent = c.schedule(ask("spent", waited_s=2.0), 0.0)  # it waited its whole 2 s
    assert isinstance(spent, Rejection) and spent.reason is RejectReason.TTFT_SLO
    assert spent.message == "it waited 2.00 s, its whole TTFT SLO"
    assert isinstance(c.schedule(ask("fresh", prompt=600), 0.0), Decision)  # 0.6 s of prefill: well within 2 s
    c.heartbeat("p0", Load(), 0.0)
    late = c.schedule(ask("late", prompt=600, waited_s=1.5), 0.0)  # the same with 0.5 s left
    assert isinstance(late, Rejection) and late.reason is RejectReason.TTFT_SLO
    assert late.message == "predicted TTFT 0.60 s is over the 0.5 s SLO"
    assert len(c.waiting) == 0

    c = full_until("early_wait")
    assert isinstance(c.schedule(ask("vip", prompt=400, priority=1), 1.0), Wait)  # asks again at 1.8
    behind = c.schedule(ask("low", waited_s=1.5), 1.1)  # 0.71 s behind vip, with 0.5 s left: no wait helps
    assert isinstance(behind, Rejection) and behind.reason is RejectReason.TBT_SLO  # refused now, as it stands
    assert set(c.waiting.waiters) == {"vip"}


def test_behind_a_higher_priority_waiter_a_request_whose_prefill_queue_alone_is_past_its_slo_is_refused_at_once():
    c = full_until("early_wait")
    assert isinstance(c.schedule(ask("vip", prompt=400, priority=1), 1.0), Wait)
    c.heartbeat("p0", Load(queued_s=1.7), 1.1)  # 1.7 s of queue + 0.4 s of prefill: past the 2 s SLO
    outcome = c.schedule(ask("low", prompt=400), 1.1)
    assert isinstance(outcome, Rejection) and outcome.reason is RejectReason.TTFT_SLO, outcome


# -- priorities and tenants --------------------------------------------------------------------


@pytest.mark.parametrize("admission", ["early", "early_predictive", "early_wait"])
def test_a_sheddable_request_is_refused_where_one_of_priority_zero_is_admitted(admission):
    c = conductor(admission)
    cluster(c)
    assert isinstance(c.schedule(ask("alone", prompt=1800, priority=-1), 0.0), Decision)  # nothing else wants more
    c.heartbeat("p0", Load(), 0.0)
    assert c.schedule(ask("huge", prompt=2500), 0.0).reason is RejectReason.TTFT_SLO  # priority 0 wants more now
    assert isinstance(c.schedule(ask("light", prompt=1000, priority=-1), 0.0), Decision)  # 1.0 s: under 1.6 s
    c.heartbeat("p0", Load(), 0.0)
    shed = c.schedule(ask("shed", prompt=1800, priority=-1), 0.0)  # 1.8 s: over 80% of the 2 s SLO
    assert isinstance(shed, Rejection) and shed.reason is RejectReason.TTFT_SLO
    assert shed.message == "predicted TTFT 1.80 s is over the 1.6 s SLO"
    assert isinstance(c.schedule(ask("keep", prompt=1800), 0.0), Decision)
    assert len(c.waiting) == 0


def under_pressure(c: Conductor, req: ScheduleRequest, queued_s: float = 1.5, now: float = 0.0):
    """``req`` placed with p0 reporting ``queued_s`` of queue: 1.5 s + 0.16 s of prefill is 0.83 of the 2 s SLO."""
    c.heartbeat("p0", Load(queued_s=queued_s), now)
    return c.schedule(req, now)


@pytest.mark.parametrize("admission", ["early", "early_predictive", "early_wait"])
def test_under_pressure_a_tenant_holding_more_than_half_is_refused_while_the_other_is_served(admission):
    c = conductor(admission, tbt_s=1.0)  # a TBT SLO nothing here comes near: the pressure is the prefill queue's
    cluster(c)
    for rid in ("a0", "a1"):  # alone, a may use the whole cluster
        assert isinstance(under_pressure(c, ask(rid, tenant="a")), Decision)
    assert isinstance(under_pressure(c, ask("b0", tenant="b")), Decision)
    assert isinstance(under_pressure(c, ask("a2", tenant="a")), Decision)  # b wants no more: a takes what b leaves
    big = under_pressure(c, ask("b-big", tenant="b", prompt=2000))  # past the SLO: b wants more than it gets
    assert isinstance(big, Rejection) and big.reason is RejectReason.TTFT_SLO
    refused = under_pressure(c, ask("a3", tenant="a"))
    assert isinstance(refused, Rejection) and refused.reason is RejectReason.FAIR_SHARE
    assert refused.message == (
        "tenant a would hold 4 of the 5 requests in flight at priority 0, over its weighted share of 2.5, "
        "with the cluster at 0.83 of its SLO"
    )
    assert refused.retry_after_s == pytest.approx(1.66)
    assert isinstance(under_pressure(c, ask("b1", tenant="b")), Decision)  # b keeps what it sends
    c.finished("a0", 0.5)
    c.finished("a1", 0.5)
    assert isinstance(under_pressure(c, ask("a3", tenant="a"), now=0.5), Decision)  # 2 of 4 now: its half
    assert (c.shares.in_flight("a"), c.shares.in_flight("b")) == (2, 2)
    c.finished("a2", 6.0)
    assert isinstance(under_pressure(c, ask("a4", tenant="a"), now=6.0), Decision)
    # b's refusal is PRESSED_WINDOW_S old: it wants no more, and a may take what it leaves
    assert isinstance(under_pressure(c, ask("a5", tenant="a"), now=6.0), Decision)
    assert (c.shares.in_flight("a"), c.shares.in_flight("b")) == (3, 2)
    assert len(c.waiting) == 0


@pytest.mark.parametrize("admission", ["early", "early_predictive", "early_wait"])
def test_below_the_fair_share_load_nobody_is_refused_for_fair_share(admission):
    c = conductor(admission, tbt_s=1.0)
    cluster(c)
    # 1.0 s of queue + 0.16 s is 0.58 of the SLO; the decode side's 4 requests take 0.05 s a step of 1 s
    for rid, tenant in (("a0", "a"), ("a1", "a"), ("b0", "b"), ("a2", "a"), ("a3", "a")):
        assert isinstance(under_pressure(c, ask(rid, tenant=tenant), queued_s=1.0), Decision), rid
    assert c.shares.in_flight("a") == 4


@pytest.mark.parametrize("admission", ["none", "baseline"])
def test_the_admissions_that_do_not_judge_load_never_refuse_for_fair_share(admission):
    c = conductor(admission, tbt_s=1.0)
    cluster(c)
    for rid, tenant in (("a0", "a"), ("a1", "a"), ("b0", "b"), ("a2", "a")):
        assert isinstance(under_pressure(c, ask(rid, tenant=tenant)), Decision), rid


def test_under_pressure_a_tenant_of_weight_three_gets_three_quarters_beside_one_of_weight_one():
    c = conductor("early_predictive", tbt_s=1.0)
    cluster(c)
    for rid in ("l0", "l1"):
        assert isinstance(under_pressure(c, ask(rid, tenant="light")), Decision)
    for n in range(6):  # heavy's 6th is 6 of 8, 3/4 of 8
        assert isinstance(under_pressure(c, ask(f"h{n}", tenant="heavy", weight=3.0)), Decision), n
    for tenant in ("light", "heavy"):  # each wants more than it gets (a prompt past the SLO)
        assert under_pressure(c, ask(f"{tenant}-big", tenant=tenant, prompt=2000)).reason is RejectReason.TTFT_SLO
    heavy = under_pressure(c, ask("h6", tenant="heavy", weight=3.0))  # 7 of 9 is over 3/4 of 9
    assert isinstance(heavy, Rejection) and heavy.reason is RejectReason.FAIR_SHARE
    assert heavy.message.startswith("tenant heavy would hold 7 of the 9 requests in flight at priority 0")
    light = under_pressure(c, ask("l2", tenant="light"))  # 3 of 9 is over 1/4 of 9
    assert isinstance(light, Rejection) and light.reason is RejectReason.FAIR_SHARE
    assert light.message.startswith("tenant light would hold 3 of the 9")
    assert (c.shares.in_flight("heavy"), c.shares.in_flight("light")) == (6, 2)


# -- AdmitAtDecode and a pool node's block size --------------------------------------------------


@pytest.mark.parametrize("admission", [k.value for k in AdmissionKind])
def test_only_the_baseline_asks_the_decode_worker_to_check_again_when_the_prefill_ends(admission):
    c = conductor(admission)
    cluster(c)
    d = c.schedule(request(), 0.0)
    assert isinstance(d, Decision) and d.admit_at_decode is (admission == "baseline")


def test_a_pool_node_registering_its_block_size_changes_the_transfer_estimate():
    c = conductor("none")
    c.register(prefill(0), 0.0)
    c.register(decode(0), 0.0)
    for i in range(10):  # the prompt's prefix is on pool node kv9, not p0's
        c.stored("kv9", KEYS[i], Tier.DRAM, PARENTS[i])
    before = c.schedule(request("a"), 0.0)
    assert before.plan.fetch_node == "kv9" and before.plan.fetch_blocks == 10
    assert before.predicted.transfer_s == pytest.approx(0.01)  # 10 blocks of the configured 1 MB at 1 GB/s
    c.register(Instance("kv9", Role.KVSTORE, "10.0.2.9:7100", node="kv9", block_bytes=4_000_000), 0.0)
    assert c.predictors.block_bytes == 4_000_000
    after = c.schedule(request("b"), 0.0)
    assert after.plan.fetch_blocks == 10 and after.predicted.transfer_s == pytest.approx(0.04)
    c.register(Instance("kv8", Role.KVSTORE, "10.0.2.8:7100", node="kv8"), 0.0)  # one that says nothing keeps it
    assert c.predictors.block_bytes == 4_000_000
