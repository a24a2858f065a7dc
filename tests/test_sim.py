"""The cluster simulator (benchmarks/sim/) on slices of the Mooncake trace, driving the real Conductor.

Exact checks on one request (its TTFT and decode times are the cost models' sums), the
Conductor's index against the simulated caches after evictions, and on a loaded slice
the orderings the paper reports that hold robustly here.
"""

from __future__ import annotations

import json
import math

import pytest

from benchmarks.sim import cli as sim
from benchmarks.sim.model import block_key, load_trace
from conductor.admission import AdmissionKind
from conductor.forecast import ForecastKind
from conductor.local import LocalPrefill
from conductor.planner.costs import ModelConfig, model_config
from conductor.planner.nodecache import NodeCache
from conductor.planner.state import SimConfig, TraceRequest
from conductor.planner.twin import Cluster
from conductor.policies import PolicyKind
from conductor.types import KeyChain
from kvstore.events import Tier

TRACE = sim.DEFAULT_TRACE
SLICE = 1500
SPEED = 0.5  # 4 prefill instances at half speed: as loaded per instance as the reproduction's 8 at 1x

pytestmark = pytest.mark.skipif(not TRACE.exists(), reason=f"trace not found at {TRACE}")


@pytest.fixture(scope="module")
def requests():
    return load_trace(TRACE, SPEED, SLICE)


def run(requests, **kw) -> dict:
    kw.setdefault("prefill", 4)
    kw.setdefault("decode", 4)
    kw.setdefault("model", ModelConfig(noise=0.05))
    return sim.simulate(SimConfig(**kw), requests=requests)


def reuse_bound(reqs: list[TraceRequest]) -> float:
    """The hit ratio of one unbounded cache seeing every prompt in order: leading blocks seen before / all blocks."""
    seen: set[bytes] = set()
    hit = total = 0
    for r in reqs:
        n = 0
        while n < len(r.keys) and r.keys[n] in seen:
            n += 1
        hit, total = hit + n, total + len(r.keys)
        seen.update(r.keys)
    return hit / total


def one_request(prompt: int, output: int, ids: list[int]) -> TraceRequest:
    keys = [block_key(h) for h in ids[: prompt // 512]]
    return TraceRequest(0, 0.0, prompt, output, keys, KeyChain(b"".join(keys)))


# -- exact: one request at a time ---------------------------------------------------------------


def test_lone_request_times_are_the_cost_models():
    m = ModelConfig()  # no noise
    req = one_request(6000, 5, list(range(12)))
    s = sim.simulate(SimConfig(prefill=2, decode=1, model=m), requests=[req])
    rec = s["_records"][0]
    step1 = m.decode_step_s(1, 6000)
    push = m.transfer_s(6000 * m.kv_bytes_per_token * m.decode_push_fraction)
    assert rec.compute_s == pytest.approx(m.prefill_s(6000, 0))
    assert rec.ttft_s == pytest.approx(m.prefill_s(6000, 0) + push + step1)
    # five tokens: the first at the end of step 1, the rest one step each, context growing by one a step
    decode = sum(m.decode_step_s(1, 6000 + i) for i in range(5))
    assert rec.finish - rec.req.arrival_s == pytest.approx(m.prefill_s(6000, 0) + push + decode)
    gaps = [m.decode_step_s(1, 6000 + i) for i in range(1, 5)]
    assert rec.tbt_s == pytest.approx(max(gaps))  # top 10% of 4 gaps: the longest one
    assert s["served"] == 1 and s["rejected"] == 0 and s["hit_ratio"] == 0.0


def test_second_request_reuses_the_shared_prefix_and_says_so():
    m = ModelConfig()
    first = one_request(6000, 1, list(range(12)))
    second = one_request(8000, 1, list(range(10)) + [100, 101, 102, 103, 104])  # shares 10 blocks
    second.index, second.arrival_s = 1, 100.0  # long after the first finished
    s = sim.simulate(SimConfig(prefill=2, decode=1, model=m), requests=[first, second])
    r2 = s["_records"][1]
    assert r2.local_blocks + r2.fetched_blocks == 10
    assert r2.cached_tokens == 10 * 512
    assert r2.compute_s == pytest.approx(m.prefill_s(8000, 5120))
    assert s["hit_ratio"] == pytest.approx(10 / (11 + 15))


def test_decode_batch_slows_every_member():
    """Two requests decoding together: each step costs the batch of two, so both are slower than alone."""
    m = ModelConfig()
    a = one_request(4096, 200, list(range(8)))
    b = one_request(4096, 200, list(range(50, 58)))
    b.index = 1
    alone = sim.simulate(SimConfig(prefill=2, decode=1, model=m), requests=[a])["_records"][0]
    both = sim.simulate(SimConfig(prefill=2, decode=1, model=m), requests=[a, b])["_records"]
    assert all(r.tbt_s > alone.tbt_s for r in both)
    assert both[0].tbt_s == pytest.approx(m.decode_step_s(2, 2 * 4096 + 2 * 199), rel=1e-3)


def test_a_request_joins_a_running_batch_at_the_next_step_boundary():
    m = ModelConfig()
    a = one_request(4096, 400, list(range(8)))
    b = one_request(2048, 3, list(range(50, 54)))
    b.index, b.arrival_s = 1, 1.0
    recs = sim.simulate(SimConfig(prefill=2, decode=1, model=m), requests=[a, b])["_records"]

    def push(prompt):
        return m.transfer_s(prompt * m.kv_bytes_per_token * m.decode_push_fraction)

    t = m.prefill_s(4096, 0) + push(4096)  # a starts decoding alone
    b_ready = 1.0 + m.prefill_s(2048, 0) + push(2048)
    k = 0
    while t < b_ready:  # a's steps until the first boundary at or after b is ready
        t += m.decode_step_s(1, 4096 + k)
        k += 1
    assert 0 < k < 400
    assert recs[1].first_token == pytest.approx(t + m.decode_step_s(2, 4096 + k + 2048))
    assert recs[0].tbt_s > m.decode_step_s(1, 4096 + 399)  # b's steps were a's longest gaps


# -- the Conductor's index stays exact ------------------------------------------------------------


@pytest.mark.parametrize("eviction", ["lru", "lfu", "length"])
def test_index_matches_the_caches_after_evictions(requests, eviction):
    cl = Cluster(SimConfig(prefill=4, decode=2, cache_blocks=60, ssd_blocks=150, eviction=eviction), requests[:400])
    cl.run()
    for node, cache in cl.caches.items():
        assert len(cache.dram) <= 60 and len(cache.ssd) <= 150
        assert cache.evictions > 0
        held = cl.conductor.index.holders
        sample = list(cache.dram)[:50] + list(cache.ssd)[:50]
        for key in sample:
            want = Tier.DRAM if key in cache.dram else Tier.SSD
            assert held(key).get(node) is want
        assert cl.conductor.index.node_blocks(node) == len(cache.dram | cache.ssd)


def test_node_cache_evicts_by_policy_and_reports_it():
    events = []
    cache = NodeCache("n", 10, 0, "lru", lambda node, ev: events.extend(ev))
    keys = [block_key(i) for i in range(10)]
    cache.put(keys)  # 10 > 0.95 * 10: back to 8, evicting the least recently inserted (the chain's head)
    assert len(cache.dram) == 8
    assert [k for stored, k, _, _ in events if not stored] == keys[:2]
    assert [p for stored, _, _, p in events if stored][:3] == [
        b"",
        keys[0],
        keys[1],
    ]  # each block's parent in its chain
    cache.read(keys[2:4])
    cache.put([block_key(i) for i in range(100, 103)])  # 11 blocks: back to 8
    assert keys[2] in cache.dram and keys[3] in cache.dram  # just used
    assert keys[4] not in cache.dram


# -- a loaded slice: what the paper reports, where it is robust -------------------------------------


@pytest.fixture(scope="module")
def placements(requests):
    return {
        p: run(requests, policy=PolicyKind(p))
        for p in ("random", "least_loaded", "cache_aware_local", "kvcache_centric")
    }


def test_cache_aware_placement_beats_random(placements):
    ttft = {p: s["ttft_mean_s"] for p, s in placements.items()}
    assert ttft["cache_aware_local"] < 0.5 * ttft["random"]
    assert ttft["kvcache_centric"] < 0.5 * ttft["random"]
    assert ttft["kvcache_centric"] < ttft["least_loaded"]
    assert ttft["kvcache_centric"] <= ttft["cache_aware_local"]


def test_global_cache_reaches_the_reuse_bound(placements, requests):
    bound = reuse_bound(requests)
    kc, local = placements["kvcache_centric"]["hit_ratio"], placements["cache_aware_local"]["hit_ratio"]
    assert kc <= bound + 1e-9
    assert kc >= 0.95 * bound  # it can fetch any prefix held anywhere
    assert local < kc  # only its own node's
    assert (
        placements["kvcache_centric"]["fetched_blocks"] > 0 and placements["cache_aware_local"]["fetched_blocks"] == 0
    )


def test_admission_none_serves_everything(placements):
    for s in placements.values():
        assert s["rejected"] == 0 and s["served"] == SLICE
        assert all(not math.isnan(r.tbt_s) and r.first_token >= r.prefill_end for r in s["_records"])


def test_unbounded_cache_hits_more_than_a_small_one(requests):
    small = run(requests, cache_blocks=40)
    big = run(requests)
    assert small["evictions"] > 0 and big["evictions"] == 0
    assert big["hit_ratio"] > small["hit_ratio"] + 0.05


@pytest.fixture(scope="module")
def decode_bound(requests):
    """2 prefill + 2 decode instances at half speed (the reproduction's 8 + 8 at 2x, per instance), the slow
    decode profile and a 60 ms TBT SLO: both pools loaded, decode the tighter (benchmarks/sim/paper.py, 2b)."""

    return decode_bound_run(requests, seed=0)


def decode_bound_run(requests, seed: int) -> dict[str, dict]:
    def one(admission: str, forecast: str = "uniform") -> dict:
        return run(
            requests,
            prefill=2,
            decode=2,
            tbt_slo_s=0.06,
            admission=AdmissionKind(admission),
            decode_forecast=ForecastKind(forecast),
            model=model_config("slow", noise=0.05),
            seed=seed,
        )

    out = {a: one(a) for a in ("baseline", "early", "early_predictive")}
    out["survival"] = one("early_predictive", "survival")
    return out


@pytest.fixture(scope="module")
def decode_bound_seeds(requests, decode_bound):
    """decode_bound's runs with three seeds of the noise (0, 1, 2): per admission, the sums of requests rejected and
    served within both SLOs. One seed's counts move by chance alone: a constant 0.2% on every predicted decode step
    moved seed 0's served-within-SLOs by up to 4%, more than what set the admissions apart there."""
    runs = [decode_bound, decode_bound_run(requests, 1), decode_bound_run(requests, 2)]
    return {a: {k: sum(r[a][k] for r in runs) for k in ("rejected", "slo_ok")} for a in decode_bound}


def test_only_the_baseline_wastes_prefill_on_requests_it_then_rejects(decode_bound):
    base = decode_bound["baseline"]
    assert base["rejected_after_prefill"] > 0 and base["wasted_prefill_s"] > 0
    assert set(base["rejected_by_reason"]) <= {"ttft_slo", "decode_after_prefill"}
    for a in ("early", "early_predictive", "survival"):
        s = decode_bound[a]
        assert s["rejected_after_prefill"] == 0 and s["wasted_prefill_s"] == 0
        assert (
            s["rejected_by_reason"].get("tbt_slo", 0) + s["rejected_by_reason"].get("overload", 0) > 0
        )  # decode load, up front
    for s in decode_bound.values():
        assert s["served"] + s["rejected"] == SLICE


def test_prediction_rejects_fewer_than_current_load_and_survival_fewer_still(decode_bound_seeds):
    """Over three seeds (2026-12-02: rejected 888 / 1,099 / 952 / 827 and within both SLOs 3,562 / 3,352 / 3,421 /
    3,589 for the baseline, early, early_predictive, survival)."""
    rej = {a: s["rejected"] for a, s in decode_bound_seeds.items()}
    ok = {a: s["slo_ok"] for a, s in decode_bound_seeds.items()}
    assert rej["early_predictive"] < rej["early"]  # the paper's point: current load turns away what would fit by then
    assert rej["survival"] < rej["early_predictive"] and rej["survival"] < rej["baseline"]
    # and serves more within both SLOs than the early kinds, and about as many as the baseline (which prefills what it
    # then rejects: test_only_the_baseline_wastes_prefill_on_requests_it_then_rejects)
    assert ok["survival"] > max(ok["early"], ok["early_predictive"]) and ok["survival"] >= 0.98 * ok["baseline"]


def test_the_closed_loop_keeps_what_it_admits_within_the_slos_where_the_forecast_is_wrong(requests):
    """The slow decode profile at twice the trace's speed and a 40 ms TBT SLO: requests that waited minutes for a place
    once fell out of the decode forecast, and the forecast alone admitted into the backlog (4% of those served met
    both SLOs). Kept until their worker reports them (the forecast) and counted full while more than half a batch
    waits there (the decode heartbeat's measured backlog, conductor/judge.py), 95% and more do, and more requests are
    served within both SLOs than the baseline's check at the decode side serves."""
    trace = load_trace(TRACE, 2.0, 3000)
    kw = dict(prefill=8, decode=8, tbt_slo_s=0.04, model=model_config("slow", noise=0.05))
    closed = run(trace, admission=AdmissionKind.EARLY_PREDICTIVE, **kw)
    baseline = run(trace, admission=AdmissionKind.BASELINE, **kw)
    assert closed["slo_attainment_served"] >= 0.9
    assert closed["slo_ok"] > baseline["slo_ok"]


def test_a_decode_instance_keeps_its_step_under_the_tbt_cap_and_makes_the_rest_wait(requests):
    # exact costs, admission none: everything is sent on, and the decode side alone protects the TBT SLO
    s = run(requests[:600], prefill=2, decode=1, tbt_slo_s=0.06, model=model_config("slow"))
    done = [r for r in s["_records"] if not math.isnan(r.finish)]
    assert len(done) == 600
    assert max(r.tbt_s for r in done) <= 0.06  # 0.9 x 60 ms at join, plus the context a run adds
    waited = [r for r in done if r.first_token - r.prefill_end > 2 * 0.06]
    assert waited  # what did not fit waited for room


# -- the command line -------------------------------------------------------------------------------


def test_command_line_writes_json(tmp_path):
    path = tmp_path / "run.json"
    assert (
        sim.main(
            [
                "--limit",
                "200",
                "--speed",
                "4",
                "--prefill",
                "2",
                "--decode",
                "2",
                "--admission",
                "baseline",
                "--no-progress",
                "--json",
                str(path),
            ]
        )
        == 0
    )
    out = json.loads(path.read_text())
    assert out["command"][:5] == ["python", "-m", "benchmarks.sim", "--limit", "200"]
    assert out["summary"]["requests"] == 200
    assert len(out["records"]["arrival_s"]) == 200
    assert out["config"]["admission"] == "baseline" and out["config"]["model"]["block_bytes"] == 512 * 320 * 1024


def test_help_explains_every_option(capsys):
    with pytest.raises(SystemExit) as e:
        sim.main(["--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    for flag in (
        "--trace",
        "--prefill",
        "--decode",
        "--policy",
        "--admission",
        "--speed",
        "--cache-blocks",
        "--eviction",
        "--json",
        "--plot",
        "--limit",
        "--ttft-slo",
        "--tbt-slo",
        "--threshold",
        "--tier-aware",
        "--seed",
        "--no-progress",
        "--reproduce",
    ):
        assert flag in text


def test_a_pipeline_groups_prefill_is_its_chunks_split_over_the_stages_plus_the_fill():
    """Chunk j costs each of X stages 1/X of its prefill; the last stage finishes X - 1 chunk-and-hop after the
    first."""
    m = ModelConfig()
    assert m.pipelined_prefill_s(10_000, 2_000, 1, 2048) == m.prefill_s(10_000, 2_000)
    chunks = [(a, 2048) for a in range(2_048, 10_240, 2048)]  # 4 whole chunks after 2,048 cached tokens
    work = [(m.prefill_s_per_token * n + m.prefill_s_per_token_pair * n * (a + n / 2)) / 2 for a, n in chunks]
    hop = m.transfer_s(2048 * m.hidden * 2)
    expected = (
        m.prefill_overhead_s + sum(work) + (work[-1] + hop)
    )  # chunk work only grows: the drain is the last chunk's
    assert m.pipelined_prefill_s(10_240, 2_048, 2, 2048) == pytest.approx(expected)
    # a long prompt gains nearly X; one that fits in a chunk gains nothing and pays the hop
    assert m.prefill_s(85_000, 0) / m.pipelined_prefill_s(85_000, 0, 2, 2048) > 1.9
    assert m.pipelined_prefill_s(1_000, 0, 2, 2048) > m.prefill_s(1_000, 0)


def test_four_groups_of_two_serve_the_trace_slice_with_every_request_prefilled_once(requests):
    singles = run(requests, prefill=4)
    groups = run(requests, prefill=4, group_size=2)
    assert groups["requests"] == singles["requests"] == groups["served"] == singles["served"]
    # the prompts' prefill time (instance-seconds): a group of two computes long prompts in about half
    assert groups["prefill_compute_s"] < 0.75 * singles["prefill_compute_s"]


def test_prompts_placed_on_decode_instances_are_computed_there_and_served(requests):
    """conductor.local in the simulator: ``always`` computes every prompt on a decode instance (the prefill instances
    stay idle), ``auto`` some of them, ``never`` none; each serves every request it admits."""
    out = {
        m: run(
            requests[:400], prefill=2, decode=2, admission=AdmissionKind.EARLY_PREDICTIVE, local_prefill=LocalPrefill(m)
        )
        for m in ("never", "always", "auto")
    }
    assert out["never"]["local_prefills"] == 0 and out["never"]["prefill_utilization"] > 0
    always = out["always"]
    assert always["local_prefills"] == 400 - always["rejected"] and always["prefill_utilization"] == 0
    assert 0 < out["auto"]["local_prefills"] < 400 - out["auto"]["rejected"]
    for s in out.values():
        assert s["served"] + s["rejected"] == 400
        assert s["hit_ratio"] > 0  # prefixes reused whichever kind of instance computes the prompt
