"""Each part of the Conductor's TTFT predictions against what came out, from the Conductor's own metrics.

A client sees a request's TTFT, not its parts. The Conductor scores each prediction when
the decode worker reports the request's first token (``mooncake_conductor_prediction_ratio``,
predicted over measured, per part: ``ttft``; ``queue`` and ``prefill``, the prefill worker's
own, and ``worker``, the two; ``transfer``, the rest: prefix transfer and hand-off). A replay scrapes that histogram
before and after a run; the difference is the run's:

    before = scrape(url)
    ... the run ...
    parts = part_shares(before, scrape(url))   # {"queue": {"requests": 80, "within_share": 0.91, ...}, ...}

Where the histogram says how often, the Conductor's prediction log (``--prediction-log``; `mooncake up` writes
``logs/conductor-predictions.jsonl`` in its run directory, conductor/audit.py) says which requests and under what
load; run as a program, this reads it:

    python -m benchmarks.prediction_parts RUN_DIR/logs/conductor-predictions.jsonl [--worst 10]

prints each part's share within 25% and its error percentiles, by prompt length and by how many prefill workers were
busy when the request was placed, and the worst-predicted requests.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from conductor.metrics import MIN_SCORED_PART_S

METRIC = "mooncake_conductor_prediction_ratio"
WITHIN = (0.75, 1.25)  # predicted over measured within 25%: the buckets' bounds (conductor.metrics)

Buckets = dict[str, dict[float, float]]  # part -> upper bound -> cumulative count


def _families(url: str | None, timeout_s: float):
    """The metric families at ``url`` (a Conductor's /metrics); None: no URL, or it did not answer."""
    if not url:
        return None
    try:
        return list(text_string_to_metric_families(httpx.get(url, timeout=timeout_s, trust_env=False).text))
    except httpx.HTTPError:
        return None


def scrape(url: str | None, timeout_s: float = 5.0) -> Buckets | None:
    """The prediction-ratio histogram at ``url`` (a Conductor's /metrics); None: no URL, or it did not answer."""
    families = _families(url, timeout_s)
    if families is None:
        return None
    out: Buckets = {}
    for family in families:
        if family.name != METRIC:
            continue
        for sample in family.samples:
            if sample.name == METRIC + "_bucket":
                out.setdefault(sample.labels["part"], {})[float(sample.labels["le"])] = sample.value
    return out


def scrape_handoffs(url: str | None, timeout_s: float = 5.0) -> dict | None:
    """The Conductor's hand-off counters at ``url``: ``placed`` (placements on a prefill worker), ``narrow`` (those
    whose KV moves in the pool's narrower dtype) and ``link_bytes_per_s`` (the bandwidth it has learnt); None: no URL,
    or it did not answer."""
    families = _families(url, timeout_s)
    if families is None:
        return None
    out = {"placed": 0.0, "narrow": 0.0, "link_bytes_per_s": 0.0}
    for family in families:
        for sample in family.samples:
            if sample.name == "mooncake_conductor_placements_total" and sample.labels.get("kind") == "prefill_worker":
                out["placed"] = sample.value
            elif sample.name == "mooncake_conductor_narrow_handoffs_total":
                out["narrow"] = sample.value
            elif sample.name == "mooncake_conductor_transfer_bytes_per_second":
                out["link_bytes_per_s"] = sample.value
    return out


def handoff_counts(before: dict | None, after: dict | None) -> dict:
    """What the counters of ``scrape_handoffs`` moved between two scrapes (the bandwidth: the later figure)."""
    if before is None or after is None:
        return {}
    return {
        "placed": int(after["placed"] - before["placed"]),
        "narrow": int(after["narrow"] - before["narrow"]),
        "link_bytes_per_s": after["link_bytes_per_s"],
    }


def describe_handoffs(counts: dict) -> str:
    """``12 of 40 hand-offs narrow, the link learnt at 23.1 MB/s``: a run's ``handoff_counts``."""
    rate = counts["link_bytes_per_s"] / 1e6
    return f"{counts['narrow']} of {counts['placed']} hand-offs narrow, the link learnt at {rate:.1f} MB/s"


def part_shares(before: Buckets | None, after: Buckets | None) -> dict:
    """Per part, what was scored between the two scrapes: ``requests``, ``within_share`` (predicted within 25% of
    measured), ``over_share`` (predicted over 1.25x) and ``under_share`` (under 0.75x). Empty without both."""
    if before is None or after is None:
        return {}
    out = {}
    for part, buckets in after.items():
        base = before.get(part, {})
        count = {le: n - base.get(le, 0.0) for le, n in buckets.items()}
        total = count.get(float("inf"), 0.0)
        if total <= 0:
            continue
        under, upto = count.get(WITHIN[0], 0.0), count.get(WITHIN[1], 0.0)
        out[part] = {
            "requests": int(total),
            "within_share": (upto - under) / total,
            "under_share": under / total,
            "over_share": (total - upto) / total,
        }
    return out


def describe_parts(parts: dict) -> str:
    """``queue 91% (under 5%, over 4%) of 80; ...``: each part's share within 25%."""
    return "; ".join(
        f"{part} {p['within_share']:.0%} within 25% (under {p['under_share']:.0%}, over {p['over_share']:.0%}) of "
        f"{p['requests']}"
        for part, p in sorted(parts.items())
    )


PARTS = ("ttft", "queue", "prefill", "transfer")
PROMPT_BINS = (0, 128, 384, 768)  # prompt tokens: the lower bounds of the rows "by prompt"


def read_log(paths: list[Path]) -> list[dict]:
    """The prediction log's rows (conductor/audit.py), every file in order; a torn last line is skipped."""
    rows = []
    for path in paths:
        for line in path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return rows


def part_errors(rows: list[dict], part: str) -> np.ndarray:
    """(predicted - measured) / measured of ``part``, for the rows where either is at least MIN_SCORED_PART_S (as the
    Conductor scores them), and for a part of the TTFT only where the decode worker measured the parts."""
    out = [
        (r["predicted"][part] - r["measured"][part]) / r["measured"][part] if r["measured"][part] > 0 else float("inf")
        for r in rows
        if max(r["predicted"][part], r["measured"][part]) >= MIN_SCORED_PART_S
        and (part == "ttft" or r["measured"]["queue"] + r["measured"]["prefill"] > 0)
    ]
    return np.array(out, dtype=np.float64)


def describe_rows(rows: list[dict], label: str) -> str:
    cells = []
    for part in PARTS:
        e = part_errors(rows, part)
        if not len(e):
            cells.append(f"{part} -")
            continue
        within = float(np.mean((e >= WITHIN[0] - 1) & (e <= WITHIN[1] - 1)))
        p10, p50, p90 = np.percentile(np.clip(e, -10, 10), [10, 50, 90])
        cells.append(f"{part} {within:4.0%} ({p10:+.0%} {p50:+.0%} {p90:+.0%})")
    return f"{label:<18} {len(rows):>5}  " + "  ".join(cells)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.prediction_parts",
        description="Each part of the Conductor's TTFT predictions against what came out, from its prediction log "
        "(conductor/audit.py): the share within 25%, and the error (predicted - measured) / measured at p10 p50 p90.",
    )
    p.add_argument("logs", nargs="+", type=Path, help="prediction log files (the rolled-over .1 first)")
    p.add_argument("--worst", type=int, default=10, help="list this many of the worst-predicted TTFTs")
    args = p.parse_args(argv)
    missing = [str(f) for f in args.logs if not f.is_file()]
    if missing:
        print(f"error: no such file: {', '.join(missing)}", file=sys.stderr)
        return 2
    rows = read_log(args.logs)
    if not rows:
        print("no predictions logged yet", file=sys.stderr)
        return 1
    print(f"{'':<18} {'rows':>5}  each part: within 25% (error p10 p50 p90)")
    print(describe_rows(rows, "all"))
    edges = (*PROMPT_BINS, float("inf"))
    for lo, hi in zip(edges, edges[1:]):
        part = [r for r in rows if lo <= r["prompt_tokens"] < hi]
        if part:
            print(describe_rows(part, f"prompt {lo}-{hi if hi != float('inf') else ''}"))
    for busy in sorted({r["busy"] for r in rows}):
        print(describe_rows([r for r in rows if r["busy"] == busy], f"{busy} busy before"))
    worst = sorted(rows, key=lambda r: -abs(r["predicted"]["ttft"] / max(r["measured"]["ttft"], 1e-6) - 1))
    if args.worst > 0:
        print(f"\nthe {min(args.worst, len(rows))} worst TTFTs (s: predicted / measured, part by part)")
        for r in worst[: args.worst]:
            pr, me = r["predicted"], r["measured"]
            parts = ", ".join(f"{k} {pr[k]:.2f}/{me[k]:.2f}" for k in PARTS)
            print(
                f"{r['request'][:24]:<24} {r['instance']:<10} {r['prompt_tokens']:>5} tok, "
                f"{r['ahead_tokens']:>5} ahead, {r['busy']} busy: {parts}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
