"""The planner against a static cluster sized for the peak and against a reactive baseline, under a moving rate.

    python -m benchmarks.sim.planning [--profile day:1,4] [--speed 0.5] [--preset conversation|prefill-heavy]
                                      [--start-s 60] [--limit N] [--json PATH]

1. The trace re-timed by the profile (benchmarks.rate_profile: ``day:1,4`` is a day from 1x to 4x the trace's rate
   at ``--speed`` and back; ``step:1,3,1`` a step up and down).
2. Static, sized for the peak: the fewest prefill instances (with decode plentiful), then the fewest decode
   instances, that serve the whole trace at the peak's rate (``--speed`` x the profile's peak, steady) with both
   SLOs met for at least 99% of its requests (``TARGET``); then run through the moving rate. The bar: its requests
   within both SLOs ("good") and its instance-seconds. Beside it, the fewest static instances that serve this
   run itself (a stricter bar: a short peak is partly absorbed by the queues, within the TTFT SLO).
3. The planner (conductor.planner, through benchmarks.sim.autoscale.PlannerScaler): every 30 s of simulated time
   a plan from what the Conductor saw, checked on the twin; new instances serve ``--start-s`` after they are asked
   for and are paid for from that moment; drained ones stop once idle.
4. The queue-length baseline (autoscale.QueueScaler): the HPA's rule on the prefill queue and the decode batch.

Both elastic runs start with the static counts scaled by the profile's first level over its peak (the trough's
share), as a cluster that has been running through the night would. Goals (the issue's): good requests at least
99% of the static cluster's, with at most 75% of its instance-seconds, and ahead of the baseline on both.

Presets: ``conversation`` (the trace as it is) and ``prefill-heavy`` (outputs scaled by 1/64 as
benchmarks.trace's preset of that name: the prefill pool is what binds).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import replace

from rich.console import Console
from rich.table import Table

from benchmarks.rate_profile import RateProfile
from benchmarks.sim.autoscale import PlannerScaler, QueueScaler
from benchmarks.sim.model import load_trace
from benchmarks.trace import DEFAULT_TRACE, PRESETS
from conductor.planner.planner import PlannerConfig
from conductor.planner.state import SimConfig
from conductor.planner.twin import Cluster
from conductor.types import Role

TARGET = 0.99
MAX_INSTANCES = 64


def trace(speed: float, limit: int | None, profile: RateProfile | None, preset: str):
    requests = load_trace(DEFAULT_TRACE, speed, limit, profile)
    if preset == "prefill-heavy":
        scale = PRESETS["prefill-heavy"]["output_scale"]
        for r in requests:
            r.output_tokens = max(1, round(r.output_tokens * scale))
    return requests


def good(records, cfg: SimConfig) -> int:
    return sum(r.within_slos(cfg.ttft_slo_s, cfg.tbt_slo_s) for r in records)


def run(cfg: SimConfig, requests, scaler=None) -> dict:
    """One run; its good requests, instance-seconds by role and the counts it went through."""
    started = time.perf_counter()
    planner = scaler.planner if isinstance(scaler, PlannerScaler) else None
    cluster = Cluster(cfg, requests, autoscaler=scaler, observer=planner)
    records = cluster.run()
    end = max((r.finish for r in records if not math.isnan(r.finish)), default=cluster.now)
    seconds = cluster.instance_seconds(end)
    counts = [(cfg.prefill, cfg.decode)] + [(p, d) for _, p, d in cluster.scalings]
    return {
        "prefill": cfg.prefill,
        "decode": cfg.decode,
        "good": good(records, cfg),
        "requests": len(records),
        "instance_s": seconds[Role.PREFILL] + seconds[Role.DECODE],
        "prefill_s": seconds[Role.PREFILL],
        "decode_s": seconds[Role.DECODE],
        "scalings": len(cluster.scalings),
        "prefill_range": [min(p for p, _ in counts), max(p for p, _ in counts)],
        "decode_range": [min(d for _, d in counts), max(d for _, d in counts)],
        "end_s": end,
        "wall_s": time.perf_counter() - started,
    }


def smallest(make, lo: int, hi: int) -> dict:
    """The run of the least n in [lo, hi] that meets ``TARGET`` (bisection: more instances never serve fewer); the
    run at ``hi`` if none does."""
    runs = {}
    while lo < hi:
        mid = (lo + hi) // 2
        runs[mid] = make(mid)
        if runs[mid]["good"] >= TARGET * runs[mid]["requests"]:
            hi = mid
        else:
            lo = mid + 1
    return runs[lo] if lo in runs else make(lo)


def static_for(base: SimConfig, requests, console: Console, what: str) -> dict:
    """The fewest prefill instances (decode plentiful), then the fewest decode instances, that serve ``requests``."""
    with console.status(f"static: the fewest prefill instances that serve {what}"):
        p = smallest(lambda n: run(replace(base, prefill=n, decode=8), requests), 1, MAX_INSTANCES)["prefill"]
    with console.status(f"static: {p} prefill; the fewest decode instances that serve {what}"):
        return smallest(lambda n: run(replace(base, prefill=p, decode=n), requests), 1, 8)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.sim.planning",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--profile", default="day:1,4", help="rate profile (benchmarks.rate_profile)")
    ap.add_argument("--speed", type=float, default=0.5, help="the trace's rate at 1x (arrival = timestamp / speed)")
    ap.add_argument("--preset", choices=sorted(PRESETS), default="conversation")
    ap.add_argument("--start-s", type=float, default=60.0, help="seconds from asking for an instance to its serving")
    ap.add_argument("--limit", type=int, help="the trace's first N requests")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    console = Console()
    try:
        profile = RateProfile.parse(args.profile)
    except ValueError as e:
        console.print(f"[red]error:[/red] {e}")
        return 2
    requests = trace(args.speed, args.limit, profile, args.preset)
    peak_rate = trace(args.speed * profile.peak, args.limit, None, args.preset)  # the whole trace at the peak's rate
    base = SimConfig(start_s=args.start_s)
    sized = static_for(base, peak_rate, console, f"the trace at {profile.peak:g}x")
    static = run(replace(base, prefill=sized["prefill"], decode=sized["decode"]), requests)
    day = static_for(base, requests, console, "this run")
    share = profile.levels[0] / profile.peak if profile.levels else 1.0
    first = replace(
        base, prefill=max(1, math.ceil(static["prefill"] * share)), decode=max(1, math.ceil(static["decode"] * share))
    )
    # both elastic ones may go to twice the static counts (an HPA's maxReplicas)
    most_p, most_d = 2 * static["prefill"], 2 * static["decode"]
    bounds = dict(max_prefill=most_p, max_decode=most_d, start_s=args.start_s)
    with console.status("the planner"):
        planner = run(first, requests, PlannerScaler(PlannerConfig(**bounds)))
    with console.status("the queue-length baseline"):
        queue = run(first, requests, QueueScaler(bounds=(1, max(most_p, most_d))))
    rows = {
        f"static, sized for the peak ({profile.peak:g}x steady)": static,
        "static, the fewest that serve this run": day,
        "planner": planner,
        "queue length (HPA)": queue,
    }
    title = (
        f"{profile.describe()}, the {args.preset} trace at {args.speed:g}x as 1x; "
        f"{len(requests)} requests; instances serve {args.start_s:g} s after they are asked for"
    )
    t = Table(title=title)
    for c in ("cluster", "prefill", "decode", "good (of static)", "instance-s (of static)", "scalings", "wall s"):
        t.add_column(c, justify="left" if c == "cluster" else "right")
    for name, r in rows.items():
        t.add_row(
            name,
            "{}-{}".format(*r["prefill_range"]),
            "{}-{}".format(*r["decode_range"]),
            f"{r['good']} ({r['good'] / static['good']:.1%})",
            f"{r['instance_s']:.0f} ({r['instance_s'] / static['instance_s']:.1%})",
            str(r["scalings"]),
            f"{r['wall_s']:.0f}",
        )
    console.print(t)
    met = planner["good"] >= 0.99 * static["good"] and planner["instance_s"] <= 0.75 * static["instance_s"]
    ahead = planner["good"] >= queue["good"] and planner["instance_s"] <= queue["instance_s"]
    console.print(
        f"goal (good >= 99% of the static cluster sized for the peak, with <= 75% of its instance-seconds): "
        f"{'met' if met else 'NOT met'}; ahead of the queue-length baseline on both: {'yes' if ahead else 'no'}; "
        f"against the fewest static instances that serve this run: good {planner['good'] / day['good']:.1%}, "
        f"instance-seconds {planner['instance_s'] / day['instance_s']:.1%}"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"title": title, "args": vars(args), "runs": rows, "goal_met": met, "ahead": ahead}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
