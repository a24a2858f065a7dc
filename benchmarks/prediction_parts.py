"""Each part of the Conductor's TTFT predictions against what came out, from the Conductor's own metrics.

A client sees a request's TTFT, not its parts. The Conductor scores each prediction when
the decode worker reports the request's first token (``mooncake_conductor_prediction_ratio``,
predicted over measured, per part: ``ttft``; ``queue`` and ``prefill``, the prefill worker's
own, and ``worker``, the two; ``transfer``, the rest: prefix transfer and hand-off). A replay scrapes that histogram
before and after a run; the difference is the run's:

    before = scrape(url)
    ... the run ...
    parts = part_shares(before, scrape(url))   # {"queue": {"requests": 80, "within_share": 0.91, ...}, ...}
"""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

METRIC = "mooncake_conductor_prediction_ratio"
WITHIN = (0.75, 1.25)  # predicted over measured within 25%: the buckets' bounds (conductor.service)

Buckets = dict[str, dict[float, float]]  # part -> upper bound -> cumulative count


def scrape(url: str | None, timeout_s: float = 5.0) -> Buckets | None:
    """The prediction-ratio histogram at ``url`` (a Conductor's /metrics); None: no URL, or it did not answer."""
    if not url:
        return None
    try:
        text = httpx.get(url, timeout=timeout_s, trust_env=False).text
    except httpx.HTTPError:
        return None
    out: Buckets = {}
    for family in text_string_to_metric_families(text):
        if family.name != METRIC:
            continue
        for sample in family.samples:
            if sample.name == METRIC + "_bucket":
                out.setdefault(sample.labels["part"], {})[float(sample.labels["le"])] = sample.value
    return out


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
