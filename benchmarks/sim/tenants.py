"""Tenants and priorities under overload, in the simulator (issue 45): does a tenant keep its goodput while another
sends three times its share, and does a high priority keep its SLO attainment while a low one absorbs the refusals?

The paper's decode-bound setting (8P + 8D, the ``slow`` decode profile, TBT SLO 60 ms, TTFT SLO 30 s, the survival
forecast), the whole conversation trace at ``--speed`` (2: overloaded). Requests are split by their index: one in four
is tenant ``b`` (or the ``high`` class), the other three ``a`` (``low``).

- **Fair share**: ``b`` alone (only its requests, at the same speed: its own rate, which the cluster serves) against
  ``b`` beside ``a`` sending three times as much, with the requests labelled by tenant (equal weights: the Conductor
  shares by weight under pressure) and unlabelled (no tenants: first come, first served).
- **Priority**: ``high`` (priority 0) beside ``low`` (priority -1, sheddable) against the same requests unlabelled.

For each admission of ``--admissions``. One JSON line a run as it ends; ``--json`` holds them all.

    python -m benchmarks.sim.tenants --json benchmarks/results/sim_tenants.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import replace
from pathlib import Path

from benchmarks.sim.model import load_trace
from benchmarks.sim.run import DEFAULT_TRACE, summarize
from conductor.admission import AdmissionKind
from conductor.forecast import ForecastKind
from conductor.planner.costs import model_config
from conductor.planner.state import Record, SimConfig
from conductor.planner.twin import Cluster

SHARE = 4  # one request in SHARE is tenant b / the high class


def _minor(rec: Record) -> bool:
    return rec.req.index % SHARE == 0


def class_figures(cfg: SimConfig, records: list[Record]) -> dict:
    """Per class (b/high and a/low): requests, served, rejected, and served within both SLOs."""
    out = {}
    for name, minor in (("minor", True), ("major", False)):
        rows = [r for r in records if _minor(r) == minor]
        done = [r for r in rows if not math.isnan(r.finish)]
        ok = sum(1 for r in done if r.ttft_s <= cfg.ttft_slo_s and r.tbt_s <= cfg.tbt_slo_s)
        out[name] = {
            "requests": len(rows),
            "served": len(done),
            "rejected": sum(1 for r in rows if r.rejected is not None),
            "slo_ok": ok,
            "slo_attainment": ok / len(rows) if rows else math.nan,
        }
    return out


def run(cfg: SimConfig, requests, label) -> dict:
    """One simulation of ``requests``; ``label(record)`` sets a record's tenant, weight and priority (None: none)."""
    t0 = time.perf_counter()
    cluster = Cluster(cfg, requests)
    if label is not None:
        for rec in cluster.records:
            label(rec)
    records = cluster.run()
    s = summarize(cluster, records, time.perf_counter() - t0)
    return {
        "slo_ok": s["slo_ok"],
        "rejected": s["rejected"],
        "rejected_by_reason": s["rejected_by_reason"],
        "classes": class_figures(cfg, records),
        "wall_s": s["wall_s"],
    }


def by_tenant(rec: Record) -> None:
    rec.tenant = "b" if _minor(rec) else "a"


def by_priority(rec: Record) -> None:
    rec.priority = 0 if _minor(rec) else -1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help="trace file (default: %(default)s)")
    p.add_argument("--speed", type=float, default=2.0, help="replay speed (default %(default)s: overloaded)")
    p.add_argument("--tbt-slo", type=float, default=0.06, help="TBT SLO, seconds (default %(default)s)")
    p.add_argument("--admissions", default="early_predictive,early_wait", help="comma-separated (default %(default)s)")
    p.add_argument("--limit", type=int, default=None, help="first N requests of the trace (default: all)")
    p.add_argument("--json", type=Path, default=None, help="write every run's figures here")
    args = p.parse_args(argv)
    out = {"command": ["python", "-m", "benchmarks.sim.tenants", *(sys.argv[1:] if argv is None else argv)], "rows": []}
    requests = load_trace(args.trace, args.speed, args.limit)
    minor_only = [r for r in requests if r.index % SHARE == 0]
    for admission in args.admissions.split(","):
        cfg = replace(
            SimConfig(prefill=8, decode=8, model=model_config("slow", noise=0.05)),
            admission=AdmissionKind(admission),
            decode_forecast=ForecastKind.SURVIVAL,
            tbt_slo_s=args.tbt_slo,
        )
        for name, reqs, label in (
            ("b alone", minor_only, by_tenant),
            ("a and b, unlabelled", requests, None),
            ("a and b, tenants", requests, by_tenant),
            ("high and low, priorities", requests, by_priority),
        ):
            row = {"admission": admission, "run": name, **run(cfg, reqs, label)}
            out["rows"].append(row)
            print(json.dumps(row), flush=True)
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
