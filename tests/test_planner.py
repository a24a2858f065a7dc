"""The capacity planner: prefill and decode sizing, the forecast, the hysteresis between plans and the twin search.

Every load is built at round numbers (prompts of whole seconds, a step model of 10 ms + 0.1 ms a request) so each
expected count is worked out by hand in a comment beside it. The planner is driven as the Conductor drives it:
observe_schedule for every arrival, then decide on a Snapshot of the window.
"""

from __future__ import annotations

import math

import pytest

from conductor.planner.planner import MAX_UP, TWIN_STEPS, Planner, PlannerConfig, Snapshot, TwinOutcome
from conductor.planner.poolsize import advise_pool, hit_ratio, reuse_distances
from conductor.planner.sizing import (
    DecodeLoad,
    PrefillLoad,
    StepModel,
    batch_at,
    drain_count,
    erlang_c,
    max_batch,
    size_decode,
    size_prefill,
)
from conductor.types import Decision, Prediction, PrefixPlan, Role, ScheduleRequest, Wait

BT = 4096  # tokens per block: every prompt here is shorter, so its key chain is empty
STEPS = StepModel(base_s=0.01, per_request_s=0.0001, per_token_s=0.0)  # B* = (0.05 - 0.01) / 0.0001 = 400 at 50 ms


def arrive(planner: Planner, now: float, rid: str, prompt: int = 1000, cached: int = 0) -> None:
    """``rid`` arrives at ``now`` and is placed with ``cached`` of its tokens found in the pool."""
    req = ScheduleRequest(rid, [], prompt, BT)
    plan = PrefixPlan(local_blocks=0, fetch_node=None, fetch_blocks=0, compute_tokens=prompt - cached)
    planner.observe_schedule(now, req, Decision(rid, "p0", "d0", plan, Prediction(1.0, 0.01), "kvcache_centric"))


def arrive_every(planner: Planner, start: float, end: float, gap: float = 1.0, **kw) -> None:
    """One arrival every ``gap`` seconds in [start, end)."""
    for i in range(round((end - start) / gap)):
        arrive(planner, start + i * gap, f"r{start + i * gap:.3f}", **kw)


def snapshot(
    planner: Planner,
    now: float,
    prefill: int = 1,
    decode: int = 1,
    prefill_coef: tuple[float, float, float] = (0.0, 0.0, 0.0),
    ttft_slo_s: float = 1000.0,
    tbt_slo_s: float = 0.1,
    tbt_headroom: float = 0.5,
    step_s: float = 0.01,
) -> Snapshot:
    return Snapshot(
        now=now,
        requests=planner.window(now),
        prefill=prefill,
        decode=decode,
        prefill_coef=prefill_coef,
        slowdown=1.0,
        steps=STEPS,
        step_s=step_s,
        ttft_slo_s=ttft_slo_s,
        tbt_slo_s=tbt_slo_s,
        tbt_headroom=tbt_headroom,
        block_tokens=BT,
        block_bytes=1_000_000,
        kv_tokens=0,
        transfer=(0.001, 1e9),
        handoff_s=0.0,
    )


def every_prompt(seconds: float) -> tuple[float, float, float]:
    """A prefill predictor under which every prompt takes ``seconds``, whatever its length."""
    return (seconds, 0.0, 0.0)


# -- Erlang C ------------------------------------------------------------------------------------


def test_erlang_c_with_one_instance_is_its_load():
    # M/M/1: an arrival waits whenever the server is busy, a of the time
    assert erlang_c(1, 0.3) == pytest.approx(0.3)
    assert erlang_c(1, 0.5) == pytest.approx(0.5)


def test_erlang_c_with_two_instances_at_a_load_of_one_is_a_third():
    # C(n, a) = (a^n / n!) (n / (n - a)) / (sum_{k<n} a^k / k! + (a^n / n!) (n / (n - a)))
    # n = 2, a = 1: (1/2)(2/1) = 1 over (1 + 1) + 1 = 3  ->  1/3
    assert erlang_c(2, 1.0) == pytest.approx(1 / 3)
    # n = 2, a = 0.5: (0.125)(2/1.5) = 1/6 over (1 + 0.5) + 1/6 = 5/3  ->  0.1
    assert erlang_c(2, 0.5) == pytest.approx(0.1)


@pytest.mark.parametrize("n, a", [(1, 1.0), (2, 2.0), (2, 3.5), (8, 9.0)])
def test_erlang_c_at_or_past_the_instances_count_every_arrival_waits(n, a):
    assert erlang_c(n, a) == 1.0


def test_erlang_c_without_load_nobody_waits():
    assert erlang_c(4, 0.0) == 0.0


# -- prefill sizing ------------------------------------------------------------------------------


def test_one_prefill_instance_at_half_load_keeps_a_five_second_ttft_but_not_a_four_second_one():
    load = PrefillLoad(rate=0.5, seconds=(1.0,) * 10)  # a = 0.5 x 1 s = 0.5; equal prompts: cs^2 = 0
    # one instance: C = a = 0.5; late = 0.5 exp(-2 (1 - 0.5) t / (1 s x (1 + 0))) = 0.5 exp(-t), t = SLO - 1 s
    # SLO 5 s: 0.5 e^-4 = 0.00916 <= 1%, so one instance (and ceil(0.5 / 0.9) = 1: the minimum set it)
    loose = size_prefill(load, ttft_slo_s=5.0)
    assert (loose.instances, loose.limit) == (1, "min")
    assert loose.utilization == pytest.approx(0.5)
    assert loose.predicted == pytest.approx(0.5 * math.exp(-4))
    # SLO 4 s: 0.5 e^-3 = 0.0249 > 1%, so two: C(2, 0.5) = 0.1; late = 0.1 exp(-2 (2 - 0.5) 3 / 1) = 0.1 e^-9
    tight = size_prefill(load, ttft_slo_s=4.0)
    assert (tight.instances, tight.limit) == (2, "slo")
    assert tight.utilization == pytest.approx(0.25)
    assert tight.predicted == pytest.approx(0.1 * math.exp(-9))


def test_prefill_is_sized_to_stay_under_the_utilization_bound_even_when_the_slo_is_loose():
    # a = 3/s x 1 s = 3 instances' worth; at most 90% busy: ceil(3 / 0.9) = ceil(3.33) = 4
    # at 4 with a 10 s SLO: C(4, 3) = 13.5 / 26.5 = 0.509; late = 0.509 exp(-2 (4 - 3) 9 / 1) = 7.8e-9
    sizing = size_prefill(PrefillLoad(rate=3.0, seconds=(1.0,) * 10), ttft_slo_s=10.0, max_utilization=0.9)
    assert (sizing.instances, sizing.limit) == (4, "utilization")
    assert sizing.utilization == pytest.approx(0.75)
    assert sizing.predicted == pytest.approx(erlang_c(4, 3.0) * math.exp(-18))


def test_prompts_longer_than_the_slo_are_hopeless_and_do_not_push_prefill_to_its_maximum():
    # nine 1 s prompts and one of 6 s against a 5.5 s SLO: a tenth of the prompts are late at any count
    load = PrefillLoad(rate=0.05, seconds=(1.0,) * 9 + (6.0,))
    # E[s] = 15 / 10 = 1.5 s, a = 0.05 x 1.5 = 0.075; E[s^2] = (9 + 36) / 10 = 4.5, var = 4.5 - 2.25 = 2.25, cs^2 = 1
    # one instance: C = 0.075; decay = 2 (1 - 0.075) / (1.5 x 2) = 0.6167 per s
    # the 1 s prompts: 0.075 exp(-0.6167 x 4.5) = 0.004676 each; the 6 s one: 1
    # late = (9 x 0.004676 + 1) / 10 = 0.1042 <= 1% + the hopeless 10%: one instance is enough
    sizing = size_prefill(load, ttft_slo_s=5.5)
    assert (sizing.instances, sizing.limit) == (1, "min")
    budget_decay = 2 * (1 - 0.075) / (1.5 * 2) * 4.5
    assert sizing.predicted == pytest.approx((9 * 0.075 * math.exp(-budget_decay) + 1) / 10)


def test_prefill_without_prompts_is_idle_at_its_minimum():
    sizing = size_prefill(PrefillLoad(rate=0.0, seconds=(1.0,)), ttft_slo_s=5.0, bounds=(2, 8))
    assert (sizing.instances, sizing.limit, sizing.utilization) == (2, "idle", 0.0)


def test_prefill_that_needs_more_than_its_maximum_stops_there_and_says_so():
    # a = 3 needs at least 4 (above); the maximum is 3, where every prompt is late (a >= n)
    sizing = size_prefill(PrefillLoad(rate=3.0, seconds=(1.0,) * 10), ttft_slo_s=10.0, bounds=(1, 3))
    assert (sizing.instances, sizing.limit) == (3, "max")
    assert sizing.utilization == pytest.approx(1.0)
    assert sizing.predicted == 1.0


def test_the_planner_sizes_prefill_on_the_uncached_tokens_of_each_prompt():
    # 1 ms per uncached token; ten 2000-token prompts at 0..9 s, half of each found in the pool
    # the plan at 20 s: rate = 10 arrivals / (20 - 0) s = 0.5/s; each prompt 1000 new tokens = 1 s; a = 0.5
    # as in the single-instance example: late(1) = 0.5 e^-(5 - 1) = 0.0092 <= 1%, so one instance
    planner = Planner()
    for i in range(10):
        arrive(planner, float(i), f"r{i}", prompt=2000, cached=1000)
    plan = planner.decide(snapshot(planner, 20.0, prefill_coef=(0.0, 0.001, 0.0), ttft_slo_s=5.0))
    assert plan.rate == pytest.approx(0.5)
    assert (plan.mean_prompt_tokens, plan.mean_uncached_tokens) == (2000, 1000)
    assert (plan.prefill_sizing.instances, plan.prefill, plan.prefill_sizing.limit) == (1, 1, "min")
    assert plan.prefill_sizing.utilization == pytest.approx(0.5)

    # the same prompts with nothing cached: 2 s each, a = 1.0, at least ceil(1 / 0.95) = 2
    # two: C(2, 1) = 1/3, decay 2 (2 - 1) / 2 s = 1 per s; late = e^-(5 - 2) / 3 = 0.0166 > 1%
    # three: C(3, 1) = 0.0909, decay 2 per s; late = 0.0909 e^-6 = 0.0002: three instances
    uncached = Planner()
    for i in range(10):
        arrive(uncached, float(i), f"r{i}", prompt=2000, cached=0)
    plan = uncached.decide(snapshot(uncached, 20.0, prefill_coef=(0.0, 0.001, 0.0), ttft_slo_s=5.0))
    assert (plan.prefill_sizing.instances, plan.prefill_sizing.limit) == (3, "slo")


def test_a_request_that_waits_and_asks_again_is_one_arrival_and_its_cached_tokens_come_from_its_placement():
    planner = Planner()
    req = ScheduleRequest("r0", [], 2000, BT)
    planner.observe_schedule(0.0, req, Wait("r0", 2.0, "later"))
    arrive(planner, 2.0, "r0", prompt=2000, cached=1500)  # asked again and placed: 500 tokens to compute
    arrive(planner, 5.0, "r1", prompt=2000, cached=0)
    plan = planner.decide(snapshot(planner, 10.0, prefill_coef=(0.0, 0.001, 0.0)))
    assert plan.observed_rate == pytest.approx(2 / 10)  # two arrivals from 0 s to the plan at 10 s
    assert plan.mean_uncached_tokens == pytest.approx((500 + 2000) / 2)


# -- decode sizing -------------------------------------------------------------------------------


def test_decode_at_the_tbt_cap_needs_a_second_instance_once_the_batch_deviation_passes_b_star():
    load = DecodeLoad(rate=50.0, mean_output_tokens=157, mean_context_tokens=1000)
    # B* = (cap - base) / per_request = (0.05 - 0.01) / 0.0001 = 400
    assert max_batch(load, STEPS, cap_s=0.05) == pytest.approx(400)
    # one instance: k = 50/s x 157 = 7850, m = k base / (1 - k slope) = 78.5 / (1 - 0.785) = 365.1: under 400, but
    # m + 2.33 sqrt(m) = 365.1 + 44.5 = 409.6 > 400 (the batch passes B* for more than 1% of the steps)
    assert batch_at(50.0, load, STEPS) == pytest.approx(78.5 / 0.215)
    # two: k = 3925, m = 39.25 / 0.6075 = 64.6; 64.6 + 2.33 x 8.04 = 83.3 <= 400
    sizing = size_decode(load, STEPS, cap_s=0.05)
    assert (sizing.instances, sizing.limit) == (2, "slo")
    m = 39.25 / 0.6075
    assert sizing.utilization == pytest.approx(m / 400)
    assert sizing.predicted == pytest.approx(0.01 + 0.0001 * m)  # the step at the mean batch: 16.5 ms
    # without the deviation's margin the mean batch (365 of 400) fits on one
    assert size_decode(load, STEPS, cap_s=0.05, z=0.0).instances == 1


def test_decode_batch_is_bounded_by_the_kv_that_fits_as_well_as_the_tbt_cap():
    # 100,000 tokens of KV at 1000 tokens a request: 100 requests, under the TBT cap's 400
    load = DecodeLoad(rate=50.0, mean_output_tokens=157, mean_context_tokens=1000, kv_tokens_per_request=1000)
    assert max_batch(load, STEPS, cap_s=0.05, kv_tokens=100_000) == pytest.approx(100)
    # m at two instances is 64.6, + 2.33 x 8.04 = 83.3 <= 100: still two
    assert size_decode(load, STEPS, cap_s=0.05, kv_tokens=100_000).instances == 2
    # 60,000 tokens: B* = 60 < 83.3, so three: k = 2616.7, m = 26.17 / 0.7383 = 35.4; + 2.33 x 5.95 = 49.3 <= 60
    assert size_decode(load, STEPS, cap_s=0.05, kv_tokens=60_000).instances == 3


def test_decode_without_finished_requests_is_idle_at_its_minimum():
    sizing = size_decode(DecodeLoad(rate=5.0, mean_output_tokens=0, mean_context_tokens=0), STEPS, 0.05, bounds=(2, 4))
    assert (sizing.instances, sizing.limit) == (2, "idle")


def decoding(reported: bool) -> Planner:
    """5 arrivals a second for 20 s, the first ten finished with 1570 output tokens, reported or timed (15.7 s of
    decode over the mean step of 10 ms = 1570)."""
    planner = Planner()
    arrive_every(planner, 0.0, 20.0, gap=0.2)
    for i in range(10):
        rid = f"r{i * 0.2:.3f}"
        planner.observe_decode_started(rid, i * 0.2)
        planner.observe_finished(rid, i * 0.2 + 15.7, output_tokens=1570 if reported else 0)
    return planner


@pytest.mark.parametrize("reported", [True, False], ids=["reported", "timed"])
def test_the_planner_sizes_decode_at_the_tbt_slo_times_its_headroom_from_the_outputs_seen(reported):
    # rate = 100 arrivals / 20 s = 5/s; k = 5/s x 1570 = 7850 at one instance, as above
    # cap = 100 ms x 0.5 = 50 ms: B* = 400 and two instances
    planner = decoding(reported)
    plan = planner.decide(snapshot(planner, 20.0, tbt_slo_s=0.1, tbt_headroom=0.5, step_s=0.01))
    assert plan.rate == pytest.approx(5.0)
    assert plan.mean_output_tokens == pytest.approx(1570)
    assert (plan.decode_sizing.instances, plan.decode_sizing.limit, plan.decode) == (2, "slo", 2)
    # all of the 100 ms to spend (headroom 1): B* = (0.1 - 0.01) / 0.0001 = 900 > 365.1 + 44.5, one instance
    wide = decoding(reported)
    plan = wide.decide(snapshot(wide, 20.0, tbt_slo_s=0.1, tbt_headroom=1.0, step_s=0.01))
    assert (plan.decode_sizing.instances, plan.decode) == (1, 1)


# -- the forecast --------------------------------------------------------------------------------


def test_the_forecast_follows_a_rising_rate_looking_an_instances_start_ahead():
    # intervals of 30 s at 1, 2 and 3 arrivals a second; Holt with alpha 0.5, beta 0.3, looking 60 / 30 = 2 ahead
    planner = Planner()
    arrive_every(planner, 0.0, 30.0, gap=1.0)
    assert planner.decide(snapshot(planner, 30.0)).rate == pytest.approx(1.0)  # the first rate is the level
    arrive_every(planner, 30.0, 60.0, gap=0.5)
    # level = 0.5 x 2 + 0.5 x (1 + 0) = 1.5; trend = 0.3 x 0.5 = 0.15; 1.5 + 2 x 0.15 = 1.8, under the last 2
    assert planner.decide(snapshot(planner, 60.0)).rate == pytest.approx(2.0)
    arrive_every(planner, 60.0, 90.0, gap=1 / 3)
    # level = 0.5 x 3 + 0.5 x (1.5 + 0.15) = 2.325; trend = 0.3 x 0.825 + 0.7 x 0.15 = 0.3525; 2.325 + 0.705 = 3.03
    plan = planner.decide(snapshot(planner, 90.0))
    assert plan.observed_rate == pytest.approx(3.0)
    assert plan.rate == pytest.approx(3.03)


def test_a_plan_asked_for_just_after_one_keeps_its_rate():
    """`mooncake plan` a moment after the running planner's plan (a copy of it, plan_now): the few milliseconds since
    hold no arrival, and are no reading of the rate."""
    import copy

    planner = Planner()
    arrive_every(planner, 0.0, 30.0, gap=0.5)
    assert planner.decide(snapshot(planner, 30.0)).rate == pytest.approx(2.0)
    now = copy.deepcopy(planner).decide(snapshot(planner, 30.01))
    assert (now.rate, now.observed_rate) == (pytest.approx(2.0), pytest.approx(2.0))
    arrive_every(planner, 30.0, 45.0, gap=0.25)  # half an interval later it is one: 4 a second so far
    assert copy.deepcopy(planner).decide(snapshot(planner, 45.0)).observed_rate == pytest.approx(4.0)


# -- hysteresis ----------------------------------------------------------------------------------
# The rate stays at 1 arrival a second and the SLO at 1000 s, so the prefill count wanted is set by the seconds a
# prompt takes: a = 1/s x c0, N = ceil(c0 / 0.95) (the utilization bound; the SLO never binds).


def steady(planner: Planner, now: float, prefill: int, seconds: float, decode: int = 1):
    """The next plan at ``now`` (30 s after the last) with arrivals at 1/s since, every prompt taking ``seconds``."""
    arrive_every(planner, now - 30.0 if planner.rates else 0.0, now)
    return planner.decide(snapshot(planner, now, prefill=prefill, decode=decode, prefill_coef=every_prompt(seconds)))


def test_a_surge_is_applied_at_once_but_at_most_doubled_or_four_more_per_plan():
    planner = Planner(PlannerConfig(max_prefill=32))
    assert MAX_UP == 4
    # 18.5 s a prompt: ceil(18.5 / 0.95) = ceil(19.47) = 20 wanted
    plan = steady(planner, 20.0, prefill=2, seconds=18.5)
    assert plan.prefill_sizing.instances == 20
    assert (plan.prefill, plan.held) == (6, "")  # min(20, max(2 x 2, 2 + 4)) = 6
    # the six starting are not registered yet (the snapshot still says 2): the planner counts from its own target
    assert steady(planner, 50.0, prefill=2, seconds=18.5).prefill == 12  # min(20, max(12, 10))
    assert steady(planner, 80.0, prefill=12, seconds=18.5).prefill == 20  # min(20, max(24, 16))
    assert steady(planner, 110.0, prefill=20, seconds=18.5).prefill == 20


def test_a_scale_down_waits_for_down_after_plans_in_a_row_and_goes_to_the_highest_of_them():
    planner = Planner(PlannerConfig(down_after=2))
    # 2.5 s: ceil(2.63) = 3 wanted of 6; the first plan below is held
    plan = steady(planner, 20.0, prefill=6, seconds=2.5)
    assert (plan.prefill_sizing.instances, plan.prefill) == (3, 6)
    assert plan.held == "prefill waits for 1 more plan(s) below 6"
    # 5.5 s: ceil(5.79) = 6, as many as there are: the run of plans below starts again
    assert steady(planner, 50.0, prefill=6, seconds=5.5).prefill == 6
    assert steady(planner, 80.0, prefill=6, seconds=2.5).prefill == 6  # 3 wanted: one plan below
    # 3.5 s: ceil(3.68) = 4, the second plan below in a row: down to the higher of 3 and 4
    plan = steady(planner, 110.0, prefill=6, seconds=3.5)
    assert (plan.prefill_sizing.instances, plan.prefill, plan.held) == (4, 4, "")


def test_a_scale_down_within_the_cooldown_of_that_roles_last_change_is_held():
    planner = Planner(PlannerConfig(down_after=2, cooldown_s=90.0))
    # 20 s: prefill up from 2 to 6 (5.5 s a prompt: ceil(5.79) = 6); decode, idle, wants its minimum 1 of 3
    plan = steady(planner, 20.0, prefill=2, seconds=5.5, decode=3)
    assert (plan.prefill, plan.decode) == (6, 3)
    # 50 s and 80 s: prefill wants 3; decode's second plan below, and it has never changed: down to 1 at 50 s
    plan = steady(planner, 50.0, prefill=6, seconds=2.5, decode=3)
    assert (plan.prefill, plan.decode) == (6, 1)
    plan = steady(planner, 80.0, prefill=6, seconds=2.5, decode=1)
    assert plan.prefill == 6  # two plans below, but 80 - 20 = 60 s since prefill's change
    assert plan.held == "prefill cools down for 30 s"
    plan = steady(planner, 110.0, prefill=6, seconds=2.5, decode=1)  # 110 - 20 = 90 s: cooled down
    assert (plan.prefill, plan.held) == (3, "")
    assert planner.last_change == {Role.PREFILL: 110.0, Role.DECODE: 50.0}


def test_the_planned_counts_stay_within_each_roles_minimum_and_maximum():
    planner = Planner(PlannerConfig(min_prefill=2, max_prefill=5, min_decode=2, max_decode=3))
    # 0.5 s a prompt wants ceil(0.53) = 1, under the minimum 2; decode, idle, its minimum 2 of 1 registered
    plan = steady(planner, 20.0, prefill=2, seconds=0.5, decode=1)
    assert (plan.prefill_sizing.limit, plan.prefill, plan.decode) == ("min", 2, 2)
    # 18.5 s wants 20: 5 at most ("max"); from 2: min(5, max(4, 6)) = 5
    plan = steady(planner, 50.0, prefill=2, seconds=18.5, decode=2)
    assert (plan.prefill_sizing.limit, plan.prefill_sizing.instances, plan.prefill) == ("max", 5, 5)
    # a count set by hand above the maximum is brought down to it once the hysteresis allows
    planner = Planner(PlannerConfig(max_prefill=3, down_after=1, cooldown_s=0.0))
    assert steady(planner, 20.0, prefill=8, seconds=18.5).prefill == 3


# -- the twin search -----------------------------------------------------------------------------


def twin_meeting(need_prefill: int = 1, need_decode: int = 1):
    """A fake twin: every request within both SLOs iff the plan has at least ``need_prefill`` prefill and
    ``need_decode`` decode instances; short of prefill its TTFT p99 passes the SLO, short of decode its TBT p99 does."""

    def check(snap: Snapshot, plan, prefill: int, decode: int) -> TwinOutcome:
        ttft = snap.ttft_slo_s / 2 if prefill >= need_prefill else 2 * snap.ttft_slo_s
        tbt = snap.tbt_slo_s / 2 if decode >= need_decode else 2 * snap.tbt_slo_s
        met = prefill >= need_prefill and decode >= need_decode
        return TwinOutcome(prefill, decode, 1.0 if met else 0.5, ttft, tbt)

    return check


def twin_plan(planner: Planner, now: float, check, prefill: int, seconds: float, ttft_slo_s: float = 1000.0):
    arrive_every(planner, 0.0, now)
    snap = snapshot(planner, now, prefill=prefill, prefill_coef=every_prompt(seconds), ttft_slo_s=ttft_slo_s)
    return planner.decide(snap, check)


def tried(plan) -> list[tuple[int, int]]:
    return [(t.prefill, t.decode) for t in plan.twin]


def test_a_sized_count_the_twin_finds_short_gets_one_more_prefill_until_it_meets_the_slo():
    # 2.5 s a prompt at 1/s: 3 sized; the twin needs 5
    plan = twin_plan(Planner(), 20.0, twin_meeting(need_prefill=5), prefill=3, seconds=2.5)
    assert plan.prefill_sizing.instances == 3
    assert tried(plan) == [(3, 1), (4, 1), (5, 1)]
    assert (plan.prefill, plan.decode) == (5, 1)


def test_the_twin_search_adds_at_most_twin_steps_instances():
    plan = twin_plan(Planner(), 20.0, twin_meeting(need_prefill=10), prefill=3, seconds=2.5)
    assert TWIN_STEPS == 3
    assert tried(plan) == [(3, 1), (4, 1), (5, 1), (6, 1)]  # 3 sized, then three more tries: still short at 6
    assert plan.prefill == 6


def test_a_twin_that_sees_the_tbt_slo_broken_adds_decode_instead():
    plan = twin_plan(Planner(), 20.0, twin_meeting(need_decode=3), prefill=3, seconds=2.5)
    assert tried(plan) == [(3, 1), (3, 2), (3, 3)]
    assert (plan.prefill, plan.decode) == (3, 3)


def test_a_sized_count_the_twin_accepts_loses_one_prefill_when_the_twin_accepts_that_too_and_utilization_allows():
    # 1 s a prompt at 1/s, a = 1, SLO 1.5 s (budget 0.5 s): the SLO sets the count
    # 2: (1/3) e^-(2 x 1 x 0.5) = 0.123; 3: 0.0909 e^-(2 x 2 x 0.5) = 0.0123; 4: C(4, 1) = 0.0204, x e^-3 = 0.001
    # one fewer than 4 is 1 / 3 = 33% busy, within 95%: the twin is asked about 3
    accepts = twin_plan(Planner(), 20.0, twin_meeting(need_prefill=3), prefill=3, seconds=1.0, ttft_slo_s=1.5)
    assert (accepts.prefill_sizing.instances, accepts.prefill_sizing.limit) == (4, "slo")
    assert tried(accepts) == [(4, 1), (3, 1)]
    assert accepts.prefill == 3
    refuses = twin_plan(Planner(), 20.0, twin_meeting(need_prefill=4), prefill=3, seconds=1.0, ttft_slo_s=1.5)
    assert tried(refuses) == [(4, 1), (3, 1)]
    assert refuses.prefill == 4
    # 2.5 s a prompt: 3 sized by utilization (83%); one fewer would be 2.5 / 2 = 125% busy: the twin is not asked
    busy = twin_plan(Planner(), 20.0, twin_meeting(need_prefill=1), prefill=3, seconds=2.5)
    assert tried(busy) == [(3, 1)]
    assert busy.prefill == 3


def test_a_single_request_just_before_the_first_plan_does_not_scale_prefill_up():
    # the planner started at 0 (as the Conductor's does, PlannerLoop): the first rate counts from then
    planner = Planner(started=0.0)
    arrive(planner, 29.9, "r0")
    plan = planner.decide(snapshot(planner, 30.0, prefill=1, prefill_coef=every_prompt(1.0)))
    # one 1 s prompt in the first 30 s interval keeps one instance a thirtieth busy
    assert plan.rate <= 1 / 30 + 1e-9
    assert plan.prefill == 1


# -- pool sizing (conductor.planner.poolsize) ------------------------------------------------------------------------


def key(name: str) -> bytes:
    return name.encode().ljust(16, b".")


def test_a_reuse_distance_counts_the_other_blocks_read_since_the_last_read_of_the_same_one():
    # A B C A B B: A again after B and C (2 others), B after C and A (2), B right after B (0); firsts are -1
    reads = [key(k) for k in "ABCABB"]
    assert reuse_distances(reads).tolist() == [-1, -1, -1, 2, 2, 0]


def test_the_hit_curve_is_the_share_of_reads_an_lru_cache_of_that_size_would_have_served():
    reads = [key(k) for k in "ABCABB"]  # distances -1 -1 -1 2 2 0
    d = reuse_distances(reads)
    assert hit_ratio(d, 1) == pytest.approx(1 / 6)  # only the B right after B
    assert hit_ratio(d, 2) == pytest.approx(1 / 6)
    assert hit_ratio(d, 3) == pytest.approx(3 / 6)  # all three re-reads; the three first reads always miss


def test_a_pool_node_is_recommended_when_its_extra_hits_save_enough_prefill():
    # a cycle over 30 keys read 10 times: every re-read has distance 29, so a pool below 30 blocks hits nothing and one
    # of 30 or more hits every re-read (270 of 300 reads)
    reads = [key(f"k{i}") for _ in range(10) for i in range(30)]
    # 2 nodes of 10 blocks (20) hit 0; a third (30) hits 90%. At 10 reads/s and 0.1 s of prefill per block, the
    # third saves 0.9 x 10 x 0.1 = 0.9 prefill-seconds a second >= 0.5: recommended; a fourth saves nothing more
    advice = advise_pool(reads, nodes=2, node_blocks=10, reads_per_s=10, prefill_s_per_block=0.1, min_gain=0.5)
    assert advice.hit_now == 0.0
    assert dict(advice.curve)[3] == pytest.approx(0.9)
    assert advice.recommended == 3
    assert advice.saved_s_per_s == pytest.approx(0.9)
    # at 5 reads/s the third saves 0.45 < 0.5: not worth running
    assert advise_pool(reads, 2, 10, 5, 0.1, 0.5).recommended == 2


def test_the_planner_plans_the_prefill_workers_that_come_with_the_pool_nodes_it_recommends():
    # the same cycle as above, read by prompts of 3 blocks (10 distinct prompts, over and over), one a second
    planner = Planner(started=0.0)
    for i in range(100):
        keys = [key(f"k{(3 * i + j) % 30}") for j in range(3)]
        planner.observe_schedule(float(i), ScheduleRequest(f"r{i}", keys, 3 * 512, 512), Wait(f"r{i}", 1.0, "x"))
    snap = snapshot(planner, 100.0, prefill_coef=(0.0, 0.001, 0.0))
    snap.pool_nodes, snap.node_blocks, snap.block_tokens = 2, 10, 512
    snap.reads = list(planner.reads)
    # 3 reads a second (1 req/s x 3 blocks); a block of 512 tokens at 1 ms a token is 0.512 s of prefill: the third
    # node saves 0.9 x 3 x 0.512 = 1.38 s a second, a fourth nothing; prefill alone (1.536 s a prompt, a = 1.536)
    # needs ceil(1.536 / 0.95) = 2
    plan = planner.decide(snap)
    assert plan.prefill_sizing.instances == 2
    assert plan.pool is not None and plan.pool.recommended == 3
    assert plan.prefill == 3
    assert "3 nodes recommended" in plan.describe()


def test_pool_nodes_that_would_add_nothing_do_not_keep_prefill_workers_the_load_no_longer_needs():
    # reads that never repeat: no node count hits anything, so the advice is the nodes now (2); the load needs one
    planner = Planner(PlannerConfig(down_after=1, cooldown_s=0), started=0.0)
    for i in range(30):
        planner.observe_schedule(float(i), ScheduleRequest(f"r{i}", [key(f"u{i}")], 512, 512), Wait(f"r{i}", 1, "x"))
    snap = snapshot(planner, 30.0, prefill=2, prefill_coef=every_prompt(0.1))
    snap.pool_nodes, snap.node_blocks, snap.reads = 2, 10, list(planner.reads)
    plan = planner.decide(snap)
    assert plan.pool is not None and plan.pool.recommended == 2 and plan.pool.hit_now == 0.0
    assert plan.prefill_sizing.instances == 1
    assert plan.prefill == 1  # drained to what the load needs


def test_a_queue_the_pool_fell_behind_on_is_cleared_within_the_ttft_slo_once_new_instances_serve():
    # a = 6 instances' worth of work on 3 instances, 60 s of queued work (20 s a wait each: over half the 30 s SLO);
    # by the time new ones serve (60 s) it holds 60 + (6 - 3) x 60 = 240 s; N clears it in 30 s when N - 6 >= 8
    assert drain_count(a=6.0, current=3, backlog_s=60.0, start_s=60.0, drain_s=30.0) == 14
    # a queue of 10 s a wait is the pool's usual one at its load (under half the SLO): nothing to clear
    assert drain_count(a=2.5, current=3, backlog_s=30.0, start_s=60.0, drain_s=30.0) == 0
    assert drain_count(a=2.5, current=3, backlog_s=0.0, start_s=60.0, drain_s=30.0) == 0


def test_the_planner_sizes_prefill_to_clear_a_queue_it_fell_behind_on():
    # one arrival a second, 6 s of prefill each: a = 6 on the 3 instances there are, with 60 s of work queued
    planner = Planner(started=0.0)
    arrive_every(planner, 0.0, 30.0)
    snap = snapshot(planner, 30.0, prefill=3, prefill_coef=every_prompt(6.0), ttft_slo_s=30.0)
    snap.backlog_s = 60.0
    plan = planner.decide(snap)
    # as worked above: 60 + 3 x 60 = 240 s queued when new ones serve, cleared in 30 s by 6 + 8 = 14
    assert (plan.prefill_sizing.instances, plan.prefill_sizing.limit) == (14, "backlog")
    assert plan.prefill == 7  # a surge: at most max(2 x 3, 3 + 4) = 7 this plan
    # the same load without the queue: its own count, ceil(6 / 0.95) = 7 at least, set by the load, not a queue
    calm = Planner(started=0.0)
    arrive_every(calm, 0.0, 30.0)
    snap = snapshot(calm, 30.0, prefill=3, prefill_coef=every_prompt(6.0), ttft_slo_s=30.0)
    assert calm.decide(snap).prefill_sizing.limit in ("utilization", "slo")


def test_a_step_model_without_fixed_cost_counts_a_batch_of_one_and_a_second_instance_when_tokens_outrun_it():
    # 10 ms per running request a step and nothing fixed (a CPU decode worker's fit): one instance makes 100 tokens/s
    steps = StepModel(base_s=0.0, per_request_s=0.01, per_token_s=0.0)
    load = DecodeLoad(rate=5.0, mean_output_tokens=16, mean_context_tokens=900)
    # k = 5 x 16 = 80 tokens/s asked: the fixed point k base / (1 - k slope) is 0; one request runs 80% of the time
    assert batch_at(5.0, load, steps) == pytest.approx(0.8)
    assert size_decode(load, steps, cap_s=1.0).instances == 1
    # 7 requests/s ask 112 tokens/s, more than 100: one instance never catches up, two do (56 each)
    busy = DecodeLoad(rate=7.0, mean_output_tokens=16, mean_context_tokens=900)
    assert batch_at(7.0, busy, steps) == math.inf
    assert size_decode(busy, steps, cap_s=1.0).instances == 2


class _Pools:
    """The service the acting planner scales (conductor.planning.Service): alive counts set by hand, scales kept."""

    def __init__(self) -> None:
        import threading

        self.counts = {Role.PREFILL: 0, Role.DECODE: 0}
        self.scaled: list[tuple[Role, int]] = []
        self._lock = threading.Lock()
        self.conductor = self  # the planner asks the Conductor for alive(role)

    def alive(self, role: Role) -> list[None]:
        return [None] * self.counts[role]

    def scale(self, role: Role, replicas: int):
        self.scaled.append((role, replicas))
        return self.counts[role], [], []


def test_the_acting_planner_leaves_pools_whose_first_instances_are_still_starting_alone():
    """At a cluster's start the planner plans before the workers register: a pool at 0 then is coming up, not to be
    filled (the launcher's or the deployment's instances would be doubled); once it has had an instance, it is."""
    from types import SimpleNamespace

    from conductor.planning import PlannerLoop

    pools = _Pools()
    loop = PlannerLoop(pools, PlannerConfig(start_s=60.0), acting=True)
    loop._act(SimpleNamespace(prefill=1, decode=1))
    assert pools.scaled == []  # nothing registered yet, just after the start: the first ones are starting
    pools.counts[Role.PREFILL] = 1
    loop._act(SimpleNamespace(prefill=2, decode=1))
    assert pools.scaled == [(Role.PREFILL, 2)]  # prefill has had an instance: scaled; decode is still starting
    loop._started -= 121.0  # two start_s after the start, a pool still at 0 is the planner's to fill
    loop._act(SimpleNamespace(prefill=2, decode=1))
    assert pools.scaled[-1] == (Role.DECODE, 1)


def test_a_plan_counts_the_devices_its_instances_take_at_their_tensor_parallel_sizes():
    """Prefill workers registered at TP 2 and decode workers at TP 4: the plan's instances take that many devices
    each, in what it says (``mooncake plan``) and in what it exports for an autoscaler that provisions devices."""
    import dataclasses

    from conductor_helpers import conductor, decode, prefill
    from prometheus_client import generate_latest

    from conductor.metrics import Metrics
    from conductor.planner.check import snapshot as conductor_snapshot
    from conductor.planning import PlannerLoop

    c = conductor("none")
    for i in range(2):
        c.register(dataclasses.replace(prefill(i), tensor_parallel_size=2), 0.0)
    c.register(dataclasses.replace(decode(0), tensor_parallel_size=4), 0.0)
    planner = Planner(PlannerConfig(interval_s=10.0, twin=False, min_prefill=2), started=0.0)
    plan = planner.decide(conductor_snapshot(planner, c, 10.0))
    assert (plan.prefill, plan.decode) == (2, 1)
    assert (plan.devices(Role.PREFILL), plan.devices(Role.DECODE)) == (4, 4)
    assert plan.describe().splitlines()[-1] == "plan: 2 prefill, 1 decode, 8 devices (prefill at TP 2, decode at TP 4)"

    loop = PlannerLoop.__new__(PlannerLoop)  # its export alone: the service's metrics
    loop.service = type("Service", (), {"metrics": Metrics()})()
    loop._export(plan)
    text = generate_latest(loop.service.metrics.registry).decode()
    assert 'mooncake_planner_desired_devices{role="prefill"} 4.0' in text
    assert 'mooncake_planner_desired_devices{role="decode"} 4.0' in text
    assert 'mooncake_planner_desired_instances{role="prefill"} 2.0' in text
