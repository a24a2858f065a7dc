"""The workers' reporting rules (mooncake.serving.reports), and the Conductor pricing what a prefill worker reports.

A prefill worker reports the prompts it holds, each with what it has computed so far; the
Conductor prices them with its own predictor (``Learning.price_queue``) as the heartbeat
arrives. The twin (conductor.planner) reports through the same rules as the workers.
"""

from __future__ import annotations

import pytest
from conductor_helpers import conductor, prefill

from conductor.planner.nodecache import NodeCache
from conductor.planner.state import DecodeInstance, PrefillInstance, Record, TraceRequest
from conductor.servicer import load_from_pb, load_to_pb
from conductor.types import Decision, Instance, KeyChain, Load, Prediction, PrefixPlan, Role
from mooncake.serving import reports
from mooncake.serving.reports import InFlight, StepMean


def test_a_decode_heartbeat_reports_the_mean_of_the_decode_steps_only():
    # batch, context tokens, seconds, new tokens: the third ran a prompt's chunk, the fourth nothing, the last took no
    # time: none of those three is a decode step
    steps = [(2, 100, 0.02, 2), (4, 300, 0.04, 4), (4, 300, 0.5, 260), (0, 0, 0.01, 0), (3, 50, 0.0, 3)]
    assert reports.mean_step(*zip(*steps)) == StepMean(3.0, 200.0, pytest.approx(0.03))
    assert reports.mean_step(*zip(*steps[2:])) is None


def test_a_prompt_in_flight_counts_its_prefix_or_its_pushed_blocks_never_its_last_token():
    assert reports.cached_tokens(3, 16, 100) == 48
    assert reports.cached_tokens(7, 16, 100) == 99  # the whole prompt held: its last token is computed all the same
    assert reports.computed_tokens(100, 48, 2, 16) == 48  # fewer blocks pushed than its prefix
    assert reports.computed_tokens(100, 48, 5, 16) == 80
    assert reports.computed_tokens(100, 48, 7, 16) == 99
    assert reports.queued_tokens([InFlight(100, 80), InFlight(50, 0)]) == 70


def test_a_prefill_sample_is_its_own_share_of_the_steps_where_it_was_measured():
    assert reports.prefill_sample(100, 16, 0.5, 0.2) == reports.PrefillSample(100, 16, 0.2)
    assert reports.prefill_sample(100, 16, 0.5) == reports.PrefillSample(100, 16, 0.5)


def test_calibration_prompts_and_beats():
    assert reports.calibration_lengths(64) == [8, 32, 64]
    assert reports.calibration_lengths(4096, limit=1000) == [512, 1000, 1000]
    assert reports.beat_interval(2.5, 0.5, holding=True) == 0.5
    assert reports.beat_interval(2.5, 0.5, holding=False) == 2.5
    assert reports.beat_interval(2.5, 0.0, holding=True) == 2.5  # no busy period: the Conductor's interval


def test_the_conductor_prices_the_prompts_a_prefill_worker_reports_with_its_own_predictor():
    """1 ms a token (conductor_helpers.ROUND): 1,000 tokens left of one prompt, 500 of another, at a slowdown of 2."""
    c = conductor("none")
    c.register(prefill(0), 0.0)
    c.instances["p0"].slowdown = 2.0
    c.heartbeat("p0", Load(queued_requests=2, prompts=(InFlight(1200, 200), InFlight(500, 0))), 1.0)
    load = c.instances["p0"].load
    assert load.queued_s == pytest.approx(2 * 1.5)
    assert load.queued_tokens == 1500
    # what the worker says of its queue itself is not read when it reports prompts; an older worker's is
    c.heartbeat("p0", Load(queued_requests=1, queued_s=9.0, prompts=(InFlight(100, 0),)), 2.0)
    assert c.instances["p0"].load.queued_s == pytest.approx(2 * 0.1)
    c.heartbeat("p0", Load(queued_requests=1, queued_s=0.25), 3.0)
    assert c.instances["p0"].load.queued_s == pytest.approx(2 * 0.25)


def test_a_pipeline_groups_prompts_are_priced_with_the_groups_predictor():
    c = conductor("none")
    group = Instance("g0", Role.PREFILL, "10.0.0.9:7000", node="kv9", pipeline_stages=2, pipeline_chunk=256)
    c.register(group, 0.0)
    c.heartbeat("g0", Load(queued_requests=1, prompts=(InFlight(1024, 0),)), 1.0)
    want = c.predictors.prefill_for(2, 256).predict(1024, 0)
    assert want != pytest.approx(c.predictors.prefill.predict(1024, 0))
    assert c.instances["g0"].load.queued_s == pytest.approx(want)


def test_the_prompts_cross_the_wire():
    load = Load(queued_requests=2, queued_tokens=70, prompts=(InFlight(100, 80), InFlight(50, 0)))
    assert load_from_pb(load_to_pb(load)) == load


def _record(prompt: int, local_blocks: int, rid: str = "r") -> Record:
    req = TraceRequest(0, 0.0, prompt, 10, [], KeyChain(b""))
    plan = PrefixPlan(local_blocks, None, 0, prompt - local_blocks * 512)
    rec = Record(req, rid)
    rec.decision = Decision(rid, "p0", "d0", plan, Prediction(1.0, 0.0), "kvcache_centric")
    return rec


@pytest.mark.parametrize("stages", [1, 2])
def test_the_twins_prefill_instance_reports_its_prompts_as_a_worker_does(stages):
    """The running prompt: its prefix read for 1 s, then 2,048 tokens computed over 4 s (whole 512-token blocks as they
    are done; a pipelined group's stages report none until it ends); the queued one: its plan's prefix."""
    inst = Instance("p0", Role.PREFILL, "sim:p0", node="kv0", pipeline_stages=stages)
    p = PrefillInstance(inst, NodeCache("kv0", None, 0, "lru", lambda node, events: None), 512)
    running = _record(3072, 2)
    running.cached_tokens, running.prefill_start, running.load_s, running.compute_s = 1024, 10.0, 1.0, 4.0
    p.running = running
    p.queue.append(_record(1000, 1, "q"))
    assert p.load(10.5).prompts == (InFlight(3072, 1024), InFlight(1000, 512))
    half = p.load(13.0)
    assert half.prompts[0] == InFlight(3072, 2048 if stages == 1 else 1024)
    assert half.queued_requests == 2 and half.queued_s == 0.0  # the Conductor prices them


def test_the_twins_decode_heartbeats_report_the_mean_step_since_the_last():
    d = DecodeInstance(Instance("d0", Role.DECODE, "sim:d0", node="kvd0"), 10_000)
    d.reserve(4)
    d.durations[:4], d.batches[:4], d.contexts[:4], d.new_tokens[:4] = [0.01, 0.03, 0.5, 0.02], 2, 100, [2, 2, 300, 2]
    assert d.step_report(2) == StepMean(2.0, 100.0, pytest.approx(0.02))
    assert d.step_report(2) is None  # reported already
    assert d.step_report(4) == StepMean(2.0, 100.0, pytest.approx(0.02))  # the step with a prompt's chunk: not counted
