"""Chunked-pipeline prefill groups in the Conductor: a group is one prefill instance of X stages whose prefill time
it predicts for the pipeline, fitted from the group's own samples; placement then sends a long prompt to a group and
a short one to a single worker."""

from __future__ import annotations

import random

import pytest
from conductor_helpers import BT, ROUND, conductor, decode, key, prefill

from conductor.planner.costs import ModelConfig
from conductor.predictors import PipelinePrefillPredictor, PredictorConfig
from conductor.types import Instance, Load, Role, ScheduleRequest


def group(i: int, stages: int = 2, chunk: int = 64, queued_s: float = 0.0) -> Instance:
    return Instance(
        f"g{i}",
        Role.PREFILL,
        f"10.0.2.{i}:7000",
        node=f"kvg{i}",
        load=Load(queued_s=queued_s),
        pipeline_stages=stages,
        pipeline_chunk=chunk,
    )


def fresh(rid: str, prompt: int, first_key: int) -> ScheduleRequest:
    """A prompt no instance holds a block of."""
    return ScheduleRequest(rid, [key(first_key + i) for i in range(prompt // BT)], prompt, BT)


def test_a_groups_predictor_learns_the_pipelines_schedule_from_its_own_samples():
    """Samples from the simulator's exact schedule (chunks on 2 stages, attention growing): after fitting, the
    predictor gives those times for prompts it never saw, cold and behind a cached prefix."""
    m = ModelConfig()
    p = PipelinePrefillPredictor(PredictorConfig(min_samples=8), stages=2, chunk=2048)
    rng = random.Random(1)
    for _ in range(200):
        prompt = rng.randrange(100, 60_000)
        cached = rng.randrange(0, prompt // 2048 + 1) * 2048 if rng.random() < 0.5 else 0
        p.observe(prompt, min(cached, prompt - 1), m.pipelined_prefill_s(prompt, min(cached, prompt - 1), 2, 2048))
    for prompt, cached in ((85_000, 0), (40_000, 20_480), (1_500, 0), (9_000, 8_192)):
        assert p.predict(prompt, cached) == pytest.approx(m.pipelined_prefill_s(prompt, cached, 2, 2048), rel=0.03)


def test_the_prior_splits_a_nodes_rates_over_the_stages_and_pays_each_stages_overhead():
    config = PredictorConfig(prefill_tokens_per_s=1000.0, prefill_attention_s_per_token2=0.0, prefill_overhead_s=0.01)
    p = PipelinePrefillPredictor(config, stages=2, chunk=100)
    assert p.predict(50, 0) == pytest.approx(0.02 + 0.0005 * (50 + 50))  # one chunk: no overlap, two overheads
    assert p.predict(1000, 0) == pytest.approx(0.02 + 0.0005 * (1000 + 100))  # ten chunks: the fill is one chunk


def test_the_conductor_sends_a_long_prompt_to_a_group_and_a_short_one_to_a_single_worker():
    # 1 ms a token and 10 ms of overhead a prefill (a group's prior: 10 ms a stage), both instances idle
    c = conductor("none", ttft_s=100.0, predictors=ROUND.model_copy(update={"prefill_overhead_s": 0.01}))
    c.register(prefill(0), 0.0)
    c.register(group(0, stages=2, chunk=64), 0.0)
    c.register(decode(0), 0.0)
    short = c.schedule(fresh("short", 48, 2000), 0.0)
    assert short.prefill == "p0"  # 58 ms alone, 68 ms through the group: one chunk gains nothing from a pipeline
    c.finished("short", 0.0)
    c.heartbeat("p0", Load(), 0.0)
    long = c.schedule(fresh("long", 2000, 1000), 0.0)
    assert long.prefill == "g0"  # 2.01 s alone, 0.02 + (2000 + 64) / 2 ms = 1.05 s through two stages
    c.heartbeat("g0", Load(queued_s=5.0), 0.0)
    assert c.schedule(fresh("busy", 2000, 3000), 0.0).prefill == "p0"  # the group is busy for 5 s


def test_a_groups_samples_fit_its_own_predictor_not_the_single_workers():
    c = conductor("none", predictors=ROUND.model_copy(update={"min_samples": 2}))
    c.register(prefill(0), 0.0)
    c.register(group(0, stages=2, chunk=64), 0.0)
    single = c.predictors.prefill.predict(1000, 0)
    for _ in range(4):
        c.prefill_sample(1000, 0, 0.25, "g0")  # the group is faster than its prior says
    assert c.predictors.prefill.predict(1000, 0) == single  # untouched
    assert c.predictors.prefill_for(2, 64).predict(1000, 0) == pytest.approx(0.25, rel=0.05)
