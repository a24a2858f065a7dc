"""The planner acting on a real cluster: `mooncake up --planner act` under a 1x -> 3x -> 1x replay.

A random-weight model big enough that a 900-token prompt takes about half a second here. The rate is set from a
prefill measured on the cluster before the replay (the prefill worker's engine time, alone): at 1x a prefill worker
is busy ``BUSY_1X`` of the time, and 3x that is more than one worker can take: the prompts queue
for prefill, each holding 56 of its decode worker's 2,048 cache blocks (36 prompts' worth)
while it waits. The Conductor places a prompt only where its blocks fit, holds it at its gateway while no decode
worker has room (the planner acts), and the planner sizes decode by the KV the waiting prompts hold. The
replay is benchmarks.replay's command line with ``--rate-profile step:1,3,1``. While it runs, the Conductor's
plans and pools are read every half second. What a user would see:

- the planner plans one prefill worker before the step up and asks for a second within two of its intervals of it
  (the launcher starts it; it takes work),
- after the step down it drains one and the pool is back to one (the drained worker finished what it had and
  exited), and
- no request failed, from first to last: every one completed with all its tokens;
- `mooncake plan` prints the reasoning; the Conductor's /metrics has the desired counts.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import httpx
from clusters import conductor, start_cluster

from benchmarks.planner_live import MODEL_SHAPE, OUTPUT_TOKENS, PROMPT_TOKENS, replay_command, write_steady_trace
from mooncake.engine.tiny import make_tiny
from protos import conductor_pb2 as cpb

INTERVAL_S = 4.0
STEP_S = 30.0  # each level of the profile lasts this long
BUSY_1X = 0.4  # at 1x, a prefill worker's busy share by its engine time alone: 1.2 at 3x, more than one worker can take


def measured_prefill_s(cluster) -> float:
    """A prompt's prefill on the prefill worker with nothing else running (its engine time: first step to first
    token, ``mooncake_prefill_seconds``): the mean of three 900-token prompts with nothing in common, as the trace's,
    sent one at a time."""
    with httpx.Client(base_url=cluster.endpoint + "/", timeout=60) as client:
        for i in range(3):
            prompt = [10 + (i * 7919 + j * 31) % 200 for j in range(PROMPT_TOKENS)]
            r = client.post("completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 1})
            assert r.status_code == 200, r.text
    metrics = httpx.get(f"http://{cluster.component('prefill-0').info['metrics']}/metrics", timeout=5).text
    sums = dict(
        line.split()
        for line in metrics.splitlines()
        if line.startswith(("mooncake_prefill_seconds_sum", "mooncake_prefill_seconds_count"))
    )
    assert float(sums["mooncake_prefill_seconds_count"]) == 3, sums
    return float(sums["mooncake_prefill_seconds_sum"]) / 3


class Watch:
    """(seconds since start, the planner's prefill count, alive prefill workers, draining ones) every half second."""

    def __init__(self, cluster) -> None:
        self.rows: list[tuple[float, int, int, int]] = []
        self.new_served = 0  # requests the Conductor placed on a prefill worker the planner started
        self._stop = threading.Event()
        self._stub = conductor(cluster)
        self.t0 = time.monotonic()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                listing = self._stub.ListInstances(cpb.ListInstancesRequest(role=cpb.PREFILL), timeout=5)
                alive = sum(i.state == cpb.ALIVE for i in listing.instances)
                draining = sum(i.state == cpb.DRAINING for i in listing.instances)
                self.rows.append((time.monotonic() - self.t0, listing.plan.prefill, alive, draining))
                started = [i.decisions for i in listing.instances if i.id != "prefill-0"]
                self.new_served = max([self.new_served, *started])
            except Exception:  # a slow answer on a busy machine: the next one counts
                pass
            self._stop.wait(0.5)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)

    def first(self, cond, after: float = 0.0) -> float | None:
        return next((t for t, *row in self.rows if t >= after and cond(*row)), None)


def test_the_planner_scales_prefill_up_for_a_load_step_and_back_down_without_failing_a_request(tmp_path):
    model = make_tiny(tmp_path / "model", "llama", **MODEL_SHAPE)
    c = start_cluster(
        model,
        tmp_path / "run",
        prefill=1,
        decode=1,
        planner="act",
        planner_interval_s=INTERVAL_S,
        planner_max=2,
        admission="none",
    )
    try:
        prefill_s = measured_prefill_s(c)
    except BaseException:
        c.stop()
        raise
    rate = BUSY_1X / prefill_s
    print(f"a prefill alone: {prefill_s:.3f} s; {rate:.2f} requests a second at 1x")
    trace = tmp_path / "steady.jsonl"
    # the step:1,3,1 profile presses the trace into equal spans at 1x, 3x and 1x: it holds 1 x 30 + 3 x 30 + 1 x 30
    # seconds' worth of arrivals at 1x
    n = write_steady_trace(trace, rate, 5 * STEP_S)
    watch = Watch(c)
    try:
        out = tmp_path / "replay.json"
        started = time.monotonic() - watch.t0
        replay = subprocess.Popen(
            replay_command(trace, c.endpoint, model, n, out),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        time.sleep(STEP_S + 3 * INTERVAL_S)  # in the step up: what `mooncake plan` says there
        plan_out = subprocess.run(
            [sys.executable, "-m", "mooncake.cli.main", "plan", "--conductor", c.conductor_address],
            capture_output=True,
            text=True,
            timeout=60,
        )
        _, stderr = replay.communicate(timeout=600)
        assert replay.returncode == 0, stderr[-2000:]
        step_up, step_down = started + STEP_S, started + 2 * STEP_S
        # after the step down: the drain (2 plans below and 3 intervals of cool-down), and the drained one's exit
        deadline = time.monotonic() + 12 * INTERVAL_S
        while time.monotonic() < deadline and not watch.first(lambda p, a, d: a == 1 and d == 0, after=step_down + 1):
            time.sleep(0.5)
        metrics = httpx.get(f"http://{c.component('conductor').info['metrics']}/metrics", timeout=5).text
    finally:
        watch.stop()
        c.stop()
    (run,) = json.loads(out.read_text())["runs"]
    failed = [q for q in run["requests"] if q["outcome"] != "ok" or q["completion_tokens"] != OUTPUT_TOKENS]
    assert not failed, [(q["index"], q["outcome"], q["http_status"], q["error"]) for q in failed[:5]]
    assert len(run["requests"]) == n
    print(f"step up at {step_up:.1f} s, down at {step_down:.1f} s; (t, planned, alive, draining):")
    print([row for i, row in enumerate(watch.rows) if i == 0 or row[1:] != watch.rows[i - 1][1:]])

    # one worker until the step (the planner neither doubled the pool while it came up nor sized 1x at two)
    # (rows before its first plan say 0 planned: the watch can start before the planner's first interval ends)
    before = [(p, a) for t, p, a, _ in watch.rows if t < step_up and p]
    assert before and all(row == (1, 1) for row in before), watch.rows
    asked = watch.first(lambda p, a, d: p >= 2, after=step_up - INTERVAL_S)
    assert asked is not None, watch.rows
    # decided within two intervals of the step (a plan sees the step in the rate of the interval it ends; the watch
    # reads the plan up to half a second late)
    assert asked - step_up <= 2 * INTERVAL_S + 1.0, (asked, step_up, watch.rows)
    assert watch.first(lambda p, a, d: a >= 2, after=asked) is not None, watch.rows  # the second one came up
    assert watch.new_served > 0  # and took work
    back = watch.first(lambda p, a, d: a == 1 and d == 0, after=step_down + 1)
    assert back is not None, watch.rows  # drained back to one, and the drained worker gone

    assert plan_out.returncode == 0, plan_out.stderr
    assert "prefill:" in plan_out.stdout and "twin" in plan_out.stdout and "plan:" in plan_out.stdout
    assert 'mooncake_planner_desired_instances{role="prefill"}' in metrics
    assert "mooncake_planner_forecast_rate" in metrics
