"""The trace replay benchmark (benchmarks/replay.py): prompts from hash ids, scaling, the SLO metrics, and one real
replay.

Everything but the last test runs without a server. The last starts the coupled gateway
(``python -m mooncake.gateway --local``) on the tiny model and replays five requests of
the Mooncake trace through the command line, JSON included.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import replay as rp
from benchmarks import trace as tr
from mooncake.cluster.launcher import Component

REPO = Path(__file__).resolve().parent.parent

B = 16  # tokens a hash id in these tests


def write_trace(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def record(ts: int, hash_ids: list[int], input_length: int | None = None, output_length: int = 512) -> dict:
    return {
        "timestamp": ts,
        "input_length": input_length or 512 * len(hash_ids),
        "output_length": output_length,
        "hash_ids": hash_ids,
    }


# -- prompts ------------------------------------------------------------------------------------------------


def test_shared_leading_hash_ids_give_a_shared_prefix_and_nothing_more(tmp_path):
    trace = write_trace(
        tmp_path / "t.jsonl", [record(0, [0, 5, 7, 8]), record(0, [0, 5, 9, 10]), record(0, [3, 5, 7, 8])]
    )
    a, b, c = (q.prompt() for q in tr.load_trace(trace, B, max_input=10_000))
    assert len(a) == len(b) == len(c) == 4 * B
    assert a[: 2 * B] == b[: 2 * B]  # ids 0, 5 shared
    assert a[2 * B : 3 * B] != b[2 * B : 3 * B]  # 7 against 9: the prompts part there
    assert a[:B] != c[:B]  # a different first id, a different first block
    # an id always stands for the same tokens, wherever it sits
    assert a[B : 2 * B] == c[B : 2 * B] == list(tr.block_token_ids(5, B, tr.SMOLLM2_VOCAB))


def test_prompts_are_deterministic_across_processes_and_in_the_vocabulary(tmp_path):
    ids = tr.block_token_ids(123, B, 500)
    assert ids == tr.block_token_ids(123, B, 500) and len(ids) == B
    assert all(tr.MIN_TOKEN_ID <= t < 500 for t in ids)
    code = f"from benchmarks import trace; print(list(trace.block_token_ids(123, {B}, 500)))"
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
        env=os.environ | {"PYTHONHASHSEED": "12345"},
    )
    assert json.loads(out.stdout) == list(ids)
    # a salt (a sweep's later rates) gives other tokens for the same id, the same each time
    assert tr.block_token_ids(123, B, 500, salt=1) != ids
    assert tr.block_token_ids(123, B, 500, salt=1) == tr.block_token_ids(123, B, 500, salt=1)


def test_lengths_scale_by_block_tokens_over_512_and_are_clamped(tmp_path):
    trace = write_trace(
        tmp_path / "t.jsonl",
        [
            record(
                0, list(range(14)), input_length=6758, output_length=500
            ),  # 6758 * 16/512 = 211.2 -> 211; 500/16 = 31.25 -> 31
            record(
                0, list(range(100, 300)), input_length=100_000, output_length=2000
            ),  # 3125 -> max_input; 125 -> max_output
            record(0, [7], input_length=3, output_length=3),  # 0.09 -> at least 1 token; 0.19 -> at least 1
        ],
    )
    a, b, c = tr.load_trace(trace, B, output_scale=1 / 16, max_input=1024, max_output=32)
    assert (a.prompt_tokens, a.max_tokens, len(a.prompt())) == (211, 31, 211)
    assert (b.prompt_tokens, b.max_tokens, len(b.prompt())) == (1024, 32, 1024)
    assert (c.prompt_tokens, c.max_tokens, len(c.prompt())) == (1, 1, 1)
    assert a.prompt() == tr.build_prompt(list(range(14)), 211, B, tr.SMOLLM2_VOCAB)  # the leading tokens are kept
    # a record claiming more tokens than its blocks hold gets what the blocks hold
    (d,) = tr.load_trace(write_trace(tmp_path / "u.jsonl", [record(0, [1, 2], input_length=4096)]), B)
    assert d.prompt_tokens == 2 * B


def test_arrivals_are_spread_within_a_timestamp_step_and_the_limit_keeps_the_step(tmp_path):
    trace = write_trace(
        tmp_path / "t.jsonl", [record(0, [0]), record(0, [1]), record(0, [2]), record(3000, [3]), record(6000, [4])]
    )
    assert [q.arrival_s for q in tr.load_trace(trace, B)] == [0.0, 1.0, 2.0, 3.0, 6.0]
    assert [q.arrival_s for q in tr.load_trace(trace, B, spread=False)] == [0.0, 0.0, 0.0, 3.0, 6.0]
    # cut inside the first step: its three requests still share its 3 s
    assert [q.arrival_s for q in tr.load_trace(trace, B, limit=2)] == [0.0, 1.0]


def test_the_real_trace_loads_with_its_shared_system_prompt():
    if not tr.DEFAULT_TRACE.exists():
        pytest.skip(f"no trace at {tr.DEFAULT_TRACE}")
    reqs = tr.load_trace(tr.DEFAULT_TRACE, B, limit=50)
    assert len(reqs) == 50 and all(q.hash_ids[0] == 0 for q in reqs)
    first = {tuple(q.prompt()[:B]) for q in reqs}
    assert len(first) == 1  # block 0, the shared system prompt, starts every prompt
    assert all(
        1 <= q.prompt_tokens <= tr.DEFAULTS["max_input"] and 1 <= q.max_tokens <= tr.DEFAULTS["max_output"]
        for q in reqs
    )


# -- metrics --------------------------------------------------------------------------------------------------


def test_tbt_is_the_mean_of_the_longest_tenth_of_the_gaps():
    assert rp.tail_tbt([float(g) for g in range(1, 21)]) == pytest.approx(19.5)  # 20 gaps: the longest 2, 20 and 19
    assert rp.tail_tbt([0.1, 0.5, 0.2]) == pytest.approx(0.5)  # 3 gaps: ceil(0.3) = 1
    assert rp.tail_tbt([0.1] * 10 + [1.0]) == pytest.approx((1.0 + 0.1) / 2)  # 11 gaps: ceil(1.1) = 2
    assert rp.tail_tbt([]) == 0.0


def result(
    index: int, outcome=rp.Outcome.OK, ttft=1.0, tbt=0.1, prompt=100, cached: int | None = 20
) -> rp.RequestResult:
    r = rp.RequestResult(index, 0.0, 0.0, prompt, 8, outcome)
    if outcome is rp.Outcome.OK:
        r.ttft_s, r.tbt_s, r.completion_tokens, r.cached_tokens = ttft, tbt, 8, cached
    return r


def test_effective_needs_both_slos_and_completion():
    slo = dict(ttft_slo_s=2.0, tbt_slo_s=0.2)
    rs = [
        result(0),
        result(1, ttft=3.0),
        result(2, tbt=0.3),
        result(3, rp.Outcome.REJECTED),
        result(4, rp.Outcome.ERROR),
        result(5, ttft=2.0, tbt=0.2),
    ]
    assert [rp.is_effective(r, **slo) for r in rs] == [True, False, False, False, False, True]
    s = rp.summarize(rs, span_s=10.0, wall_s=12.0, **slo)
    assert (s["requests"], s["completed"], s["rejected"], s["errors"], s["effective"]) == (6, 4, 1, 1, 2)
    assert s["slo_attainment"] == pytest.approx(2 / 6)
    assert s["cache_hit_ratio"] == pytest.approx(80 / 400)
    assert s["offered_rate_rps"] == pytest.approx(0.6)
    # a server that never reports cached tokens: no ratio, not 0%
    assert rp.summarize([result(0, cached=None)], span_s=1.0, wall_s=1.0, **slo)["cache_hit_ratio"] is None


def test_ttft_predictions_are_compared_with_the_measured_ttfts_where_the_server_gave_them():
    rs = [result(i, ttft=1.0) for i in range(5)] + [result(5, rp.Outcome.REJECTED)]
    for r, predicted in zip(rs, (1.0, 1.2, 0.8, 0.5, 2.0)):  # exact, +20%, -20%, -50%, +100%
        r.predicted_ttft_s = predicted
    rs.append(result(6, ttft=2.0))  # no prediction (a server without the header): not counted
    s = rp.summarize(rs, ttft_slo_s=10.0, tbt_slo_s=1.0, span_s=1.0, wall_s=1.0)
    assert s["predicted_requests"] == 5 and s["prediction_within_share"] == pytest.approx(3 / 5)
    assert s["prediction_error_p50"] == pytest.approx(0.0)
    assert s["prediction_error_p10"] < -0.2 and s["prediction_error_p90"] > 0.2
    assert "within 25% for 60.0% of 5" in rp.describe_predictions(s)
    assert rp.summarize([result(0)], ttft_slo_s=10.0, tbt_slo_s=1.0, span_s=1.0, wall_s=1.0)["predicted_requests"] == 0


def test_finish_counts_tokens_from_usage_and_reads_a_missing_cached_count_as_unknown():
    r = rp.RequestResult(0, 0.0, 0.0, 100, 5)
    rp._finish(
        r, [0.5, 0.6, 0.8], {"completion_tokens": 5, "prompt_tokens": 100}, 1.0
    )  # two tokens had no text: no event
    assert r.outcome is rp.Outcome.OK and r.ttft_s == 0.5 and r.completion_tokens == 5 and r.cached_tokens is None
    assert r.tbt_mean_s == pytest.approx(0.3 / 4)
    assert r.tbt_s == pytest.approx(0.2)
    r2 = rp.RequestResult(1, 0.0, 0.0, 100, 5)
    rp._finish(r2, [0.5], {"completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": 64}}, 0.5)
    assert (r2.cached_tokens, r2.tbt_s, r2.tbt_mean_s) == (64, 0.0, 0.0)


def point(factor: float, share: float) -> dict:
    return {"rate_factor": factor, "summary": {"slo_attainment": share, "offered_rate_rps": 0.7 * factor}}


def test_effective_capacity_is_the_highest_rate_before_the_first_miss():
    cap = rp.effective_capacity([point(2, 0.85), point(0.5, 0.99), point(4, 0.95), point(1, 0.9)], target=0.9)
    assert (cap["rate_factor"], cap["rate_rps"], cap["saturated"]) == (
        1,
        pytest.approx(0.7),
        False,
    )  # x4 after a miss does not count
    cap = rp.effective_capacity([point(1, 0.95), point(2, 0.91)], target=0.9)
    assert (cap["rate_factor"], cap["saturated"]) == (2, True)
    cap = rp.effective_capacity([point(1, 0.5), point(2, 0.4)], target=0.9)
    assert (cap["rate_factor"], cap["rate_rps"], cap["saturated"]) == (None, None, False)


# -- a real replay ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_gateway(tmp_path_factory):
    from mooncake.engine.tiny import make_tiny

    work = tmp_path_factory.mktemp("replay")
    model = make_tiny(work / "tiny", "llama")
    argv = [
        sys.executable,
        "-m",
        "mooncake.gateway",
        "--local",
        "--model",
        str(model),
        "--model-name",
        "tiny",
        "--port",
        "0",
        "--max-model-len",
        "1024",
        "--threads",
        "1",
        "--log-level",
        "WARNING",
    ]
    gateway = Component("gateway", argv, work / "gateway.log")
    gateway.start()
    try:
        yield gateway.wait_ready(150.0)["http"], model  # minutes only on a loaded machine
    finally:
        gateway.terminate()
        try:
            gateway.proc.wait(15)
        except subprocess.TimeoutExpired:
            pass
        gateway.kill()


@pytest.mark.timeout(240)
def test_replaying_five_trace_requests_against_the_coupled_gateway(tiny_gateway, tmp_path):
    if not tr.DEFAULT_TRACE.exists():
        pytest.skip(f"no trace at {tr.DEFAULT_TRACE}")
    url, model = tiny_gateway
    out = tmp_path / "replay.json"
    code = rp.main(
        [
            "--url",
            url,
            "--model",
            "tiny",
            "--model-dir",
            str(model),
            "--limit",
            "5",
            "--speed",
            "4",
            "--max-input",
            "512",
            "--json",
            str(out),
            "--no-progress",
        ]
    )
    assert code == 0
    data = json.loads(out.read_text())
    (run,) = data["runs"]
    assert len(run["requests"]) == 5 and run["summary"]["completed"] == 5
    expected = tr.load_trace(tr.DEFAULT_TRACE, 16, max_input=512, limit=5, vocab_size=tr.vocab_size_of(model))
    for r, q in zip(run["requests"], expected):
        assert r["outcome"] == "ok" and r["ttft_s"] > 0
        assert r["completion_tokens"] == q.max_tokens  # ignore_eos: exactly the scaled output length
        assert r["prompt_tokens"] == q.prompt_tokens
        assert r["scheduled_s"] == pytest.approx(q.arrival_s / 4)  # time compressed by --speed
    assert run["summary"]["cache_hit_ratio"] is not None  # our gateway reports cached tokens
    assert run["summary"]["predicted_requests"] == 0  # one engine, no Conductor: no TTFT predictions
    assert data["scaling"]["block_tokens"] == 16 and "speed 4" in data["scaling"]["description"]
    assert data["command"]
