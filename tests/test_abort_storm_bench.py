"""abort_storm's own arithmetic, without a cluster: how it reads Prometheus text, splits the storm into thirds, times
the release of what was held, and judges its goals."""

from __future__ import annotations

import argparse
import asyncio
import random
import time

from benchmarks.abort_storm import (
    GIVE_UP_S,
    HANDOFF_AT,
    PREFILL_AT,
    Watched,
    metric_sums,
    plan_storm,
    summarize,
    watch_release,
)

PROMETHEUS_TEXT = """# HELP mooncake_pool_reserved_blocks slots reserved by uncommitted puts
# TYPE mooncake_pool_reserved_blocks gauge
mooncake_pool_reserved_blocks{node="kv0",tier="dram"} 3.0
mooncake_pool_reserved_blocks{node="kv0",tier="ssd"} 2.0
# HELP mooncake_decode_running_requests requests in the engine (running or waiting)
# TYPE mooncake_decode_running_requests gauge
mooncake_decode_running_requests 4.0
# HELP mooncake_conductor_waiting_requests Requests told to wait at their gateway (early_wait), per priority
# TYPE mooncake_conductor_waiting_requests gauge
"""


def test_a_metric_is_summed_over_its_labels_and_one_without_samples_reads_zero():
    sums = metric_sums(PROMETHEUS_TEXT)
    assert sums["mooncake_pool_reserved_blocks"] == 5.0
    assert sums["mooncake_decode_running_requests"] == 4.0
    assert sums["mooncake_conductor_waiting_requests"] == 0.0
    assert "mooncake_pool_leases" not in sums  # absent: read as None, never as idle


def test_the_storm_is_split_in_thirds_each_hanging_up_at_its_moment():
    args = argparse.Namespace(streams=99, events=4, max_tokens=128, moments=["prefill", "handoff", "decode"])
    prefixes = [[1] * 64 for _ in range(4)]
    streams, bodies = plan_storm(args, random.Random(0), prefixes, 1000, ttft_s=2.0)
    assert len(streams) == len(bodies) == 99
    by_moment = {m: [s for s in streams if s.moment == m] for m in ("prefill", "handoff", "decode")}
    assert all(len(group) == 33 for group in by_moment.values())
    assert all(2.0 * PREFILL_AT[0] <= s.after_s <= 2.0 * PREFILL_AT[1] for s in by_moment["prefill"])
    assert all(2.0 * HANDOFF_AT[0] <= s.after_s <= 2.0 * HANDOFF_AT[1] for s in by_moment["handoff"])
    assert all(s.after_s is None and s.after_events == 4 for s in by_moment["decode"])
    assert all(80 <= s.prompt_tokens <= 192 for s in streams)


class FakeReader:
    """Counts that come back one read after another, as a list of reads says."""

    def __init__(self, watched: list[Watched], reads: list[dict]) -> None:
        self.watched, self._reads = watched, reads

    async def read(self) -> dict:
        return self._reads.pop(0) if len(self._reads) > 1 else self._reads[0]


def test_the_release_is_timed_per_count_and_the_goal_counts_only_the_metrics():
    watched = [
        Watched("kv0 leases", "kv0", "mooncake_pool_leases", "http://kv0/metrics"),
        Watched("decode-0 free landing slots", "decode-0", "mooncake_decode_landing_free_slots", "http://d0/metrics"),
        Watched("conductor's decode-0 placed decoding", "conductor", "placed_decoding", None, "decode-0", False),
    ]
    idle = {"kv0 leases": 0.0, "decode-0 free landing slots": 8.0, "conductor's decode-0 placed decoding": 0.0}
    reads = [
        {"kv0 leases": 3.0, "decode-0 free landing slots": 5.0, "conductor's decode-0 placed decoding": 2.0},
        {"kv0 leases": 0.0, "decode-0 free landing slots": 6.0, "conductor's decode-0 placed decoding": 2.0},
        {"kv0 leases": 0.0, "decode-0 free landing slots": None, "conductor's decode-0 placed decoding": 1.0},
        {"kv0 leases": 0.0, "decode-0 free landing slots": 8.0, "conductor's decode-0 placed decoding": 0.0},
    ]
    rel = asyncio.run(watch_release(FakeReader(watched, reads), idle, since=time.perf_counter()))
    assert len(rel.reads) == 4
    assert rel.back_s["kv0 leases"] <= rel.back_s["decode-0 free landing slots"]
    assert rel.metrics_back_s == rel.back_s["decode-0 free landing slots"] < GIVE_UP_S
    assert rel.view_back_s == rel.back_s["conductor's decode-0 placed decoding"]
    assert [v for _, v in rel.changes["decode-0 free landing slots"]] == [5.0, 6.0, None, 8.0]


def test_the_goals_pass_only_with_everything_back_in_a_second_and_the_ttft_within_20_percent():
    def report(back_s, after_ttft):
        return {
            "undisturbed": [{"ttft_s": t, "error": ""} for t in (0.10, 0.10, 0.12)],
            "after": [{"ttft_s": after_ttft, "error": ""}],
            "release": {"metrics_back_s": back_s, "view_back_s": 0.5, "back_s": {"x": back_s}, "last": {"x": 0.0}},
        }

    _, goals = summarize(report(0.4, 0.115))
    assert [g["pass"] for g in goals] == [True, True]
    summary, goals = summarize(report(None, 0.13))
    assert [g["pass"] for g in goals] == [False, False]
    assert summary["still_held"] == {"x": 0.0}
