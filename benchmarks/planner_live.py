"""The planner on this machine: `mooncake up --planner act` under a 1x -> 3x -> 1x replay, each plan against what
followed.

    python -m benchmarks.planner_live [--rate 1.5] [--step-s 30] [--interval-s 4] [--json PATH]

A random-weight Llama (hidden 512, 8 layers: a 900-token prompt's prefill takes about 0.3 s on 2 cores), one prefill
and one decode worker to start, the planner acting (at most 2 of each); a steady trace of 900-token prompts with
nothing in common and 16-token answers at ``--rate`` requests a second, replayed by benchmarks.replay with
``--rate-profile step:1,3,1`` (each level ``--step-s`` long). Every plan the Conductor makes is read (its ``Plan``
RPC) with the twin's predicted TTFT and TBT p99 at the counts it chose; beside each, the measured p99 of the requests
sent in the interval after it. Printed: when the planner asked for the second prefill worker against the step up,
when the pool was back to one after the step down, the failed requests (goal 0), and the table.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

PROMPT_TOKENS = 900
BLOCK_TOKENS = 16  # the replay's token ids per trace hash id (its default)
OUTPUT_TOKENS = 16
MODEL_SHAPE = dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8)
TWIN = re.compile(r"twin (\d+)P (\d+)D: ([\d.]+)% within both SLOs, TTFT p99 ([\d.]+) s, TBT p99 ([\d.]+) ms")


def write_steady_trace(path: Path, rate: float, seconds: float) -> int:
    """A Mooncake-format trace at a steady ``rate``: 900-token prompts with nothing in common, 16-token answers
    (after the replay's scaling: lengths x 16 / 512, outputs x 1/16). Returns its requests."""
    n = round(rate * seconds)
    blocks = PROMPT_TOKENS // BLOCK_TOKENS
    with open(path, "w") as f:
        for i in range(n):
            record = {
                "timestamp": round(i / rate * 1000),
                "input_length": PROMPT_TOKENS * 512 // BLOCK_TOKENS,
                "output_length": OUTPUT_TOKENS * 16,
                "hash_ids": list(range(i * blocks, (i + 1) * blocks)),
            }
            f.write(json.dumps(record) + "\n")
    return n


def replay_command(trace: Path, url: str, model_dir: Path, n: int, out: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "benchmarks.replay",
        *("--trace", str(trace), "--url", url, "--model", "tiny", "--model-dir", str(model_dir)),
        *("--speed", "1", "--rate-profile", "step:1,3,1", "--limit", str(n), "--max-input", "1000"),
        *("--ttft-slo", "300", "--tbt-slo", "10", "--no-warmup", "--no-progress", "--json", str(out)),
    ]


class Plans:
    """Every new plan the Conductor makes (its Plan RPC, read every half second): (time from start, prefill, decode,
    forecast rate, the twin's TTFT p99 s and TBT p99 s at the chosen counts, or None)."""

    def __init__(self, stub, pb) -> None:
        self.rows: list[tuple] = []
        self._stub, self._pb = stub, pb
        self._stop = threading.Event()
        self.t0 = time.monotonic()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        last = None
        while not self._stop.is_set():
            try:
                r = self._stub.Plan(self._pb.PlanRequest(), timeout=5)
            except Exception:  # a slow answer on a busy machine: the next read counts
                r = None
            if r is not None and r.reasoning:
                made = time.monotonic() - self.t0 - r.age_s
                if last is None or made - last > 0.5:
                    last = made
                    twin = [m for m in TWIN.finditer(r.reasoning) if (int(m[1]), int(m[2])) == (r.prefill, r.decode)]
                    ttft, tbt = (float(twin[-1][4]), float(twin[-1][5]) / 1000) if twin else (None, None)
                    self.rows.append((made, r.prefill, r.decode, r.forecast_rate, ttft, tbt))
            self._stop.wait(0.5)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.planner_live",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--rate", type=float, default=1.5, help="requests a second at 1x")
    ap.add_argument("--step-s", type=float, default=30.0, help="seconds at each level")
    ap.add_argument("--interval-s", type=float, default=4.0, help="the planner's interval")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from clusters import conductor, start_cluster  # the tests' cluster (LocalCluster with their settings)

    from mooncake.engine.tiny import make_tiny
    from protos import conductor_pb2 as cpb

    console = Console()
    work = Path(tempfile.mkdtemp(prefix="planner-live-"))
    model = make_tiny(work / "model", "llama", **MODEL_SHAPE)
    trace = work / "steady.jsonl"
    n = write_steady_trace(trace, args.rate, 5 * args.step_s)
    with console.status("starting the cluster"):
        c = start_cluster(
            model,
            work / "run",
            prefill=1,
            decode=1,
            planner="act",
            planner_interval_s=args.interval_s,
            planner_max=2,
            admission="none",
        )
    plans = Plans(conductor(c), cpb)
    try:
        out = work / "replay.json"
        started = time.monotonic() - plans.t0
        with console.status("replaying 1x -> 3x -> 1x"):
            subprocess.run(replay_command(trace, c.endpoint, model, n, out), check=True, capture_output=True)
            time.sleep(10 * args.interval_s)  # the drain after the step down
    finally:
        plans.stop()
        c.stop()
    (run,) = json.loads(out.read_text())["runs"]
    reqs = run["requests"]
    failed = [q for q in reqs if q["outcome"] != "ok" or q["completion_tokens"] != OUTPUT_TOKENS]
    t = Table(
        title=f"plans against what followed (interval {args.interval_s:g} s; step up at {args.step_s:g} s, "
        f"down at {2 * args.step_s:g} s of the replay)"
    )
    for col in (
        "plan at s",
        "prefill",
        "decode",
        "forecast req/s",
        "twin TTFT p99",
        "measured",
        "twin TBT p99",
        "measured",
    ):
        t.add_column(col, justify="right")
    rows = []
    for made, p, d, rate, ttft, tbt in plans.rows:
        at = made - started
        sent = [q for q in reqs if at <= q["sent_s"] < at + args.interval_s and q["ttft_s"] is not None]
        m_ttft = float(np.quantile([q["ttft_s"] for q in sent], 0.99)) if sent else None
        m_tbt = float(np.quantile([q["tbt_s"] or 0.0 for q in sent], 0.99)) if sent else None
        rows.append(
            dict(
                at_s=at,
                prefill=p,
                decode=d,
                rate=rate,
                twin_ttft_p99_s=ttft,
                ttft_p99_s=m_ttft,
                twin_tbt_p99_s=tbt,
                tbt_p99_s=m_tbt,
                requests=len(sent),
            )
        )
        if at >= -args.interval_s:
            t.add_row(f"{at:.1f}", str(p), str(d), f"{rate:.2f}", _s(ttft), _s(m_ttft), _ms(tbt), _ms(m_tbt))
    console.print(t)
    up = next((r["at_s"] for r in rows if r["prefill"] >= 2 and r["at_s"] >= 0), None)
    down = next((r["at_s"] for r in rows if up is not None and r["at_s"] > up and r["prefill"] == 1), None)
    summary = dict(
        requests=len(reqs),
        failed=len(failed),
        step_up_s=args.step_s,
        asked_second_prefill_s=up,
        step_down_s=2 * args.step_s,
        planned_back_to_one_s=down,
    )
    console.print(summary)
    if args.json:
        args.json.write_text(
            json.dumps(dict(args=vars(args) | {"json": str(args.json)}, summary=summary, plans=rows), indent=1) + "\n"
        )
    return 0 if not failed else 1


def _s(v):
    return "-" if v is None else f"{v:.2f} s"


def _ms(v):
    return "-" if v is None else f"{v * 1000:.1f} ms"


if __name__ == "__main__":
    sys.exit(main())
