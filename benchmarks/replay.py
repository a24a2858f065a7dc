"""Replay a Mooncake-format trace against any OpenAI-compatible endpoint and measure the paper's SLO metrics.

    python -m benchmarks.replay --trace PATH --url URL --model NAME [--speed S] [--sweep 0.5,1,2,4]
        [--block-tokens B] [--max-input T] [--output-scale X] [--max-output N] [--limit N]
        [--ttft-slo s] [--tbt-slo s] [--json PATH] [--plot PATH]

How the trace is scaled, and the defaults: benchmarks/trace.py.

**Per request**: TTFT = request sent -> the first streamed event carrying text; the gaps
between text events; TBT as in the paper = the mean of the longest 10% of those gaps
(ceil, at least one gap); the mean gap = (last event - first event) / (completion tokens -
1), the tokens counted from ``usage`` (a gateway may send no event for a token whose text
is empty: that token's gap then joins the next one's); cached prompt tokens from
``usage.prompt_tokens_details.cached_tokens`` (None where the server does not say). A 429
is a rejection, anything else that fails an error. A request is *effective* when it
completed with TTFT <= the TTFT SLO and TBT <= the TBT SLO; the **effective request
capacity** of a sweep is the highest rate factor at which it and every lower factor have
at least ``--effective-target`` (0.9) of all requests effective.

Usable as a library: ``replay``, ``sweep``, ``effective_capacity``,
``render``, ``plot`` (benchmarks/compare.py uses them; the trace's requests: benchmarks/trace.py).
"""

from __future__ import annotations

import argparse
import asyncio
import enum
import json
import math
import random
import shlex
import sys
import textwrap
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import numpy as np
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from benchmarks.benchutil import make_progress, percentile
from benchmarks.prediction_parts import describe_parts, handoff_counts, part_shares, scrape, scrape_handoffs
from benchmarks.rate_profile import RateProfile
from benchmarks.trace import (
    DEFAULT_TRACE,
    DEFAULTS,
    MIN_TOKEN_ID,
    PRESETS,
    SMOLLM2_VOCAB,
    TraceRequest,
    apply_preset,
    trace_from_args,
    vocab_size_of,
)

TAIL_SHARE = 0.10  # the paper's TBT: the mean of the longest 10% of token gaps
PREDICTED_TTFT_HEADER = "x-mooncake-predicted-ttft"  # mooncake.gateway.app's: the Conductor's TTFT prediction, seconds
PARTS_SETTLE_S = 1.0  # after a run, before the Conductor's prediction scores are read again
PREDICTION_WITHIN = 0.25  # issue 34's bar: predicted TTFT within 25% of the measured one


# -- measuring one request -------------------------------------------------------------------------------


class Outcome(str, enum.Enum):
    OK = "ok"
    REJECTED = "rejected"  # HTTP 429
    ERROR = "error"


@dataclass(slots=True)
class RequestResult:
    """One replayed request; times in seconds, ``scheduled_s``/``sent_s`` from the replay's start, the rest from
    sending."""

    index: int
    scheduled_s: float
    sent_s: float
    prompt_tokens: int
    max_tokens: int
    outcome: Outcome = Outcome.ERROR
    http_status: int | None = None
    error: str | None = None
    ttft_s: float | None = None
    tbt_s: float | None = None  # the paper's: mean of the longest 10% of gaps
    tbt_mean_s: float | None = None  # (last event - first event) / (completion tokens - 1)
    e2e_s: float | None = None
    completion_tokens: int = 0
    cached_tokens: int | None = None  # None: the server did not say
    predicted_ttft_s: float | None = (
        None  # a mooncake cluster's Conductor's prediction (response header; None: no such server)
    )
    token_times_s: list[float] = field(default_factory=list)  # every event carrying text
    effective: bool = False


def tail_tbt(gaps: list[float], share: float = TAIL_SHARE) -> float:
    """The paper's TBT: the mean of the longest ``share`` of ``gaps`` (ceil, at least one); 0.0 without gaps."""
    if not gaps:
        return 0.0
    longest = sorted(gaps, reverse=True)[: max(1, math.ceil(len(gaps) * share))]
    return sum(longest) / len(longest)


def is_effective(r: RequestResult, ttft_slo_s: float, tbt_slo_s: float) -> bool:
    return r.outcome is Outcome.OK and r.ttft_s is not None and r.ttft_s <= ttft_slo_s and (r.tbt_s or 0.0) <= tbt_slo_s


def _finish(r: RequestResult, times: list[float], usage: dict, end_s: float) -> None:
    """Fill in the metrics of a stream that ended well."""
    r.token_times_s = times
    r.completion_tokens = int(usage.get("completion_tokens") or len(times))
    details = usage.get("prompt_tokens_details") or {}
    r.cached_tokens = int(details["cached_tokens"]) if details.get("cached_tokens") is not None else None
    r.e2e_s = end_s
    if not times:
        r.outcome, r.error = Outcome.ERROR, f"the stream ended without a token event (usage {usage!r})"
        return
    r.outcome = Outcome.OK
    r.ttft_s = times[0]
    r.tbt_s = tail_tbt([b - a for a, b in zip(times, times[1:])])
    r.tbt_mean_s = (times[-1] - times[0]) / (r.completion_tokens - 1) if r.completion_tokens > 1 else 0.0


async def _send(
    client: httpx.AsyncClient, url: str, body: bytes, headers: dict[str, str], r: RequestResult, clock0: float
) -> None:
    """Stream one completion into ``r``; never raises for the server's or the network's failures."""
    t0 = time.perf_counter()
    r.sent_s = t0 - clock0
    times: list[float] = []
    usage: dict = {}
    try:
        async with client.stream("POST", f"{url}/completions", content=body, headers=headers) as resp:
            r.http_status = resp.status_code
            if (predicted := resp.headers.get(PREDICTED_TTFT_HEADER)) is not None:
                r.predicted_ttft_s = float(predicted)
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")[:300]
                r.outcome = Outcome.REJECTED if resp.status_code == 429 else Outcome.ERROR
                r.error = f"HTTP {resp.status_code}: {text}"
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                now = time.perf_counter() - t0
                event = json.loads(data)
                if event.get("error"):
                    err = event["error"]
                    r.outcome = Outcome.REJECTED if isinstance(err, dict) and err.get("code") == 429 else Outcome.ERROR
                    r.error = f"error event: {json.dumps(err)[:300]}"
                    return
                choices = event.get("choices") or []
                if choices and choices[0].get("text"):
                    times.append(now)
                if event.get("usage"):
                    usage = event["usage"]
        _finish(r, times, usage, time.perf_counter() - t0)
    except (httpx.HTTPError, OSError, json.JSONDecodeError) as e:
        r.outcome, r.error = Outcome.ERROR, f"{type(e).__name__}: {e}"[:300]


# -- one replay, a sweep, the capacity ---------------------------------------------------------------------


def _base_url(url: str) -> str:
    url = url.rstrip("/")
    return url if url.endswith("/v1") else f"{url}/v1"


def _body(model: str, prompt: list[int], max_tokens: int) -> bytes:
    return json.dumps(
        {
            "model": model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
            "ignore_eos": True,
            "stream_options": {"include_usage": True},
        }
    ).encode()


def _headers(api_key: str | None) -> dict[str, str]:
    return {"content-type": "application/json", **({"authorization": f"Bearer {api_key}"} if api_key else {})}


async def _replay(
    requests: list[TraceRequest],
    prompts: list[list[int]],
    url: str,
    model: str,
    dues: list[float],
    concurrency_limit: int | None,
    api_key: str | None,
    timeout_s: float,
    on_done,
) -> tuple[list[RequestResult], float]:
    headers = _headers(api_key)
    gate = asyncio.Semaphore(concurrency_limit) if concurrency_limit else None
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(
        timeout=httpx.Timeout(timeout_s, connect=10.0), limits=limits, trust_env=False
    ) as client:
        clock0 = time.perf_counter() + 0.05  # every request is scheduled before the first is due

        async def one(req: TraceRequest, prompt: list[int], due: float) -> RequestResult:
            await asyncio.sleep(max(0.0, clock0 + due - time.perf_counter()))
            r = RequestResult(req.index, due, 0.0, len(prompt), req.max_tokens)
            body = _body(model, prompt, req.max_tokens)
            if gate is None:
                await _send(client, url, body, headers, r, clock0)
            else:
                async with gate:
                    await _send(client, url, body, headers, r, clock0)
            on_done(r)
            return r

        results = await asyncio.gather(*(one(q, p, d) for q, p, d in zip(requests, prompts, dues)))
    return list(results), time.perf_counter() - clock0


def replay(
    requests: list[TraceRequest],
    url: str,
    model: str,
    *,
    speed: float = 1.0,
    salt: int = 0,
    ttft_slo_s: float = DEFAULTS["ttft_slo_s"],
    tbt_slo_s: float = DEFAULTS["tbt_slo_s"],
    concurrency_limit: int | None = None,
    api_key: str | None = None,
    timeout_s: float = 900.0,
    progress: Progress | None = None,
    label: str = "replay",
    conductor_metrics: str | None = None,
    profile: RateProfile | None = None,
) -> dict:
    """Replay ``requests`` open loop at ``speed`` against ``url`` (an OpenAI base URL; ``/v1`` is added if missing).

    Blocks until every request has finished. Returns a JSON-ready dict: ``speed``,
    ``salt``, ``summary`` (see ``summarize``) and ``requests`` (every ``RequestResult``).
    Prompts are built before the clock starts. With ``conductor_metrics`` (a Conductor's
    /metrics URL) the summary also has ``prediction_parts``: each part of its TTFT
    predictions against what came out (benchmarks.prediction_parts). ``profile`` re-times the arrivals (after the
    speed) so the rate follows it (benchmarks.rate_profile: a step 1x -> 3x -> 1x, a day).
    """
    if not requests:
        raise ValueError("no requests to replay")
    if speed <= 0:
        raise ValueError(f"speed must be positive, got {speed}")
    prompts = [q.prompt(salt) for q in requests]
    task = progress.add_task(label, total=len(requests)) if progress is not None else None
    counts = {"ok": 0, "rejected": 0, "error": 0}

    def on_done(r: RequestResult) -> None:
        r.effective = is_effective(r, ttft_slo_s, tbt_slo_s)
        counts[r.outcome.value] += 1
        if progress is not None:
            progress.update(
                task,
                advance=1,
                description=f"{label}: {counts['ok']} ok, {counts['rejected']} rejected, {counts['error']} errors",
            )

    first = requests[0].arrival_s
    dues = [(q.arrival_s - first) / speed for q in requests]
    phases = profile.phases(dues) if profile is not None else None
    if profile is not None:
        dues = [float(t) for t in profile.retime(dues)]
    before, handoffs_before = scrape(conductor_metrics), scrape_handoffs(conductor_metrics)
    results, wall = asyncio.run(
        _replay(requests, prompts, _base_url(url), model, dues, concurrency_limit, api_key, timeout_s, on_done)
    )
    if before is not None:
        time.sleep(PARTS_SETTLE_S)  # the last first tokens' reports reach the Conductor
    parts = part_shares(before, scrape(conductor_metrics))
    handoffs = handoff_counts(handoffs_before, scrape_handoffs(conductor_metrics))
    if progress is not None:
        progress.remove_task(task)
    span = dues[-1]
    return {
        "speed": speed,
        "profile": profile.describe() if profile is not None else None,
        "salt": salt,
        "summary": {
            **summarize(results, ttft_slo_s, tbt_slo_s, span, wall),
            "prediction_parts": parts,
            "handoffs": handoffs,
        },
        "phases": phase_summaries(results, phases, ttft_slo_s, tbt_slo_s),
        "requests": [asdict(r) for r in results],
    }


def phase_summaries(
    results: list[RequestResult], phases: list[tuple[float, float, float]] | None, ttft_slo_s: float, tbt_slo_s: float
) -> list[dict] | None:
    """A step profile's phases (level, start, end), each with the summary of the requests scheduled in it (``level``,
    ``start_s``, ``end_s``, ``summary``); None without phases."""
    if not phases:
        return None
    out = []
    for i, (level, start, end) in enumerate(phases):
        last = i == len(phases) - 1
        part = [r for r in results if start <= r.scheduled_s < end or (last and r.scheduled_s >= end)]
        span = end - start
        summary = summarize(part, ttft_slo_s, tbt_slo_s, span, span) if part else {"requests": 0}
        out.append({"level": level, "start_s": start, "end_s": end, "summary": summary})
    return out


def describe_phases(run: dict) -> list[str]:
    """A line per phase of a step profile's run: its level, admitted, refused, good and how the quotes came out."""
    lines = []
    for p in run.get("phases") or ():
        s = p["summary"]
        if not s["requests"]:
            lines.append(f"{p['level']:g}x: no request")
            continue
        admitted = s["requests"] - s["rejected"]
        lines.append(
            f"{p['level']:g}x ({p['start_s']:.0f}-{p['end_s']:.0f} s): {s['requests']} sent, {admitted} admitted, "
            f"{s['rejected']} refused, {s['errors']} errors, {s['effective']} within both SLOs, TTFT p90 "
            f"{_ms(s['ttft_p90_s'])} ms"
            + (
                f"; TTFT quotes within 25%: {describe_predictions(s, short=True)}"
                if s.get("predicted_requests")
                else ""
            )
        )
    return lines


def summarize(results: list[RequestResult], ttft_slo_s: float, tbt_slo_s: float, span_s: float, wall_s: float) -> dict:
    """Counts, percentiles (over completed requests), SLO attainment (effective / all), cache hits, rates."""
    ok = [r for r in results if r.outcome is Outcome.OK]
    effective = sum(is_effective(r, ttft_slo_s, tbt_slo_s) for r in results)
    known = [r for r in ok if r.cached_tokens is not None]
    ttft, tbt = [r.ttft_s for r in ok], [r.tbt_s for r in ok]
    out = {
        "requests": len(results),
        "completed": len(ok),
        "rejected": sum(r.outcome is Outcome.REJECTED for r in results),
        "errors": sum(r.outcome is Outcome.ERROR for r in results),
        "effective": effective,
        "slo_attainment": effective / len(results) if results else 0.0,
        "ttft_slo_s": ttft_slo_s,
        "tbt_slo_s": tbt_slo_s,
        "prompt_tokens": sum(r.prompt_tokens for r in ok),
        "cached_tokens": sum(r.cached_tokens for r in known) if known else None,
        "cache_hit_ratio": sum(r.cached_tokens for r in known) / max(1, sum(r.prompt_tokens for r in known))
        if known
        else None,
        "output_tokens": sum(r.completion_tokens for r in ok),
        "span_s": span_s,
        "wall_s": wall_s,
        "offered_rate_rps": len(results) / span_s if span_s > 0 else None,
        "throughput_rps": len(ok) / wall_s if wall_s > 0 else None,
        "output_tok_s": sum(r.completion_tokens for r in ok) / wall_s if wall_s > 0 else None,
        "send_lateness_max_s": max((r.sent_s - r.scheduled_s for r in results), default=0.0),
        "first_error": next((r.error for r in results if r.outcome is Outcome.ERROR), None),
    }
    for q in (50, 90, 99):
        out[f"ttft_p{q}_s"], out[f"tbt_p{q}_s"] = percentile(ttft, q), percentile(tbt, q)
    out["ttft_mean_s"] = float(np.mean(ttft)) if ttft else None
    out.update(prediction_errors(ok))
    return out


def prediction_errors(ok: list[RequestResult], within: float = PREDICTION_WITHIN) -> dict:
    """How the server's TTFT predictions (where it gave them) came out against the TTFTs measured here: the signed
    relative error (predicted - measured) / measured at percentiles (below 0: predicted too short), and the share of
    requests predicted within ``within`` of their TTFT."""
    errors = sorted(
        (r.predicted_ttft_s - r.ttft_s) / r.ttft_s for r in ok if r.predicted_ttft_s is not None and r.ttft_s
    )
    if not errors:
        return {"predicted_requests": 0}
    out: dict = {
        "predicted_requests": len(errors),
        "prediction_within": within,
        "prediction_within_share": sum(abs(e) <= within for e in errors) / len(errors),
    }
    for q in (10, 50, 90):
        out[f"prediction_error_p{q}"] = percentile(errors, q)
    return out


def effective_capacity(points: list[dict], target: float = DEFAULTS["effective_target"]) -> dict:
    """The highest rate factor at which it and every lower factor have ``slo_attainment >= target``.

    ``points`` are sweep runs (``rate_factor``, ``summary.slo_attainment``,
    ``summary.offered_rate_rps``). Returns ``rate_factor`` and ``rate_rps`` (None when even
    the lowest factor misses the target) and ``saturated`` (True when every factor met it:
    the capacity is at least that, the sweep did not reach the limit).
    """
    best = None
    ordered = sorted(points, key=lambda p: p["rate_factor"])
    for p in ordered:
        if p["summary"]["slo_attainment"] < target:
            break
        best = p
    return {
        "target": target,
        "rate_factor": best["rate_factor"] if best else None,
        "rate_rps": best["summary"]["offered_rate_rps"] if best else None,
        "saturated": best is not None and best is ordered[-1],
    }


def sweep(
    requests: list[TraceRequest],
    url: str,
    model: str,
    factors: list[float],
    *,
    speed: float = 1.0,
    effective_target: float = DEFAULTS["effective_target"],
    progress: Progress | None = None,
    label: str = "replay",
    on_run=None,
    **kwargs,
) -> dict:
    """One ``replay`` per rate factor (speed * f, factor k in increasing order salted with k); ``runs`` and
    ``capacity``.

    ``on_run(run)`` is called after each rate (to log it); ``kwargs`` go to ``replay``.
    """
    if not factors or min(factors) <= 0:
        raise ValueError(f"rate factors must be positive, got {factors}")
    runs = []
    for k, f in enumerate(sorted(factors)):
        run = replay(
            requests, url, model, speed=speed * f, salt=k, progress=progress, label=f"{label} x{f:g}", **kwargs
        )
        run["rate_factor"] = f
        runs.append(run)
        if on_run is not None:
            on_run(run)
    return {"runs": runs, "capacity": effective_capacity(runs, effective_target)}


def warm_up(url: str, model: str, vocab_size: int, api_key: str | None = None, timeout_s: float = 300.0) -> float:
    """One short request (not counted) so first-call costs stay out of the replay; its wall seconds. RuntimeError if it
    fails."""
    r = RequestResult(-1, 0.0, 0.0, 64, 4)
    prompt = [random.Random(f"warmup/{i}").randrange(MIN_TOKEN_ID, vocab_size) for i in range(64)]

    async def go() -> None:
        async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=10.0), trust_env=False) as client:
            await _send(client, _base_url(url), _body(model, prompt, 4), _headers(api_key), r, time.perf_counter())

    t0 = time.perf_counter()
    asyncio.run(go())
    if r.outcome is not Outcome.OK:
        raise RuntimeError(f"the warm-up request failed: {r.error}")
    return time.perf_counter() - t0


# -- output -------------------------------------------------------------------------------------------------


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1e3:,.0f}"


def _share(v: float | None) -> str:
    return "-" if v is None else f"{v:.1%}"


def render(runs: list[dict], console: Console, title: str, caption: str | None = None) -> None:
    """A table of runs, one row each (labelled by ``label`` or the rate factor)."""
    table = Table(title=title, caption=caption)
    for col in (
        "run",
        "req/s",
        "done",
        "429",
        "err",
        "SLO met",
        "TTFT p50",
        "p90",
        "p99",
        "TBT p50",
        "p90",
        "p99",
        "cache hit",
        "out tok/s",
        "TTFT pred. ±25%",
    ):
        table.add_column(col, justify="left" if col == "run" else "right")
    for run in runs:
        s = run["summary"]
        rate = "-" if s["offered_rate_rps"] is None else f"{s['offered_rate_rps']:.2f}"
        table.add_row(
            run.get("label") or f"x{run.get('rate_factor', 1):g}",
            rate,
            f"{s['completed']}/{s['requests']}",
            str(s["rejected"]),
            str(s["errors"]),
            _share(s["slo_attainment"]),
            _ms(s["ttft_p50_s"]),
            _ms(s["ttft_p90_s"]),
            _ms(s["ttft_p99_s"]),
            _ms(s["tbt_p50_s"]),
            _ms(s["tbt_p90_s"]),
            _ms(s["tbt_p99_s"]),
            _share(s["cache_hit_ratio"]),
            "-" if s["output_tok_s"] is None else f"{s['output_tok_s']:.1f}",
            describe_predictions(s, short=True),
        )
    console.print(table)


def describe_predictions(s: dict, short: bool = False) -> str:
    """The TTFT predictions of a run's summary: the share within 25% (and, unless ``short``, the error percentiles)."""
    if not s.get("predicted_requests"):
        return "-" if short else "no TTFT predictions (not a mooncake cluster)"
    share = _share(s["prediction_within_share"])
    if short:
        return share
    parts = s.get("prediction_parts")
    return (
        f"TTFT predicted within {s['prediction_within']:.0%} for {share} of {s['predicted_requests']}; error "
        f"(predicted - measured) / measured p10 {s['prediction_error_p10']:+.0%}, p50 "
        f"{s['prediction_error_p50']:+.0%}, p90 {s['prediction_error_p90']:+.0%}"
    ) + (f"; by part (the Conductor's scores): {describe_parts(parts)}" if parts else "")


def describe_capacity(capacity: dict) -> str:
    if capacity["rate_factor"] is None:
        return f"effective request capacity: below the lowest rate tried (< {capacity['target']:.0%} effective there)"
    more = " (every rate met the target: the capacity is at least this)" if capacity["saturated"] else ""
    return (
        f"effective request capacity: rate x{capacity['rate_factor']:g} = {capacity['rate_rps']:.2f} req/s "
        f"(>= {capacity['target']:.0%} effective){more}"
    )


def plot(
    path: Path,
    cdf_runs: dict[str, dict],
    sweeps: dict[str, list[dict]],
    ttft_slo_s: float,
    tbt_slo_s: float,
    target: float,
    title: str,
) -> None:
    """A PNG: TTFT and TBT CDFs (one line per ``cdf_runs`` entry) and, if any sweep has 2+ rates, effective share vs
    rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with_sweep = any(len(runs) > 1 for runs in sweeps.values())
    fig, axes = plt.subplots(1, 3 if with_sweep else 2, figsize=(16 if with_sweep else 11, 4.5))
    panels = (
        (axes[0], "ttft_s", ttft_slo_s, "TTFT (s)"),
        (axes[1], "tbt_s", tbt_slo_s, "TBT: mean of the longest 10% of gaps (s)"),
    )
    for ax, key, slo, name in panels:
        for label, run in cdf_runs.items():
            values = sorted(r[key] for r in run["requests"] if r["outcome"] == Outcome.OK.value and r[key] is not None)
            if values:
                ax.step(values, np.arange(1, len(values) + 1) / len(run["requests"]), where="post", label=label)
        ax.axvline(slo, color="grey", linestyle="--", linewidth=1, label="SLO")
        ax.set_xlabel(name)
        ax.set_ylabel("share of all requests")
        ax.set_ylim(0, 1.02)
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    if with_sweep:
        ax = axes[2]
        for label, runs in sweeps.items():
            pts = sorted((r["summary"]["offered_rate_rps"] or 0.0, r["summary"]["slo_attainment"]) for r in runs)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
        ax.axhline(target, color="grey", linestyle="--", linewidth=1, label=f"target {target:.0%}")
        ax.set_xlabel("offered request rate (req/s)")
        ax.set_ylabel("effective requests / all")
        ax.set_ylim(0, 1.02)
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    width = 190 if with_sweep else 130  # characters a title line holds at fontsize 9
    fig.suptitle("\n".join(textwrap.fill(line, width) for line in title.splitlines()), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def factor_list(text: str) -> list[float]:
    try:
        out = sorted({float(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad rate factors {text!r}; use e.g. 0.5,1,2,4") from None
    if not out or out[0] <= 0:
        raise argparse.ArgumentTypeError(f"rate factors must be positive, got {text!r}")
    return out


def rate_profile(text: str) -> RateProfile:
    try:
        return RateProfile.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_trace_args(p: argparse.ArgumentParser) -> None:
    """The flags replay.py and compare.py share: scaling, SLOs, rates."""
    d = DEFAULTS
    p.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help="a Mooncake-format trace (JSON lines)")
    p.add_argument(
        "--speed",
        type=float,
        default=None,
        help=f"time compression: arrival = timestamp / speed (default {d['speed']})",
    )
    p.add_argument(
        "--rate-profile",
        type=rate_profile,
        default=None,
        metavar="PROFILE",
        help="a rate that moves (benchmarks.rate_profile): step:1,3,1 (equal spans at 1x, 3x, 1x the rate) or "
        "day:1,4 (from 1x to 4x and back over the run); default: the trace's own times",
    )
    p.add_argument(
        "--sweep",
        type=factor_list,
        default=None,
        help="rate factors (speed x f each); reports the effective request capacity",
    )
    p.add_argument(
        "--block-tokens",
        type=int,
        default=None,
        help=f"token ids per trace hash id (lengths scale by this / 512; default {d['block_tokens']})",
    )
    p.add_argument(
        "--max-input", type=int, default=None, help=f"longest prompt, in tokens once scaled (default {d['max_input']})"
    )
    p.add_argument(
        "--preset",
        choices=list(PRESETS),
        default="conversation",
        help="the workload's output scaling: "
        + "; ".join(
            f"{k}: outputs x{v['output_scale']:g} clamped to [1, {v['max_output']}]" for k, v in PRESETS.items()
        )
        + " (--output-scale and --max-output override it)",
    )
    p.add_argument(
        "--output-scale",
        type=float,
        default=None,
        help="output tokens = trace output_length x this (default: the preset's)",
    )
    p.add_argument("--max-output", type=int, default=None, help="longest output, in tokens (default: the preset's)")
    p.add_argument("--limit", type=int, default=None, help=f"use the first N records (default {d['limit']})")
    p.add_argument(
        "--no-spread",
        action="store_true",
        help="send the requests of one trace timestamp together (default: spread to the next)",
    )
    p.add_argument("--ttft-slo", type=float, default=None, help=f"seconds (default {d['ttft_slo_s']:g})")
    p.add_argument(
        "--tbt-slo",
        type=float,
        default=None,
        help=f"seconds (the paper's TBT: mean of the longest 10%% of gaps; default {d['tbt_slo_s']:g})",
    )
    p.add_argument(
        "--effective-target",
        type=float,
        default=d["effective_target"],
        help="share of effective requests the capacity needs",
    )
    p.add_argument(
        "--concurrency-limit",
        type=int,
        default=None,
        help="at most N requests in flight (the rest wait: no longer open loop)",
    )
    p.add_argument(
        "--timeout", type=float, default=900.0, help="seconds a request may take before it counts as an error"
    )
    p.add_argument("--json", type=Path, help="write every per-request number and the command line to this file")
    p.add_argument("--plot", type=Path, help="write a PNG: TTFT/TBT CDFs and, with --sweep, effective share vs rate")
    p.add_argument("--no-progress", action="store_true")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], epilog="See the module docstring and benchmarks/README.md."
    )
    p.add_argument(
        "--url", required=True, help="the server's OpenAI base URL (http://host:port or http://host:port/v1)"
    )
    p.add_argument("--model", required=True, help="the model name the server expects")
    p.add_argument("--model-dir", type=Path, help="the model directory: its config.json gives the vocabulary size")
    p.add_argument("--vocab-size", type=int, default=SMOLLM2_VOCAB, help="without --model-dir (default: SmolLM2's)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--no-warmup", action="store_true", help="skip the one short request (not counted) sent first")
    add_trace_args(p)
    args = p.parse_args(argv)
    apply_preset(args)
    speed, limit = args.speed or DEFAULTS["speed"], args.limit or DEFAULTS["limit"]
    vocab = vocab_size_of(args.model_dir) if args.model_dir else args.vocab_size
    console = Console(width=None if sys.stdout.isatty() else 170, log_path=False)
    try:
        requests, scaling = trace_from_args(args, vocab, limit)
    except (OSError, ValueError, KeyError) as e:
        p.error(f"cannot read the trace: {e}")
    console.print(
        f"{len(requests)} requests; {scaling.describe(speed)}; SLOs TTFT {args.ttft_slo} s, TBT {args.tbt_slo} s"
    )
    if not args.no_warmup:
        try:
            warm_up(args.url, args.model, vocab, args.api_key)
        except RuntimeError as e:
            console.print(f"[red]{e}[/] (is the server at {args.url} up, serving {args.model!r}?)")
            return 2
    common = dict(
        ttft_slo_s=args.ttft_slo,
        tbt_slo_s=args.tbt_slo,
        concurrency_limit=args.concurrency_limit,
        api_key=args.api_key,
        timeout_s=args.timeout,
        profile=args.rate_profile,
    )
    with make_progress(console, args.no_progress) as progress:
        result = sweep(
            requests,
            args.url,
            args.model,
            args.sweep or [1.0],
            speed=speed,
            effective_target=args.effective_target,
            progress=progress,
            **common,
        )
    title = f"replay of {args.trace.name} against {args.url} ({args.model})"
    render(
        result["runs"], console, title, caption=scaling.describe(speed) + "; ms; percentiles over completed requests"
    )
    for run in result["runs"]:
        if run["summary"].get("predicted_requests"):
            console.print(f"x{run.get('rate_factor', 1):g}: {describe_predictions(run['summary'])}")
    if args.sweep:
        console.print(describe_capacity(result["capacity"]))
    if args.json:
        data = {
            "command": shlex.join([sys.executable, *sys.argv]),
            "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "url": args.url,
            "model": args.model,
            "scaling": asdict(scaling)
            | {"speed": speed, "length_factor": scaling.length_factor, "description": scaling.describe(speed)},
            **result,
        }
        args.json.write_text(json.dumps(data, indent=1) + "\n")
        console.print(f"per-request numbers written to {args.json}")
    if args.plot:
        plot(
            args.plot,
            {f"x{r['rate_factor']:g}": r for r in result["runs"]},
            {"replay": result["runs"]},
            args.ttft_slo,
            args.tbt_slo,
            args.effective_target,
            title + "\n" + scaling.describe(speed),
        )
        console.print(f"plot written to {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
