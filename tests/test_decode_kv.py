"""Decode KV as the Conductor counts it: a prompt is placed only where its blocks fit, waits for room while the
planner acts, and the planner sizes decode by the blocks the requests in flight hold.

Decode workers register their capacity (``Instance.kv_blocks``) and whether their running batch holds blocks of it
too (``kv_shared``: the engine's own cache). Prompts of 10 blocks on workers of 30 blocks: three fit on each. The
planner's numbers are worked by hand beside each assertion.
"""

from __future__ import annotations

import math

import pytest
from conductor_helpers import cluster, conductor, decode, prefill, request

from conductor.forecast import UNSTARTED_KEEP_S, DecodeForecast
from conductor.overload import MAX_WAIT_S
from conductor.planner.planner import Planner, PlannerConfig, Snapshot
from conductor.planner.sizing import DecodeLoad, StepModel, size_decode
from conductor.types import Decision, Load, Prediction, PrefixPlan, Rejection, RejectReason, ScheduleRequest, Wait

FREE_STEPS = StepModel(base_s=0.001, per_request_s=0.0, per_token_s=0.0)  # the batch never reaches a TBT cap here


def kv_cluster(admission: str = "none", decodes: int = 2, kv_blocks: int = 30, shared: bool = True, **kw):
    c = conductor(admission, tbt_s=1.0, **kw)
    c.register(prefill(0), 0.0)
    for i in range(decodes):
        d = decode(i)
        d.kv_blocks, d.kv_shared = kv_blocks, shared
        c.register(d, 0.0)
    return c


def placed_on(outcomes) -> dict[str, int]:
    count: dict[str, int] = {}
    for o in outcomes:
        assert isinstance(o, Decision), o
        count[o.decode] = count.get(o.decode, 0) + 1
    return count


@pytest.mark.parametrize("admission", ["none", "baseline", "early", "early_predictive"])
def test_a_prompt_goes_to_the_decode_worker_whose_kv_holds_it_and_is_refused_when_none_does(admission):
    c = kv_cluster(admission)
    assert placed_on(c.schedule(request(f"r{n}"), 0.0) for n in range(6)) == {"d0": 3, "d1": 3}
    full = c.schedule(request("r6"), 0.0)
    assert isinstance(full, Rejection) and full.reason is RejectReason.DECODE_BUSY
    assert full.message == (
        "every decode worker is full (d0: 30 of 30 KV blocks held, 10 more needed; "
        "d1: 30 of 30 KV blocks held, 10 more needed)"
    )
    small = c.schedule(request("small", blocks=0, prompt=8), 0.0)  # nor does one block fit
    assert isinstance(small, Rejection) and small.reason is RejectReason.DECODE_BUSY


def test_a_request_keeps_its_blocks_while_it_decodes_where_the_batch_shares_the_cache():
    c = kv_cluster(decodes=1)
    placed = [c.schedule(request(f"r{n}"), 0.0) for n in range(2)]
    assert placed_on(placed) == {"d0": 2}
    c.decode_started("r0", 0.5)  # its prompt's blocks now hold its running request, and one more block for its output
    assert c.kv_held(c.instances["d0"]) == 21
    assert isinstance(c.schedule(request("r2", blocks=9, prompt=9 * 16), 0.5), Decision)  # 21 + 9 = 30
    assert isinstance(c.schedule(request("r3", blocks=0, prompt=8), 0.5), Rejection)
    c.finished("r0", 1.0)  # its blocks are free again
    assert c.kv_held(c.instances["d0"]) == 19
    assert isinstance(c.schedule(request("r4"), 1.0), Decision)


def test_landing_slots_are_free_again_once_a_request_decodes():
    """A worker whose prompts land in slots apart from its engine's cache (stock vLLM): the batch holds none."""
    c = kv_cluster(decodes=1, shared=False)
    assert placed_on(c.schedule(request(f"r{n}"), 0.0) for n in range(3)) == {"d0": 3}
    assert isinstance(c.schedule(request("r3"), 0.0), Rejection)
    c.decode_started("r0", 0.5)
    assert c.kv_held(c.instances["d0"]) == 20
    assert isinstance(c.schedule(request("r4"), 0.5), Decision)


def test_a_prompt_whose_prefill_runs_far_later_than_predicted_keeps_its_landing_counted():
    """A prefill queue behind its predictions: a flight long past its predicted start (4 mean decodes: 40 s before
    any is measured) stays in the decode forecast, its blocks counted, while it has not started decoding: it waits in
    its prefill or for a place, and its worker says when it starts or ends. Only ``UNSTARTED_KEEP_S`` past its start
    is it taken for a lost report and forgotten."""
    forecast = DecodeForecast()
    for rid in ("a", "b", "c"):
        forecast.scheduled(rid, "d0", 1.0, 160, 0.0, landing_blocks=10)
    forecast.expire(41.5, pending_s=2.0)  # past 1 + 40 s: still in the forecast's batches and in the KV count
    assert len(forecast) == 3 and forecast.occupancy("d0") == (3, 0, 30)
    assert forecast.blocks_held("d0") == (30, 0)
    forecast.decode_started("a", 42.0)  # it landed: its blocks hold its running request, and one more its output
    forecast.finished("b", 42.0)
    assert forecast.blocks_held("d0") == (10, 11)
    forecast.finished("a", 43.0)
    assert forecast.blocks_held("d0") == (10, 0)
    forecast.expire(1.0 + UNSTARTED_KEEP_S + 41.0, pending_s=2.0)  # "c", that late, is forgotten (a report lost)
    assert len(forecast) == 0 and forecast.blocks_held("d0") == (0, 0)


def test_a_batch_the_worker_counts_larger_than_the_conductor_does_is_believed():
    """A worker holding blocks the Conductor did not place (requests placed before it restarted, outputs longer than
    a block) says so in its heartbeat (``running_blocks``): the prompt goes where it fits."""
    c = kv_cluster()
    c.heartbeat("d0", Load(running_requests=3, running_blocks=25), 0.0)
    assert placed_on(c.schedule(request(f"r{n}"), 0.0) for n in range(3)) == {"d1": 3}
    assert c.kv_held(c.instances["d0"]) == 25


def test_a_worker_that_registered_no_capacity_is_judged_by_the_room_its_heartbeat_reports():
    c = conductor("none", tbt_s=1.0)
    cluster(c)
    c.heartbeat("d0", Load(landing_blocks=25), 0.0)
    assert placed_on(c.schedule(request(f"r{n}"), 0.0) for n in range(2)) == {"d0": 2}
    refused = c.schedule(request("r2"), 0.0)
    assert isinstance(refused, Rejection)
    assert refused.message == "every decode worker is full (d0: 20 of 25 landing blocks held, 10 more needed)"


def test_with_the_planner_acting_a_prompt_without_decode_room_waits_for_it_at_its_gateway():
    c = kv_cluster("early_predictive", ttft_s=30.0)
    c.decode_due = math.inf  # conductor.planning, acting: decode instances may come
    for n in range(6):
        assert isinstance(c.schedule(request(f"r{n}"), 0.0), Decision)
    waiting = c.schedule(request("r6"), 0.0)
    assert isinstance(waiting, Wait)
    assert waiting.wait_s == MAX_WAIT_S  # a quarter of the mean decode (10 s before any is measured), at most 1 s
    assert "decode room" in waiting.message and "30 of 30 KV blocks held" in waiting.message
    assert c.shed_s(0.0) == 0.0  # the gateway holds new requests too, instead of refusing them itself
    c.finished("r0", 1.0)
    again = request("r6")
    again.waited_s = 1.0
    assert isinstance(c.schedule(again, 1.0), Decision)


def test_a_wait_for_decode_room_past_the_ttft_slo_is_refused_with_the_planners_next_instance_as_retry_after():
    c = kv_cluster("none", ttft_s=2.0)
    c.decode_due = 20.0  # the planner asked for a decode instance predicted to serve at 20 s
    for n in range(6):
        c.schedule(request(f"r{n}"), 0.0)
    late = request("r6")
    late.waited_s = 1.5  # 0.5 s of its TTFT SLO left: less than a wait
    refused = c.schedule(late, 5.0)
    assert isinstance(refused, Rejection) and refused.reason is RejectReason.DECODE_BUSY
    assert refused.retry_after_s == 15.0
    huge = c.schedule(request("huge", blocks=40), 5.0)  # larger than any worker's whole KV: no wait helps
    assert isinstance(huge, Rejection) and "40 more needed" in huge.message


# -- the planner --------------------------------------------------------------------------------


def test_decode_is_sized_so_the_kv_holds_the_requests_in_flight_but_for_z_deviations():
    # 2 requests a second holding 10 blocks each for 10 s: 20 in flight; 100 blocks hold 10 a worker.
    # z = 2.33: h + z sqrt(h) <= 10 first at 5 workers (h = 4: 4 + 4.66); z = 0: at 2 (h = 10)
    load = DecodeLoad(2.0, 16, 100, 116, residence_s=10.0, blocks_per_request=10)
    sized = size_decode(load, FREE_STEPS, cap_s=1.0, kv_blocks=100)
    assert (sized.instances, sized.limit) == (5, "kv")
    assert sized.utilization == pytest.approx(0.4)
    assert size_decode(load, FREE_STEPS, cap_s=1.0, z=0.0, kv_blocks=100).instances == 2
    assert size_decode(load, FREE_STEPS, cap_s=1.0).instances == 1  # KV not counted: the batch alone sets it


def snapshot(planner: Planner, now: float, backlog_s: float, kv_blocks: float) -> Snapshot:
    return Snapshot(
        now=now,
        requests=planner.window(now),
        prefill=1,
        decode=1,
        prefill_coef=(0.5, 0.0, 0.0),  # every prompt takes 0.5 s
        slowdown=1.0,
        steps=FREE_STEPS,
        step_s=0.01,
        ttft_slo_s=100.0,
        tbt_slo_s=1.0,
        tbt_headroom=0.5,
        block_tokens=16,
        block_bytes=1_000_000,
        kv_tokens=0,
        transfer=(0.001, 1e9),
        handoff_s=0.0,
        backlog_s=backlog_s,
        kv_blocks=kv_blocks,
    )


def arrive(planner: Planner, now: float, rid: str) -> None:
    """``rid``: 152 prompt tokens, none cached, placed at ``now``; it finishes 0.6 s later with 8 tokens."""
    plan = PrefixPlan(local_blocks=0, fetch_node=None, fetch_blocks=0, compute_tokens=152)
    decision = Decision(rid, "p0", "d0", plan, Prediction(1.0, 0.01), "kvcache_centric")
    planner.observe_schedule(now, ScheduleRequest(rid, [], 152, 16), decision)
    planner.observe_finished(rid, now + 0.6, output_tokens=8)


def test_a_prefill_backlog_makes_the_planner_add_decode_for_the_kv_the_waiting_prompts_hold():
    """1 request a second of 152 prompt tokens and 8 output ones: 10 blocks each. Each holds them through the wait for
    prefill (the backlog over the one prefill instance the load needs), its 0.5 s prefill and its 8 steps of 10 ms.
    With no backlog: 0.58 s, 0.58 requests in flight where 100 blocks hold 10: one decode worker. With 40 s of
    backlog: 40.58 s, 40.58 in flight: h + 2.33 sqrt(h) <= 10 first at 9 workers (h = 4.51: 4.51 + 4.95)."""
    planner = Planner(PlannerConfig(interval_s=10.0, max_decode=16, twin=False), started=0.0)
    for n in range(10):
        arrive(planner, float(n), f"r{n}")
    calm = planner.decide(snapshot(planner, 10.0, backlog_s=0.0, kv_blocks=100))
    assert (calm.rate, calm.decode, calm.decode_sizing.limit) == (1.0, 1, "min")
    for n in range(10, 20):
        arrive(planner, float(n), f"r{n}")
    behind = planner.decide(snapshot(planner, 20.0, backlog_s=40.0, kv_blocks=100))
    assert behind.rate == pytest.approx(1.0)
    assert (behind.decode_sizing.instances, behind.decode_sizing.limit) == (9, "kv")
    assert behind.decode == 5  # a surge at most doubles a role, or adds four, per plan
    assert "decode: 9 sized (kv:" in behind.describe()
