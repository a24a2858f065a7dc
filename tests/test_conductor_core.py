"""The Conductor's pure core: predictors, prefill policies, decode selection and forecasts.

Every test hand-builds a cluster whose answer is known (conductor_helpers: predictors at
round numbers), and checks which instance, which prefix plan, or which prediction comes
out. The Conductor's admission and state: test_conductor_admission.py.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
from conductor_helpers import (
    BT,
    KEYS,
    ROUND,
    cluster,
    conductor,
    decode,
    decode_formula,
    match_of,
    predictors,
    prefill,
    request,
)

from conductor.admission import decode_load, reported_batch, select_decode
from conductor.forecast import UNSTARTED_KEEP_S, DecodeForecast
from conductor.policies import PolicyConfig, make_policy
from conductor.predictors import DecodePredictor, PredictorConfig, PrefillPredictor, TransferPredictor
from conductor.types import Decision, Instance, Load, Role
from kvstore.events import Tier

# -- predictors ----------------------------------------------------------------------------


def prefill_formula(prompt: int, cached: int) -> float:
    new = prompt - cached
    return 0.02 + 1.2e-4 * new + 3e-9 * new * (prompt + cached) / 2


def test_prefill_predictor_uses_the_default_until_min_samples_then_fits_the_formula():
    config = PredictorConfig(
        prefill_tokens_per_s=5000.0, prefill_attention_s_per_token2=1e-9, prefill_overhead_s=0.05, min_samples=8
    )
    p = PrefillPredictor(config)
    rng = random.Random(0)
    samples = []
    for _ in range(60):
        prompt = rng.randint(100, 16000)
        cached = rng.randint(0, prompt)
        samples.append((prompt, cached))
    default = 0.05 + 3000 / 5000 + 1e-9 * 3000 * (4000 + 1000) / 2
    for prompt, cached in samples[:7]:
        p.observe(prompt, cached, prefill_formula(prompt, cached))
    assert p.predict(4000, 1000) == pytest.approx(default, rel=1e-9)  # 7 samples: still the default
    p.observe(*samples[7], prefill_formula(*samples[7]))
    assert p.predict(4000, 1000) == pytest.approx(prefill_formula(4000, 1000), rel=0.01)  # the 8th: fitted
    for prompt, cached in samples[8:]:
        p.observe(prompt, cached, prefill_formula(prompt, cached))
    assert p.num_samples == 60
    for prompt, cached in [(4000, 1000), (30000, 0), (8192, 8000), (200, 0), (12345, 6789)]:  # none of them seen
        assert p.predict(prompt, cached) == pytest.approx(prefill_formula(prompt, cached), rel=0.01)
    assert p.predict(4000, 1000) != pytest.approx(default, rel=0.01)


def test_prefill_predictor_refits_when_the_hardware_changes():
    p = PrefillPredictor(PredictorConfig(min_samples=8, window=40))
    rng = random.Random(1)
    for scale in (1.0, 3.0):  # the same model on a three times slower machine
        for _ in range(60):
            prompt = rng.randint(100, 8000)
            cached = rng.randint(0, prompt)
            p.observe(prompt, cached, scale * prefill_formula(prompt, cached))
        assert p.predict(6000, 500) == pytest.approx(scale * prefill_formula(6000, 500), rel=0.01)


def test_prefill_predictor_fitted_on_one_prompt_length_with_noisy_times_predicts_those_times():
    """Chat prompts of nearly one length, timed with noise (batching): the noise must not become a huge rate with
    its negative constant clamped away (that predicted 9 s for prefills of 1 s and refused 4 concurrent requests)."""
    p = PrefillPredictor(PredictorConfig())
    rng = random.Random(0)
    for _ in range(24):
        p.observe(rng.randint(270, 300), 0, rng.uniform(0.4, 1.5))
    assert 0.5 < p.predict(285, 0) < 1.5
    assert p.predict(15, 0) < p.predict(285, 0) and all(c >= 0 for c in p.coef)


@pytest.mark.parametrize(
    "prompt, cached, seconds",
    [(0, 0, 1.0), (-5, 0, 1.0), (100, -1, 1.0), (100, 101, 1.0), (100, 0, 0.0), (100, 0, -1.0)],
)
def test_prefill_predictor_rejects_bad_samples(prompt, cached, seconds):
    p = PrefillPredictor(PredictorConfig())
    with pytest.raises(ValueError):
        p.observe(prompt, cached, seconds)
    assert p.num_samples == 0


def test_prefill_prediction_clamps_cached_tokens_to_the_prompt():
    p = PrefillPredictor(ROUND)
    assert p.predict(1000, 0) == pytest.approx(1.0)
    assert p.predict(1000, 2000) == pytest.approx(0.0)  # more cached than the prompt: nothing to compute
    assert p.predict(1000, -50) == pytest.approx(1.0)


def test_decode_predictor_uses_the_default_until_min_samples_then_fits_the_formula():
    d = DecodePredictor(
        PredictorConfig(decode_base_s=0.03, decode_s_per_request=0.001, decode_s_per_context_token=1e-7, min_samples=8)
    )
    rng = random.Random(2)
    batches = [(b, b * rng.randint(100, 4000)) for b in (rng.randint(1, 128) for _ in range(40))]
    for b, ctx in batches[:7]:
        d.observe(b, ctx, decode_formula(b, ctx))
    assert d.predict(10, 20000) == pytest.approx(0.03 + 0.01 + 0.002, rel=1e-9)
    d.observe(*batches[7], decode_formula(*batches[7]))
    assert d.predict(10, 20000) == pytest.approx(decode_formula(10, 20000), rel=0.01)
    for b, ctx in batches[8:]:
        d.observe(b, ctx, decode_formula(b, ctx))
    for b, ctx in [(10, 20000), (200, 800000), (1, 100), (64, 64 * 3000)]:
        assert d.predict(b, ctx) == pytest.approx(decode_formula(b, ctx), rel=0.01)
    assert d.predict(0, 0) == 0.0  # an idle instance has no step time


@pytest.mark.parametrize(
    "batch, context, step_s", [(0, 100, 0.02), (-1, 100, 0.02), (4, -1, 0.02), (4, 100, 0.0), (4, 100, -0.1)]
)
def test_decode_predictor_rejects_bad_samples(batch, context, step_s):
    d = DecodePredictor(PredictorConfig())
    with pytest.raises(ValueError):
        d.observe(batch, context, step_s)


def test_transfer_predictor_moves_toward_the_observed_bandwidth():
    t = TransferPredictor(PredictorConfig(transfer_bytes_per_s=10e9, transfer_latency_s=0.001))
    assert t.predict(10**9) == pytest.approx(0.101)
    assert t.predict(0) == 0.0
    t.observe(100_000_000, 0.1 + 0.001)  # the link really moves 1 GB/s: the first sample replaces the guess
    assert t.predict(10**9) == pytest.approx(1.001)
    estimates = []
    for _ in range(30):  # then it slows to 0.5 GB/s
        t.observe(100_000_000, 0.2 + 0.001)
        estimates.append(t.predict(10**9))
    assert all(a < b for a, b in zip(estimates, estimates[1:]))  # every sample pulls the estimate up toward 2 s
    assert estimates[0] == pytest.approx(1 / 0.9 + 0.001, rel=0.01)  # a fifth of the way: 0.9 GB/s
    assert estimates[-1] == pytest.approx(2.001, rel=0.01)
    for num_bytes, seconds in [(0, 1.0), (100, 0.0), (-1, 1.0)]:
        with pytest.raises(ValueError):
            t.observe(num_bytes, seconds)


# -- policies on a hand-built cluster --------------------------------------------------------


def test_random_policy_spreads_over_all_instances_and_reuses_the_chosen_ones_prefix():
    policy = make_policy("random", PolicyConfig(seed=3))
    cluster = [prefill(i) for i in range(4)]
    match = match_of({"kv0": 2, "kv1": 4, "kv2": 6, "kv3": 8})
    counts = {i.id: 0 for i in cluster}
    for _ in range(400):
        choice = policy.choose(request(), cluster, match, predictors())
        counts[choice.instance.id] += 1
        assert choice.plan.local_blocks == match.blocks(choice.instance.node)
        assert choice.plan.fetch_blocks == 0
    assert all(60 <= n <= 140 for n in counts.values()), counts


def test_round_robin_visits_every_instance_in_turn():
    policy = make_policy("round_robin")
    cluster = [prefill(i) for i in range(4)]
    match = match_of({"kv3": 10})  # even a perfect cache hit does not break the rotation
    picks = []
    for n in range(12):
        candidates = cluster[:]
        random.Random(n).shuffle(candidates)  # the order candidates arrive in does not matter
        picks.append(policy.choose(request(), candidates, match, predictors()).instance.id)
    assert picks == ["p0", "p1", "p2", "p3"] * 3


def test_least_loaded_picks_the_shortest_queue_even_without_the_cache():
    policy = make_policy("least_loaded")
    cluster = [prefill(0, 2.0), prefill(1, 0.5), prefill(2, 0.25), prefill(3, 1.0)]
    choice = policy.choose(request(), cluster, match_of({"kv0": 10, "kv2": 3}), predictors())
    assert choice.instance.id == "p2"
    assert choice.plan.local_blocks == 3
    assert choice.plan.compute_tokens == 10 * BT - 3 * BT
    assert choice.queue_s == 0.25
    assert choice.ttft_s == pytest.approx(0.25 + 0.112)


def test_cache_aware_local_takes_the_longest_prefix_when_its_queue_is_short_enough():
    policy = make_policy("cache_aware_local")
    # p1 holds 8 of 10 blocks: 0.1 s queue + 32 tokens = 0.132 s; p2 (idle, 1 block): 0.144 s; p0: 0.160 s
    cluster = [prefill(0, 0.0), prefill(1, 0.1), prefill(2, 0.0)]
    choice = policy.choose(request(), cluster, match_of({"kv1": 8, "kv2": 1}), predictors())
    assert choice.instance.id == "p1"
    assert (choice.plan.local_blocks, choice.plan.fetch_node, choice.plan.compute_tokens) == (8, None, 32)
    assert choice.ttft_s == pytest.approx(0.132)


def test_cache_aware_local_skips_the_longest_prefix_when_its_queue_makes_ttft_worse():
    policy = make_policy("cache_aware_local")
    # p1: 0.2 s queue + 0.032 s = 0.232 s; p2: 2 blocks cached, 0.128 s; p0: 0.160 s
    cluster = [prefill(0, 0.0), prefill(1, 0.2), prefill(2, 0.0)]
    choice = policy.choose(request(), cluster, match_of({"kv1": 8, "kv2": 2}), predictors())
    assert choice.instance.id == "p2"
    assert (choice.plan.local_blocks, choice.plan.compute_tokens) == (2, 128)
    assert choice.ttft_s == pytest.approx(0.128)


def test_kvcache_centric_fetches_the_best_prefix_when_it_is_over_the_threshold():
    policy = make_policy("kvcache_centric", PolicyConfig(kvcache_balancing_threshold=1.5))
    # the pool node kv9 holds 8 blocks, p0 holds 4: 8 / 4 = 2 > 1.5, so p0 pulls blocks 4..7 from kv9
    choice = policy.choose(request(), [prefill(0)], match_of({"kv0": 4, "kv9": 8}), predictors())
    plan = choice.plan
    assert (plan.local_blocks, plan.fetch_node, plan.fetch_blocks, plan.compute_tokens) == (4, "kv9", 4, 32)
    assert plan.reused_blocks == 8 and plan.keep_fetched
    assert choice.transfer_s == pytest.approx(0.004)  # 4 blocks at 1 ms
    assert choice.ttft_s == pytest.approx(0.004 + 0.032)


def test_kvcache_centric_keeps_its_own_prefix_when_the_best_is_under_the_threshold():
    policy = make_policy("kvcache_centric", PolicyConfig(kvcache_balancing_threshold=1.5))
    # kv9 holds 8, p0 holds 6: 8 / 6 = 1.33 < 1.5, so p0 computes blocks 6..9 even though fetching is cheaper
    choice = policy.choose(request(), [prefill(0)], match_of({"kv0": 6, "kv9": 8}), predictors())
    plan = choice.plan
    assert (plan.local_blocks, plan.fetch_node, plan.fetch_blocks, plan.compute_tokens) == (6, None, 0, 64)
    assert choice.transfer_s == 0.0
    # the same request with a lower threshold does fetch
    lower = make_policy("kvcache_centric", PolicyConfig(kvcache_balancing_threshold=1.2))
    plan = lower.choose(request(), [prefill(0)], match_of({"kv0": 6, "kv9": 8}), predictors()).plan
    assert (plan.local_blocks, plan.fetch_node, plan.fetch_blocks, plan.compute_tokens) == (6, "kv9", 2, 32)


def test_kvcache_centric_sends_a_hot_prefix_to_an_idle_instance_where_cache_aware_local_cannot():
    # p1 holds the whole prefix but is busy for 1 s; p0 is idle with nothing cached
    cluster = [prefill(0, 0.0), prefill(1, 1.0)]
    match = match_of({"kv1": 8})
    centric = make_policy("kvcache_centric").choose(request(), cluster, match, predictors())
    assert centric.instance.id == "p0"
    assert (
        centric.plan.local_blocks,
        centric.plan.fetch_node,
        centric.plan.fetch_blocks,
        centric.plan.compute_tokens,
    ) == (0, "kv1", 8, 32)
    assert centric.ttft_s == pytest.approx(0.008 + 0.032)
    local = make_policy("cache_aware_local").choose(request(), cluster, match, predictors())
    assert local.instance.id == "p0" and local.plan.reused_blocks == 0 and local.ttft_s == pytest.approx(0.160)


@pytest.mark.parametrize("kind", ["random", "round_robin", "least_loaded", "cache_aware_local", "kvcache_centric"])
def test_a_fully_cached_prompt_still_computes_one_token(kind):
    policy = make_policy(kind)
    # cached locally; for kvcache_centric also held only by the pool node kv9 (fetched)
    for holdings in ({"kv0": 10}, {"kv9": 10}) if kind == "kvcache_centric" else ({"kv0": 10},):
        choice = policy.choose(request(prompt=10 * BT), [prefill(0)], match_of(holdings), predictors())
        assert choice.plan.compute_tokens == 1
        assert choice.prefill_s == pytest.approx(0.001)
    # a prompt whose tail is a partial block computes just that tail
    choice = policy.choose(request(prompt=10 * BT + 5), [prefill(0)], match_of({"kv0": 10}), predictors())
    assert choice.plan.compute_tokens == 5


@pytest.mark.parametrize("kind", ["cache_aware_local", "kvcache_centric"])
def test_tier_aware_recomputes_a_prefix_on_slow_ssd_and_loads_it_from_fast_ssd(kind):
    # kv0: blocks 0-1 in DRAM, 2-9 on SSD. Recomputing blocks 2-9 is 128 tokens = 0.128 s.
    held = [(i, Tier.DRAM if i < 2 else Tier.SSD) for i in range(10)]
    req = request(prompt=10 * BT + 10)
    slow = make_policy(kind, PolicyConfig(tier_aware=True, ssd_bytes_per_s=1e6))  # 8 blocks: 8 s to load
    choice = slow.choose(req, [prefill(0)], match_of({"kv0": held}), predictors())
    assert (choice.plan.local_blocks, choice.plan.compute_tokens) == (2, 8 * BT + 10)
    assert choice.ttft_s == pytest.approx(0.138)
    fast = make_policy(kind, PolicyConfig(tier_aware=True, ssd_bytes_per_s=1e10))  # 8 blocks: 0.8 ms to load
    choice = fast.choose(req, [prefill(0)], match_of({"kv0": held}), predictors())
    assert (choice.plan.local_blocks, choice.plan.compute_tokens) == (10, 10)
    assert choice.ttft_s == pytest.approx(0.0008 + 0.010)
    # without tier_aware the SSD is free: the whole prefix is reused however slow the SSD is
    blind = make_policy(kind, PolicyConfig(tier_aware=False, ssd_bytes_per_s=1e6))
    assert blind.choose(req, [prefill(0)], match_of({"kv0": held}), predictors()).plan.local_blocks == 10


@pytest.mark.parametrize("pool", ["kv1", "kv9"])  # sorting before and after the instance's own kv5
def test_tier_aware_fetches_from_a_pools_dram_rather_than_reading_its_own_slow_ssd(pool):
    # p5's node kv5: blocks 0-1 in DRAM, 2-9 on a slow SSD (8 s to read); the pool holds all 10 in DRAM
    held = [(i, Tier.DRAM if i < 2 else Tier.SSD) for i in range(10)]
    policy = make_policy("kvcache_centric", PolicyConfig(tier_aware=True, ssd_bytes_per_s=1e6))
    p5 = Instance("p5", Role.PREFILL, "10.0.0.5:7000", node="kv5")
    choice = policy.choose(request(prompt=10 * BT + 10), [p5], match_of({"kv5": held, pool: 10}), predictors())
    plan = choice.plan
    assert (plan.local_blocks, plan.fetch_node, plan.fetch_blocks, plan.compute_tokens) == (2, pool, 8, 10)
    assert choice.ttft_s == pytest.approx(0.008 + 0.010)


def test_tier_aware_prices_the_ssd_blocks_a_fetch_must_read_on_the_holder():
    # p5's kv5: blocks 0-1 in DRAM, 2-9 on SSD. Recomputing 2-9 costs 0.128 s.
    own = [(i, Tier.DRAM if i < 2 else Tier.SSD) for i in range(10)]
    p5 = Instance("p5", Role.PREFILL, "10.0.0.5:7000", node="kv5")
    req = request(prompt=10 * BT + 10)
    slow = make_policy("kvcache_centric", PolicyConfig(tier_aware=True, ssd_bytes_per_s=1e6))  # 1 s per block
    # the pool keeps all 10 on the same slow SSD: fetching 2-9 means 8 s of reading, so recompute
    plan = slow.choose(req, [p5], match_of({"kv5": own, "kv1": [(i, Tier.SSD) for i in range(10)]}), predictors()).plan
    assert (plan.local_blocks, plan.fetch_node, plan.fetch_blocks, plan.compute_tokens) == (2, None, 0, 8 * BT + 10)
    # at 50 MB/s (20 ms a block) reading kv5's own 8 costs 0.17 s, more than recomputing them; the pool has 0-5
    # in DRAM and 6-9 on SSD, so fetching 2-9 reads only its 4 SSD blocks: 0.080 + 0.008 moved + 0.010 = 0.098 s
    medium = make_policy("kvcache_centric", PolicyConfig(tier_aware=True, ssd_bytes_per_s=5e7))
    pool = [(i, Tier.DRAM if i < 6 else Tier.SSD) for i in range(10)]
    choice = medium.choose(req, [p5], match_of({"kv5": own, "kv1": pool}), predictors())
    assert (choice.plan.local_blocks, choice.plan.fetch_node, choice.plan.fetch_blocks, choice.plan.compute_tokens) == (
        2,
        "kv1",
        8,
        10,
    )
    assert choice.ttft_s == pytest.approx(0.098)


def test_tier_aware_fetches_from_a_pools_dram_rather_than_reading_its_own_ssd_at_any_speed():
    own = [(i, Tier.DRAM if i < 2 else Tier.SSD) for i in range(10)]
    p5 = Instance("p5", Role.PREFILL, "10.0.0.5:7000", node="kv5")
    policy = make_policy("kvcache_centric", PolicyConfig(tier_aware=True, ssd_bytes_per_s=1e8))  # 10 ms a block
    choice = policy.choose(request(prompt=10 * BT + 10), [p5], match_of({"kv5": own, "kv1": 10}), predictors())
    assert (choice.plan.local_blocks, choice.plan.fetch_node, choice.plan.fetch_blocks, choice.plan.compute_tokens) == (
        2,
        "kv1",
        8,
        10,
    )
    assert choice.ttft_s == pytest.approx(0.018)


@pytest.mark.parametrize("kind", ["cache_aware_local", "kvcache_centric"])
def test_tier_aware_charges_only_the_blocks_that_are_on_ssd(kind):
    # block 0 on SSD, 1-9 in DRAM: reusing all 10 costs one SSD read, not ten
    held = [(0, Tier.SSD)] + [(i, Tier.DRAM) for i in range(1, 10)]
    policy = make_policy(kind, PolicyConfig(tier_aware=True, ssd_bytes_per_s=5e7))  # one block: 20 ms to read
    choice = policy.choose(request(prompt=10 * BT + 10), [prefill(0)], match_of({"kv0": held}), predictors())
    assert (choice.plan.local_blocks, choice.plan.compute_tokens) == (10, 10)
    assert choice.ttft_s == pytest.approx(0.020 + 0.010)


@pytest.mark.parametrize("order", [(0, 1), (1, 0)])
@pytest.mark.parametrize("kind", ["cache_aware_local", "kvcache_centric"])
def test_tier_aware_prices_each_instance_by_its_own_ssd_blocks(kind, order):
    # both nodes hold all 10 blocks with block 0 on SSD; kv0 has 1-9 in DRAM, kv1 has them on SSD too.
    # p0: 0.05 s queue + one SSD read (0.02 s) + 10 tokens = 0.08 s; p1: recompute 170 tokens = 0.17 s
    held0 = [(0, Tier.SSD)] + [(i, Tier.DRAM) for i in range(1, 10)]
    all_ssd = [(i, Tier.SSD) for i in range(10)]
    policy = make_policy(kind, PolicyConfig(tier_aware=True, ssd_bytes_per_s=5e7))
    candidates = [prefill(i, 0.05 if i == 0 else 0.0) for i in order]
    # kv (sorting first) is the longest holder, so neither instance's node is special to kvcache_centric
    match = match_of({"kv0": held0, "kv1": all_ssd, "kv": all_ssd})
    choice = policy.choose(request(prompt=10 * BT + 10), candidates, match, predictors())
    assert choice.instance.id == "p0"
    assert (choice.plan.local_blocks, choice.plan.fetch_blocks, choice.plan.compute_tokens) == (10, 0, 10)
    assert choice.ttft_s == pytest.approx(0.08)


def test_make_policy_rejects_an_unknown_name():
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy("fastest")


# -- decode selection and load ----------------------------------------------------------------


def test_select_decode_picks_the_lightest_batch_and_skips_full_instances():
    d = DecodePredictor(ROUND)
    inst, tbt = select_decode(request(), [decode(0, 5), decode(1, 2), decode(2, 7)], d, reported_batch)
    assert inst.id == "d1" and tbt == pytest.approx(0.01 + 0.01 * 3)
    inst, _ = select_decode(request(), [decode(0, 5), decode(1, 2, capacity=2)], d, reported_batch)
    assert inst.id == "d0"  # d1 is full


def test_the_conductor_counts_requests_sent_to_a_decode_instance_until_they_start_decoding():
    c = conductor("none")
    c.register(prefill(0), 0.0)
    for i, running in ((0, 5), (1, 2)):
        c.register(decode(i), 0.0)
        c.heartbeat(f"d{i}", Load(running_requests=running), 0.0)
    sent = [c.schedule(request(f"x{n}"), 0.0).decode for n in range(4)]
    assert sent == ["d1", "d1", "d1", "d0"]  # d1 would run 3, 4, 5 (a tie with d0, broken by id), then d0 6
    for n in range(4):
        c.decode_started(f"x{n}", 1.0)  # started: from now on the heartbeats count them
    c.heartbeat("d0", Load(running_requests=6), 1.0)
    c.heartbeat("d1", Load(running_requests=5), 1.0)
    assert c.schedule(request("y"), 1.0).decode == "d1"


def test_decode_load_now_and_at_a_later_time_from_the_forecast():
    d = DecodePredictor(ROUND)
    forecast = DecodeForecast(default_decode_s=0.5)
    for n in range(10):  # d0 runs 10 requests that started decoding at t=9.8, ending at 10.3
        forecast.scheduled(f"x{n}", "d0", 9.8, 100)
        forecast.decode_started(f"x{n}", 9.8)
    decodes = [decode(0, running=10)]

    def at(t):
        return lambda inst: forecast.batch_at(inst.id, t, 10.0)

    assert decode_load(decodes, d, reported_batch, 0.1) == pytest.approx(1.1)
    assert decode_load(decodes, d, at(10.0), 0.1) == pytest.approx(1.1)
    assert decode_load(decodes, d, at(11.0), 0.1) == 0.0  # all finished by then
    # a request whose prefill finishes at 10.9 joins the batch at 11.0
    forecast.scheduled("late", "d0", 10.9, 100)
    assert decode_load(decodes, d, at(11.0), 0.1) == pytest.approx(0.2)
    assert decode_load([], d, reported_batch, 0.1) == float("inf")


def test_the_forecast_counts_each_decode_instances_requests_in_prefill_and_decoding():
    forecast = DecodeForecast(default_decode_s=1.0)
    for n in range(3):
        forecast.scheduled(f"a{n}", "d0", 0.5, 100, 0.0)
    forecast.scheduled("b", "d1", 0.5, 100, 0.0)
    forecast.scheduled("a0", "d0", 0.7, 100, 0.1)  # placed again (a retry): still one request
    forecast.decode_started("a1", 0.6)
    forecast.decode_started("a1", 0.6)  # a repeated report moves nothing twice
    assert (forecast.occupancy("d0"), forecast.occupancy("d1"), forecast.occupancy("dx")) == (
        (2, 1, 0),
        (1, 0, 0),
        (0, 0, 0),
    )
    assert forecast.count("d0") == 3
    forecast.finished("a1", 0.9)
    forecast.finished("a2", 0.9)  # refused by its worker before it decoded: reported finished too
    forecast.finished("a2", 0.9)
    assert forecast.occupancy("d0") == (1, 0, 0)
    forecast.forget_instance("d1")
    assert forecast.occupancy("d1") == (0, 0, 0)
    forecast.scheduled(
        "c", "d0", 1.0, 100, 0.9, landing_blocks=7
    )  # its prompt's KV holds 7 landing blocks until it decodes
    forecast.scheduled("c2", "d0", 1.0, 100, 0.9, landing_blocks=5)
    assert forecast.occupancy("d0") == (3, 0, 12)
    forecast.decode_started("c", 1.0)
    assert forecast.occupancy("d0") == (2, 1, 5)
    forecast.scheduled(
        "c2", "d0", 1.1, 100, 1.0, landing_blocks=6
    )  # placed again: its old blocks are not counted twice
    assert forecast.occupancy("d0") == (2, 1, 6)
    forecast.expire(100.0)  # long past any decode: the decoding one's report was lost
    # the two not decoding yet may wait in prefill or for a place that long: they stay, blocks and all
    assert forecast.occupancy("d0") == (2, 0, 6) and len(forecast) == 2
    forecast.expire(
        1.1 + UNSTARTED_KEEP_S + 4.5
    )  # and go once past that too: a lost report does not hold a place forever
    assert forecast.occupancy("d0") == (0, 0, 0) and len(forecast) == 0


def measured(forecast: DecodeForecast, durations: list[float]) -> None:
    """Teach ``forecast`` these decode durations (requests that started at 0 and finished after each)."""
    for n, seconds in enumerate(durations):
        forecast.scheduled(f"past{n}", "dx", 0.0, 1)
        forecast.decode_started(f"past{n}", 0.0)
        forecast.finished(f"past{n}", seconds)


def test_survival_forecast_counts_a_request_by_its_chance_to_still_run():
    # half the decodes take 1 s, half 100 s: t_d (an average) says everything is gone after ~50 s
    # and everything runs until then; the distribution says a request that has run 5 s is a long one
    forecast = DecodeForecast(default_decode_s=10.0, kind="survival")
    measured(forecast, [1.0, 100.0] * 10)
    now = 1000.0
    forecast.scheduled("old", "d0", now - 5, 100)
    forecast.decode_started("old", now - 5)  # has run 5 s: one of the long ones
    assert forecast.batch_at("d0", now + 10, now) == pytest.approx((1.0, 100.0))
    forecast.scheduled("fresh", "d0", now, 100)
    forecast.decode_started("fresh", now)  # just started: a coin toss whether it is still running 10 s on
    assert forecast.batch_at("d0", now + 10, now) == pytest.approx((1.5, 150.0))
    assert forecast.batch_at("d0", now + 200, now) == (0.0, 0.0)  # longer than any measured decode
    forecast.scheduled("next", "d0", now + 20, 1000)  # its prefill ends at now + 20: not there at now + 10
    assert forecast.batch_at("d0", now + 10, now)[0] == pytest.approx(1.5)
    assert forecast.batch_at("d0", now + 20, now) == pytest.approx((2.5, 1150.0))


def test_survival_forecast_expects_the_joins_to_come_at_the_recent_rate():
    # one decode start a second for 20 s, each decoding 10 s, 300 tokens of context, over 2 instances
    forecasts = {k: DecodeForecast(default_decode_s=10.0, kind=k, min_samples=10) for k in ("uniform", "survival")}
    for f in forecasts.values():
        for n in range(20):
            f.scheduled(f"r{n}", f"d{n % 2}", float(n), 300)
            f.decode_started(f"r{n}", float(n))
        for n in range(10):
            f.finished(f"r{n}", n + 10.0)
    survival = forecasts["survival"]
    # 0.5 starts a second per instance; one starting within the next 4 s still runs at now + 4
    assert survival.joins(23.0, 19.0, instances=2) == pytest.approx((2.0, 600.0))
    # far ahead: Little's law, 0.5 a second x 10 s each
    assert survival.joins(119.0, 19.0, instances=2) == pytest.approx((5.0, 1500.0))
    assert survival.joins(19.0, 19.0, instances=2) == (0.0, 0.0)
    assert forecasts["uniform"].joins(119.0, 19.0, instances=2) == (0.0, 0.0)  # the paper's forecast has no such term
    # requests usually reach decode 2 s after they are scheduled: of those arriving from now on, only the
    # first 2 s of them start before now + 4 (the rest of the next 4 s is the flights already scheduled)
    for n in range(40):
        survival.scheduled(f"h{n}", "d0", 21.0, 300, now=19.0)
    assert survival.horizon_s == pytest.approx(2.0, rel=0.02)
    assert survival.joins(23.0, 19.0, instances=2)[0] == pytest.approx(1.0, rel=0.02)
    assert survival.joins(20.5, 19.0, instances=2) == (0.0, 0.0)  # sooner than anything new could arrive


def test_a_request_late_for_its_predicted_start_is_forecast_from_now():
    for kind in ("uniform", "survival"):
        forecast = DecodeForecast(default_decode_s=10.0, kind=kind)
        measured(forecast, [10.0] * 20)
        forecast.scheduled("waiting", "d0", 50.0, 100)  # predicted to start decoding at 50, has not by 100
        assert forecast.batch_at("d0", 105.0, 100.0) == pytest.approx((1.0, 100.0)), kind


def test_survival_forecast_is_the_uniform_one_until_it_has_measurements_and_keeps_a_window():
    uniform = DecodeForecast(default_decode_s=10.0)
    survival = DecodeForecast(default_decode_s=10.0, kind="survival", window=20, min_samples=20)
    for f in (uniform, survival):
        measured(f, [100.0] * 19)
        f.scheduled("a", "d0", 0.0, 100)
        f.decode_started("a", 0.0)
    assert uniform.t_d > 50  # the EMA moved toward 100 s
    assert survival.batch_at("d0", 50.0, 1.0) == uniform.batch_at("d0", 50.0, 1.0) == (1.0, 100.0)
    measured(survival, [100.0] + [1.0] * 20)  # the window now holds only the 1 s decodes
    assert survival.batch_at("d0", 50.0, 0.5) == (0.0, 0.0)  # every decode takes 1 s: gone long before 50 s
    assert survival.batch_at("d0", 0.5, 0.5) == (1.0, 100.0)  # but it runs now
    assert survival.batch_at("d0", 50.0, 10.0) == (1.0, 100.0)  # older than any measured decode: counted in full


def test_expiry_keeps_flights_as_long_as_the_longest_measured_decode():
    forecast = DecodeForecast(default_decode_s=1.0, kind="survival")
    measured(forecast, [1.0] * 19 + [500.0])
    forecast.scheduled("long", "d0", 0.0, 100)
    forecast.decode_started("long", 0.0)
    forecast.expire(900.0)  # 4 t_d is far less; twice the longest decode is 1000 s
    assert len(forecast) == 1
    forecast.expire(1001.0)
    assert len(forecast) == 0


def test_tbt_headroom_keeps_the_predicted_step_under_a_share_of_the_slo():
    # 8 running + this one: 0.10 s, exactly the SLO; with headroom 0.9 the limit is 0.09 s
    for headroom, admitted in ((1.0, True), (0.9, False)):
        c = conductor("early", tbt_headroom=headroom)
        cluster(c)
        c.heartbeat("d0", Load(running_requests=8), 0.0)
        outcome = c.schedule(request(), 0.0)
        assert isinstance(outcome, Decision) is admitted, headroom
        c.set_admission("baseline")
        assert (c.admit_at_decode("d0", 1.0) is None) is admitted


def test_a_request_that_follows_a_placed_one_is_planned_with_the_blocks_its_prefill_writes():
    """A sibling choice, sent once the first has its first token, meets a pool that is still writing the prompt's blocks
    and an index that has not heard of them: it is placed where they are being written, planned to load them; a
    request that does not say whom it follows, or whose prompt differs, or that comes long after, is not."""
    c = conductor("none", ttft_s=100.0)
    cluster(c, prefills=2)
    first = c.schedule(request("a", blocks=6, prompt=100), 0.0)
    assert isinstance(first, Decision) and (first.prefill, first.plan.compute_tokens) == ("p0", 100)
    alone = c.schedule(request("b", blocks=6, prompt=100), 0.0)
    assert alone.plan.reused_blocks == 0 and alone.prefill != first.prefill  # p0 has a's prompt queued
    for n in range(3):
        sibling = c.schedule(dataclasses.replace(request(f"a-{n}", blocks=6, prompt=100), follows="a"), 0.0)
        assert (sibling.plan.reused_blocks, sibling.plan.compute_tokens) == (6, 4)  # loaded there or fetched
        assert sibling.plan.local_blocks == 6 if sibling.prefill == first.prefill else sibling.plan.fetch_node == "kv0"
    other = c.schedule(dataclasses.replace(request("x", blocks=6, prompt=100, keys=KEYS[10:]), follows="a"), 0.0)
    assert other.plan.reused_blocks == 0  # not a's prompt
    late = c.schedule(dataclasses.replace(request("a-late", blocks=6, prompt=100), follows="a"), 60.0)
    assert late.plan.reused_blocks == 0  # a's blocks never reached the index: nothing is counted on them


def test_the_conductor_counts_how_often_its_quotes_held():
    """A quote holds when within 25% of what came out (replay.py's figure): the TTFT with the first token, the TBT
    once the request leaves its decode worker; the share of the last ones is what `mooncake status` and
    mooncake_conductor_quote_held_ratio publish."""
    c = conductor("none", ttft_s=100.0)
    cluster(c)
    decisions = [c.schedule(request(f"q{n}", blocks=4, prompt=64), 0.0) for n in range(4)]
    assert all(isinstance(d, Decision) and d.predicted.ttft_s > 0 and d.predicted.tbt_s > 0 for d in decisions)
    assert c.quotes.held("ttft") == (0.0, 0) and c.quotes.held("tbt") == (0.0, 0)
    for n, (d, ttft_factor, tbt_factor) in enumerate(zip(decisions, (1.0, 1.2, 1.5, 0.5), (1.1, 0.9, 2.0, 1.0))):
        c.decode_started(f"q{n}", 1.0, d.predicted.ttft_s * ttft_factor)
        c.finished(f"q{n}", 2.0, measured_tbt_s=d.predicted.tbt_s * tbt_factor)
    # 1.0 and 1.2 held (0.5x is 100% off of what came out, 1.5x is 33% off); TBT: 1.1, 0.9 and 1.0 held
    assert c.quotes.held("ttft") == (0.5, 4) and c.quotes.held("tbt") == (0.75, 4)
    c.finished("q0", 3.0, measured_tbt_s=1.0)  # reported twice: counted once
    assert c.quotes.held("tbt") == (0.75, 4)
