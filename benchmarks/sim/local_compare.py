"""Prefill on the decode instance in the simulator (issue 35): ``--local-prefill`` never / always / auto, side by side.

The paper's decode-bound setting (8P + 8D, the ``slow`` decode profile, speed 2, early_predictive with the survival
forecast) at TBT SLOs of 50, 60 and 70 ms, and at speed 1 with a 100 ms TBT SLO (for mean TTFT); the whole
conversation trace. One JSON line a run as it ends, then ``--json`` holds them all. ``auto`` runs once for each
``--max-load`` (the Conductor's ``local_max_load``: a decode instance computes prompts only while its step is at
most that share of the TBT limit).

    python -m benchmarks.sim.local_compare --max-load 0.3,0.5,0.7,1.0 --json benchmarks/results/sim_local_prefill.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

from benchmarks.sim.model import load_trace
from benchmarks.sim.run import DEFAULT_TRACE, simulate
from conductor.admission import AdmissionKind
from conductor.local import LocalPrefill
from conductor.planner.costs import model_config
from conductor.planner.state import SimConfig

FIGURES = (
    "requests",
    "served",
    "rejected",
    "slo_ok",
    "local_prefills",
    "ttft_mean_s",
    "ttft_p90_s",
    "tbt_p90_s",
    "tbt_p99_s",
)
SETTINGS = ((2.0, "slow", (0.05, 0.06, 0.07)), (1.0, "slow", (0.1,)))  # (speed, decode profile, TBT SLOs)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help="trace file (default: %(default)s)")
    p.add_argument("--json", type=Path, default=None, help="write every run's figures here")
    p.add_argument(
        "--max-load", default="0.5", help="auto's local_max_load values, comma-separated (default %(default)s)"
    )
    args = p.parse_args(argv)
    out = {
        "command": ["python", "-m", "benchmarks.sim.local_compare", *(sys.argv[1:] if argv is None else argv)],
        "rows": [],
    }
    for speed, profile, tbts in SETTINGS:
        base = SimConfig(
            prefill=8, decode=8, admission=AdmissionKind.EARLY_PREDICTIVE, model=model_config(profile, noise=0.05)
        )
        requests = load_trace(args.trace, speed, None)
        for tbt in tbts:
            runs = [(LocalPrefill.NEVER, None), (LocalPrefill.ALWAYS, None)]  # (local_max_load: auto's alone)
            runs += [(LocalPrefill.AUTO, float(x)) for x in args.max_load.split(",")]
            for mode, max_load in runs:
                t0 = time.perf_counter()
                config = replace(base, tbt_slo_s=tbt, local_prefill=mode)
                s = simulate(
                    config if max_load is None else replace(config, local_max_load=max_load), requests=requests
                )
                row = dict(
                    speed=speed,
                    profile=profile,
                    tbt_slo_s=tbt,
                    mode=mode.value,
                    local_max_load=max_load,
                    **{k: s[k] for k in FIGURES},
                    wall_s=time.perf_counter() - t0,
                )
                out["rows"].append(row)
                print(json.dumps(row), flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
