"""One simulated run and its summary, table and plot: what the CLI (benchmarks.sim.cli), the paper's experiments
(benchmarks.sim.paper) and the local-prefill comparison (benchmarks.sim.local_compare) run. Metrics: see cli.py."""

from __future__ import annotations

import math
import time
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from benchmarks.benchutil import percentile
from benchmarks.rate_profile import RateProfile
from benchmarks.replay import describe_predictions, prediction_errors
from benchmarks.sim.autoscale import make_scaler
from benchmarks.sim.model import load_trace
from benchmarks.trace import DEFAULT_TRACE
from conductor.planner.state import REJECTED_AT_DECODE, Record, SimConfig
from conductor.planner.twin import Cluster

EVICTIONS = ("lru", "lfu", "length")


def simulate(
    config: SimConfig,
    trace: Path = DEFAULT_TRACE,
    speed: float = 1.0,
    limit: int | None = None,
    progress: bool = False,
    console: Console | None = None,
    requests=None,
    profile: RateProfile | None = None,
    autoscale: str = "none",
) -> dict:
    """Run one simulation; return its summary (``summarize``) with the per-request records under ``"_records"``.

    ``requests`` (a list from ``load_trace``) skips reading the trace again; ``profile`` re-times the trace
    (benchmarks.rate_profile); ``autoscale`` sizes the pools as it runs: none, planner or queue
    (benchmarks.sim.autoscale).
    """
    if requests is None:
        requests = load_trace(trace, speed, limit, profile)
    start = time.perf_counter()
    scaler = make_scaler(autoscale)
    cluster = Cluster(config, requests, autoscaler=scaler, observer=getattr(scaler, "planner", None))
    if progress:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        with Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=console,
            transient=True,
        ) as bar:
            task = bar.add_task(f"{config.policy.value}/{config.admission.value}", total=len(requests))
            records = cluster.run(lambda n: bar.update(task, completed=n))
    else:
        records = cluster.run()
    summary = summarize(cluster, records, time.perf_counter() - start)
    summary["_records"] = records
    return summary


def summarize(cluster: Cluster, records: list[Record], wall_s: float) -> dict:
    """Every number the table, the JSON and the tests use (plain floats and ints); the TTFT predictions of the served
    requests scored as replay.py scores a real cluster's (``prediction_errors``: ``prediction_within_share``,
    ``prediction_error_p10`` / ``p50`` / ``p90``)."""
    cfg = cluster.config
    done = [r for r in records if not math.isnan(r.finish)]
    ttft = np.array([r.ttft_s for r in done])
    tbt = np.array([r.tbt_s for r in done])
    ok = int(np.count_nonzero((ttft <= cfg.ttft_slo_s) & (tbt <= cfg.tbt_slo_s)))
    rejected: dict[str, int] = {}
    for r in records:
        if r.rejected is not None:
            rejected[r.rejected] = rejected.get(r.rejected, 0) + 1
    prefilled = [r for r in records if not math.isnan(r.prefill_end)]
    wasted = [r for r in prefilled if r.rejected == REJECTED_AT_DECODE]
    key_blocks = sum(len(r.req.keys) for r in prefilled)
    reused = sum(r.local_blocks + r.fetched_blocks for r in prefilled)
    end = max([r.finish for r in done] + [r.prefill_end for r in prefilled] + [0.0])
    busy = sum(p.busy_s for p in cluster.prefills)
    predicted = np.array([r.predicted_ttft_s for r in prefilled])
    actual = np.array([r.prefill_end - r.req.arrival_s for r in prefilled])
    steps = sum(d.steps for d in cluster.decodes)
    seconds = cluster.instance_seconds(end)
    return {
        "instance_s": sum(seconds.values()),  # every instance from when it was asked for (elastic runs: its start)
        "scalings": len(cluster.scalings),
        "requests": len(records),
        "served": len(done),
        "rejected": sum(rejected.values()),
        "rejected_by_reason": dict(sorted(rejected.items())),
        "rejected_after_prefill": len(wasted),
        "wasted_prefill_s": sum(r.load_s + r.compute_s for r in wasted),
        "ttft_mean_s": float(ttft.mean()) if len(ttft) else math.nan,
        "ttft_p50_s": percentile(ttft, 50, empty=math.nan),
        "ttft_p90_s": percentile(ttft, 90, empty=math.nan),
        "ttft_p99_s": percentile(ttft, 99, empty=math.nan),
        "tbt_mean_s": float(tbt.mean()) if len(tbt) else math.nan,
        "tbt_p90_s": percentile(tbt, 90, empty=math.nan),
        "tbt_p99_s": percentile(tbt, 99, empty=math.nan),
        "slo_ok": ok,
        "slo_attainment": ok / len(records) if records else math.nan,
        "slo_attainment_served": ok / len(done) if done else math.nan,
        "hit_ratio": reused / key_blocks if key_blocks else 0.0,
        "key_blocks": key_blocks,
        "reused_blocks": reused,
        "fetched_blocks": sum(r.fetched_blocks for r in prefilled),
        "ssd_blocks_read": sum(r.ssd_blocks for r in prefilled),
        "prefill_compute_s": sum(r.compute_s for r in prefilled),
        "prefill_load_s": sum(r.load_s for r in prefilled),
        "prefill_utilization": busy / (end * len(cluster.prefills)) if end else 0.0,
        "ttft_prediction_error_mean_s": float(np.mean(predicted - actual)) if len(actual) else math.nan,
        "ttft_prediction_abs_error_mean_s": float(np.mean(np.abs(predicted - actual))) if len(actual) else math.nan,
        "decode_steps": steps,
        "decode_mean_step_s": float(sum(d.durations[: d.steps].sum() for d in cluster.decodes) / steps)
        if steps
        else 0.0,
        "decode_peak_batch": max(d.peak_batch for d in cluster.decodes),
        "local_prefills": sum(1 for r in records if r.decision is not None and r.decision.local),
        "evictions": sum(c.evictions for c in cluster.caches.values()),
        "simulated_s": end,
        "events": cluster.events,
        "wall_s": wall_s,
        **prediction_errors(done),  # a Record has the predicted_ttft_s and ttft_s it reads
    }


def records_json(records: list[Record]) -> dict[str, list]:
    """Per-request raw numbers, column by column (NaN -> null)."""

    def col(f):
        return [None if isinstance(v, float) and math.isnan(v) else v for v in map(f, records)]

    return {
        "arrival_s": col(lambda r: r.req.arrival_s),
        "prompt_tokens": col(lambda r: r.req.prompt_tokens),
        "output_tokens": col(lambda r: r.req.output_tokens),
        "key_blocks": col(lambda r: len(r.req.keys)),
        "prefill": col(lambda r: r.decision.prefill if r.decision else None),
        "decode": col(lambda r: r.decision.decode if r.decision else None),
        "rejected": col(lambda r: r.rejected),
        "predicted_ttft_s": col(lambda r: r.predicted_ttft_s if r.decision else None),
        "prefill_start_s": col(lambda r: r.prefill_start),
        "prefill_end_s": col(lambda r: r.prefill_end),
        "local_blocks": col(lambda r: r.local_blocks),
        "fetched_blocks": col(lambda r: r.fetched_blocks),
        "ssd_blocks": col(lambda r: r.ssd_blocks),
        "load_s": col(lambda r: r.load_s),
        "compute_s": col(lambda r: r.compute_s),
        "first_token_s": col(lambda r: r.first_token),
        "finish_s": col(lambda r: r.finish),
        "tbt_s": col(lambda r: r.tbt_s),
    }


def config_json(cfg: SimConfig) -> dict:
    d = {
        k: getattr(cfg, k)
        for k in (
            "prefill",
            "decode",
            "group_size",
            "pipeline_groups",
            "prefill_chunk",
            "cache_blocks",
            "ssd_blocks",
            "eviction",
            "ttft_slo_s",
            "tbt_slo_s",
            "tbt_headroom",
            "threshold",
            "tier_aware",
            "seed",
            "tick_s",
            "heartbeat_s",
            "calibrate",
            "step_budget",
            "local_chunk",
            "local_max_load",
        )
    }
    d["policy"], d["admission"], d["decode_forecast"] = cfg.policy.value, cfg.admission.value, cfg.decode_forecast.value
    d["local_prefill"] = cfg.local_prefill.value
    d["model"] = {**{k: getattr(cfg.model, k) for k in cfg.model.__dataclass_fields__}, **cfg.model.describe()}
    d["predictor_priors"] = cfg.predictors.model_dump()
    return d


def public(summary: dict) -> dict:
    return {k: v for k, v in summary.items() if not k.startswith("_")}


# -- output ----------------------------------------------------------------------------------------


def _s(v: float) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.2f}"


def _pct_signed(v: float | None) -> str:
    return "-" if v is None else f"{v:+.0%}"


def run_table(summary: dict, cfg: SimConfig) -> Table:
    t = Table(
        title=f"{cfg.policy.value} / {cfg.admission.value}: {cfg.prefill}P + {cfg.decode}D, "
        f"SLO TTFT {cfg.ttft_slo_s} s, TBT {cfg.tbt_slo_s} s"
    )
    t.add_column("measure")
    t.add_column("value", justify="right")
    rows = [
        ("requests / served", f"{summary['requests']} / {summary['served']}"),
        (
            "TTFT mean / p50 / p90 / p99 (s)",
            " / ".join(_s(summary[k]) for k in ("ttft_mean_s", "ttft_p50_s", "ttft_p90_s", "ttft_p99_s")),
        ),
        (
            "TBT mean / p90 / p99 (ms)",
            " / ".join(_s(summary[k] * 1e3) for k in ("tbt_mean_s", "tbt_p90_s", "tbt_p99_s")),
        ),
        (
            "SLO attainment (of all / of served)",
            f"{summary['slo_attainment']:.1%} / {summary['slo_attainment_served']:.1%}",
        ),
        ("rejected", f"{summary['rejected']} " + (str(summary["rejected_by_reason"]) if summary["rejected"] else "")),
        (
            "rejected after prefill (wasted prefill s)",
            f"{summary['rejected_after_prefill']} ({summary['wasted_prefill_s']:.0f} s)",
        ),
        (
            "cache hit ratio (reused / key blocks)",
            f"{summary['hit_ratio']:.1%} ({summary['reused_blocks']} / {summary['key_blocks']})",
        ),
        ("fetched blocks / SSD blocks read", f"{summary['fetched_blocks']} / {summary['ssd_blocks_read']}"),
        (
            "prefill compute s (utilization)",
            f"{summary['prefill_compute_s']:.0f} ({summary['prefill_utilization']:.0%})",
        ),
        (
            "Conductor's TTFT prediction error to prefill end (mean, |mean|)",
            f"{summary['ttft_prediction_error_mean_s']:+.2f} s, {summary['ttft_prediction_abs_error_mean_s']:.2f} s",
        ),
        ("TTFT predicted within 25% (of served; replay.py's figure)", describe_predictions(summary, short=True)),
        (
            "TTFT prediction error (predicted - measured) / measured p10 / p50 / p90",
            " / ".join(_pct_signed(summary.get(f"prediction_error_p{q}")) for q in (10, 50, 90)),
        ),
        (
            "decode steps, mean step, peak batch",
            f"{summary['decode_steps']}, {summary['decode_mean_step_s'] * 1e3:.1f} ms, {summary['decode_peak_batch']}",
        ),
        ("simulated s / wall s", f"{summary['simulated_s']:.0f} / {summary['wall_s']:.1f}"),
    ]
    for row in rows:
        t.add_row(*row)
    return t


def plot_run(summary: dict, cfg: SimConfig, path: Path, console: Console) -> None:
    plt = _pyplot(console)
    if plt is None:
        return
    records = summary["_records"]
    done = [r for r in records if not math.isnan(r.finish)]
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(16, 4.5))
    a.scatter([r.req.arrival_s for r in done], [r.ttft_s for r in done], s=2)
    a.set(xlabel="arrival (simulated s)", ylabel="TTFT (s)", title="TTFT by arrival (red: SLO)")
    a.axhline(cfg.ttft_slo_s, color="red", lw=0.8)
    for ax, values, slo, name in (
        (b, [r.ttft_s for r in done], cfg.ttft_slo_s, "TTFT (s)"),
        (c, [r.tbt_s * 1e3 for r in done], cfg.tbt_slo_s * 1e3, "TBT (ms)"),
    ):
        v = np.sort(values)
        ax.plot(v, np.arange(1, len(v) + 1) / max(1, len(v)))
        ax.axvline(slo, color="red", lw=0.8)
        ax.set(xlabel=name, ylabel="share of served requests", title=f"{name.split()[0]} CDF (red: SLO)")
    b.set_xscale("symlog")
    fig.suptitle(f"{cfg.policy.value} / {cfg.admission.value}, {cfg.prefill}P + {cfg.decode}D")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    console.print(f"plot written to {path}")


def _pyplot(console: Console):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        console.print(
            "[yellow]--plot needs matplotlib, which is not installed: .venv/bin/pip install matplotlib[/yellow]"
        )
        return None
    return plt


# -- command line --------------------------------------------------------------------------------
