"""Soak: the conversation trace at x1 of the cluster's capacity for a long time; what grows while nothing should.

    python -m benchmarks.soak [--minutes 60] [--every-s 60] [--warmup-windows 1] [--load 1.0] [--quick]
        [--model smollm2-135m|DIR] [--prefill 2] [--decode 2] [--json PATH] [--no-progress]

1. A LocalCluster starts as benchmarks/chaos.py starts it (the Conductor, ``--prefill`` prefill workers each with its
   pool node ``kv{i}``, ``--decode`` decode workers, the gateway; one torch thread each; the launcher restarts a
   component that dies), the SLOs and the pool (1 GiB of DRAM a node) at their defaults: from the first loop on the
   pool is full and evicts, so the soak runs through eviction.
2. The first ``--records`` requests of the conversation trace, scaled as ``benchmarks.replay`` scales them, are sent
   open loop through a ``ClusterBackend`` in this process at ``--load`` x the trace's default speed (x1: the rate
   benchmarks/README.md measured as this cluster's capacity), greedy, ``ignore_eos``. The trace is replayed in loops
   until ``--minutes`` have passed; loop k salts the prompts' token mapping with k (``TraceRequest.prompt(salt=k)``),
   so every loop is the same load, with the trace's own sharing inside it, and none is served from the last one's
   cache. Refusals (``Rejected``, 429) are counted apart from failures.
3. Every ``--every-s`` a sample closes a window: for each component process and this one, RSS (VmRSS), its private
   part (RssAnon) and the open descriptors (/proc); from the pool nodes' /metrics their stored (used), reserved
   blocks, leases and evictions; from the decode workers' /metrics their reserved cache blocks and running requests;
   from the Conductor's ListInstances its index (distinct blocks, and blocks per pool node) and each decode engine's
   free blocks (its last heartbeat: used = the engine's ``num_kv_blocks`` - free); the CPU time other processes took
   (a shared machine); and TTFT and TBT (the paper's: the mean of a request's longest 10% of token gaps) p50 / p99 of
   the requests that finished in the window.
4. At ``--minutes`` nothing more is sent; once the last requests finished and the workers report nothing running, a
   few seconds later, a last sample (idle).

Reported: a table per window, and each series' growth from the first window after the ``--warmup-windows`` to the
last window under load. Goals: private RSS (RssAnon: VmRSS also counts the pool's and the engines' shared memory,
which fills as blocks are first written, a cache and not a leak; VmRSS is printed beside it) and descriptors of every
process grow under 5%; when idle, 0 leases, 0 reserved blocks in the pool and the decode engines, and 0 decode engine
blocks in use; the Conductor's index within 1% of the pool's stored blocks, node by node summed (idle: under load the
pool and the index are read a moment apart, and a decode engine's free blocks are a heartbeat old); TTFT p99 of the
last window at most 20% above the first's. See benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import shlex
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import grpc
import httpx
import torch
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console
from rich.table import Table

from benchmarks import trace as tr
from benchmarks.benchutil import (
    describe_machine,
    git_state,
    log_console,
    make_progress,
    percentile,
    resolve_model,
    run_interruptible,
    shielded,
)
from benchmarks.chaos import CpuMeter, make_backend
from benchmarks.replay import tail_tbt
from decode.config import DECODE_ENGINE_DEFAULTS
from mooncake import tls
from mooncake.cluster.config import ClusterConfig
from mooncake.cluster.launcher import LocalCluster
from mooncake.engine.tokenizer import Tokenizer
from mooncake.serving.types import BackendError, GenerationRequest, Rejected
from protos import conductor_pb2 as cpb
from protos import conductor_pb2_grpc as cpb_grpc

log = logging.getLogger("soak")

MODEL_NAME = "soak"
THIS_PROCESS = "bench"  # this process's row: the ClusterBackend (the gateway's code) runs here
IDLE_TIMEOUT_S = 60.0  # the longest wait for the workers to report nothing running at the end
IDLE_SETTLE_S = 5.0  # then this long, for the last heartbeats, write-behind puts and lease expiries
GROWTH_GOAL = 0.05  # RSS and descriptors: growth after warm-up under 5%
INDEX_GOAL = 0.01  # the Conductor's index within 1% of the pool
TTFT_GOAL = 0.20  # TTFT p99 of the last window at most 20% above the first's
# the metrics behind the pool's and the decode workers' series (after mooncake_pool_ and mooncake_decode_)
POOL_SERIES = {"used": "used_blocks", "reserved": "reserved_blocks", "leases": "leases", "evictions": "evictions_total"}
DECODE_SERIES = {"reserved": "reserved_cache_blocks", "running": "running_requests", "in_prefill": "in_prefill"}


# -- the load ------------------------------------------------------------------------------------


@dataclass(slots=True)
class RequestRecord:
    """One request: when it was sent and ended (seconds after the start), what came back."""

    request_id: str
    loop: int
    sent_s: float
    end_s: float = 0.0
    outcome: str = "pending"  # ok, refused (429 before any token), failed
    tokens: int = 0
    ttft_s: float | None = None
    tbt_s: float | None = None  # the paper's TBT: mean of the longest 10% of its token gaps
    error: str = ""


def trace_loop(records: int, vocab: int) -> tuple[list[tr.TraceRequest], float]:
    """The first ``records`` requests of the conversation trace, scaled as ``benchmarks.replay`` scales it, and one
    loop's length in trace seconds (the last arrival plus one mean gap, so loops follow each other at the trace's
    rate)."""
    scaled = tr.load_trace(tr.DEFAULT_TRACE, limit=records, vocab_size=vocab, **tr.PRESETS["conversation"])
    first, last = scaled[0].arrival_s, scaled[-1].arrival_s
    return scaled, (last - first) * len(scaled) / max(1, len(scaled) - 1)


def arrivals(trace: list[tr.TraceRequest], period_s: float, speed: float, duration_s: float):
    """(loop, request, seconds after the start it is sent) for the trace replayed in loops, until ``duration_s``."""
    loop, first = 0, trace[0].arrival_s
    while True:
        for t in trace:
            at = (loop * period_s + t.arrival_s - first) / speed
            if at >= duration_s:
                return
            yield loop, t, at
        loop += 1


async def send_load(cluster: LocalCluster, schedule, t0: float, records: list[RequestRecord], drain_s: float) -> None:
    """Send each request of ``schedule`` (``arrivals``) at its time after ``t0``, open loop; then wait up to ``drain_s``
    for the requests in flight (those still going are cancelled and count as failed). Appends to ``records``."""
    backend = make_backend(cluster)
    inflight: set[asyncio.Task] = set()

    async def one(req: GenerationRequest, rec: RequestRecord) -> None:
        sent, times = time.perf_counter(), []
        try:
            async for chunk in backend.generate(req):
                times.extend([time.perf_counter()] * len(chunk.token_ids))
            rec.outcome = "ok"
        except Rejected as e:  # 429: turned away before any work unless tokens came first
            rec.outcome, rec.error = ("refused" if not times else "failed"), f"Rejected: {e.message}"
        except BackendError as e:
            rec.outcome, rec.error = "failed", f"{type(e).__name__}: {e.message}"
            log.warning("%s failed after %d tokens: %s", req.request_id, len(times), rec.error)
        except asyncio.CancelledError:
            rec.outcome, rec.error = "failed", f"still running {drain_s:.0f} s after the load ended"
        except Exception as e:  # a bug, not a fault to outlive: record it, keep the soak going
            rec.outcome, rec.error = "failed", f"unexpected {type(e).__name__}: {e}"
            log.exception("request %s", req.request_id)
        rec.end_s, rec.tokens = time.perf_counter() - t0, len(times)
        if rec.outcome == "ok" and times:
            rec.ttft_s = times[0] - sent
            rec.tbt_s = tail_tbt([b - a for a, b in zip(times, times[1:])])

    try:
        for loop, t, at in schedule:
            await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
            rid = f"soak-{loop}-{t.index}"
            req = GenerationRequest.of(rid, t.prompt(salt=loop), t.max_tokens, temperature=0.0, ignore_eos=True)
            rec = RequestRecord(rid, loop, time.perf_counter() - t0)
            records.append(rec)
            task = asyncio.create_task(one(req, rec), name=rid)
            inflight.add(task)
            task.add_done_callback(inflight.discard)
    finally:
        if inflight:
            _, late = await asyncio.wait(set(inflight), timeout=drain_s)
            for task in late:
                task.cancel()
            await asyncio.gather(*late, return_exceptions=True)
        await backend.close()


# -- the samples ---------------------------------------------------------------------------------


@dataclass(slots=True)
class ProcessSample:
    """One process's memory and descriptors (/proc/PID/status and /proc/PID/fd)."""

    pid: int
    rss_kib: int  # VmRSS: private and shared pages resident
    anon_kib: int  # RssAnon: the private part, what a leak grows
    fds: int


@dataclass(slots=True)
class Sample:
    """Everything read at one moment, ``at_s`` seconds after the load started."""

    at_s: float
    idle: bool = False
    processes: dict[str, ProcessSample | None] = field(default_factory=dict)  # None: gone, or unreadable
    restarts: dict[str, int] = field(default_factory=dict)
    pool: dict[str, dict[str, float]] = field(default_factory=dict)  # node -> used, reserved, leases, evictions
    decode: dict[str, dict[str, float]] = field(default_factory=dict)  # decode-i -> used, reserved, running
    prefill_inflight: float = 0.0
    index_blocks: int | None = None  # distinct blocks in the Conductor's index (ListInstances)
    indexed: dict[str, int] = field(default_factory=dict)  # pool node -> blocks the index has there
    cpu_machine_s: float = 0.0  # CPU time of the window: the whole machine, and the cluster + this process
    cpu_cluster_s: float = 0.0
    errors: list[str] = field(default_factory=list)


def process_usage(pid: int) -> ProcessSample | None:
    """RSS, its private part and open descriptors of ``pid`` from /proc; None when it is gone."""
    try:
        status = dict(ln.split(":", 1) for ln in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in ln)
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None
    return ProcessSample(pid, int(status["VmRSS"].split()[0]), int(status["RssAnon"].split()[0]), fds)


def scrape(address: str) -> dict[str, float]:
    """A component's /metrics, each sample name summed over its labels (a pool node's tiers)."""
    out: dict[str, float] = {}
    text = httpx.get(f"http://{address}/metrics", timeout=5).text
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def take_sample(
    cluster: LocalCluster, stub: cpb_grpc.ConductorStub, at_s: float, cpu: CpuMeter, idle: bool = False
) -> Sample:
    """Read every series once (called every ``--every-s`` in a thread, and once idle); a source that does not
    answer leaves its series out and an error in ``errors``."""
    sample = Sample(at_s, idle)
    sample.cpu_machine_s, sample.cpu_cluster_s = cpu.stop()
    for name, comp in list(cluster.components.items()):
        sample.processes[name] = process_usage(comp.proc.pid) if comp.proc is not None else None
        sample.restarts[name] = comp.restarts
        if not (address := comp.info.get("metrics")):
            continue
        try:
            m = scrape(address)
        except (httpx.HTTPError, ValueError) as e:
            sample.errors.append(f"{name} /metrics: {type(e).__name__}: {e}")
            continue
        if name.startswith("kv"):
            sample.pool[name] = {k: m.get(f"mooncake_pool_{v}", 0.0) for k, v in POOL_SERIES.items()}
        elif name.startswith("decode-"):
            sample.decode[name] = {k: m.get(f"mooncake_decode_{v}", 0.0) for k, v in DECODE_SERIES.items()}
        elif name.startswith("prefill-"):
            sample.prefill_inflight += m.get("mooncake_prefill_inflight", 0.0)
    sample.processes[THIS_PROCESS] = process_usage(os.getpid())
    try:
        listing = stub.ListInstances(cpb.ListInstancesRequest(), timeout=5)
    except grpc.RpcError as e:
        sample.errors.append(f"ListInstances: {e.code()}")
        return sample
    sample.index_blocks = listing.index_blocks
    for i in listing.instances:
        if i.role == cpb.KVSTORE:
            sample.indexed[i.id] = i.indexed_blocks
        elif i.role == cpb.DECODE and i.id in sample.decode:
            # no metric says it: the engine's blocks less the free ones of its last heartbeat (the launcher leaves
            # num_kv_blocks at the decode worker's default)
            sample.decode[i.id]["used"] = DECODE_ENGINE_DEFAULTS["num_kv_blocks"] - i.load.free_kv_blocks
    return sample


async def wait_idle(cluster: LocalCluster, stub: cpb_grpc.ConductorStub) -> float:
    """Until the workers report nothing running or in prefill (at most IDLE_TIMEOUT_S), then IDLE_SETTLE_S more;
    returns the seconds waited."""
    start = time.perf_counter()
    while time.perf_counter() - start < IDLE_TIMEOUT_S:
        s = await asyncio.to_thread(take_sample, cluster, stub, 0.0, CpuMeter(cluster))
        busy = s.prefill_inflight + sum(d["running"] + d["in_prefill"] for d in s.decode.values())
        if not busy and not s.errors:
            break
        await asyncio.sleep(1.0)
    await asyncio.sleep(IDLE_SETTLE_S)
    return time.perf_counter() - start


# -- windows, growth, goals ----------------------------------------------------------------------


def window_row(number: int | str, before: Sample, after: Sample, records: list[RequestRecord]) -> dict:
    """One window's figures: the requests that ended between two samples, and the later sample's series."""
    ended = [r for r in records if before.at_s < r.end_s <= after.at_s]
    ok = [r for r in ended if r.outcome == "ok"]
    ttfts, tbts = [r.ttft_s for r in ok if r.ttft_s is not None], [r.tbt_s for r in ok if r.tbt_s is not None]
    procs = {k: v for k, v in after.processes.items() if v is not None}
    row = {
        "window": number,
        "end_s": round(after.at_s, 1),
        "ok": len(ok),
        "refused": sum(r.outcome == "refused" for r in ended),
        "failed": sum(r.outcome == "failed" for r in ended),
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p99_s": percentile(ttfts, 99),
        "tbt_p50_s": percentile(tbts, 50),
        "tbt_p99_s": percentile(tbts, 99),
        "pool_used": sum(p["used"] for p in after.pool.values()),
        "pool_reserved": sum(p["reserved"] for p in after.pool.values()),
        "pool_leases": sum(p["leases"] for p in after.pool.values()),
        "pool_evictions": sum(p["evictions"] for p in after.pool.values()),
        # None when the Conductor did not list a decode worker (its used blocks come from ListInstances)
        "decode_used": sum(d["used"] for d in after.decode.values())
        if all("used" in d for d in after.decode.values())
        else None,
        "decode_reserved": sum(d["reserved"] for d in after.decode.values()),
        "decode_running": sum(d["running"] for d in after.decode.values()),
        "index_blocks": after.index_blocks,
        "index_by_node": sum(after.indexed.values()),
        "cpu_other_s": round(after.cpu_machine_s - after.cpu_cluster_s, 1),
    }
    stored = sum(p["used"] for n, p in after.pool.items() if n in after.indexed)
    if after.index_blocks is None:  # ListInstances did not answer
        row["index_gap"] = None
    else:
        row["index_gap"] = abs(row["index_by_node"] - stored) / stored if stored else float(row["index_by_node"] > 0)
    for name, p in procs.items():
        row[f"{name}.rss_mib"], row[f"{name}.anon_mib"] = round(p.rss_kib / 1024, 1), round(p.anon_kib / 1024, 1)
        row[f"{name}.fds"] = p.fds
    return row


PROCESS_SERIES = ("rss_mib", "anon_mib", "fds")
SHARED_SERIES = (
    "ttft_p50_s ttft_p99_s tbt_p50_s tbt_p99_s pool_used pool_reserved pool_leases pool_evictions decode_used "
    "decode_reserved decode_running index_blocks index_by_node index_gap"
).split()


def growth(first: dict, last: dict) -> list[dict]:
    """Each series from the first window after warm-up to the last under load: both values and the relative
    growth (None where the first is 0 or missing)."""
    names = [*SHARED_SERIES, *(k for k in first if k.split(".")[-1] in PROCESS_SERIES)]
    out = []
    for name in names:
        a, b = first.get(name), last.get(name)
        rel = (b - a) / a if a and b is not None else None
        out.append({"series": name, "first": a, "last": b, "growth": rel})
    return out


def goals(first: dict, last: dict, idle: dict, processes: list[str]) -> list[dict]:
    """The soak's goals, each with its figure and whether it was met."""

    def goal(text: str, figure: str, met: bool) -> dict:
        return {"goal": text, "figure": figure, "met": met}

    out = []
    for name in processes:
        for series, what in (("anon_mib", "private RSS"), ("fds", "descriptors")):
            a, b = first.get(f"{name}.{series}"), last.get(f"{name}.{series}")
            rel = (b - a) / a if a and b is not None else None
            figure = f"{a} -> {b}" + (f" ({rel:+.1%})" if rel is not None else "")
            out.append(
                goal(
                    f"{name} {what} grow under {GROWTH_GOAL:.0%} after warm-up",
                    figure,
                    rel is not None and rel < GROWTH_GOAL,
                )
            )
    left = {k: idle[k] for k in ("pool_leases", "pool_reserved", "decode_reserved")}
    out.append(goal("idle: 0 leases, 0 reserved blocks (pool, decode)", str(left), not any(left.values())))
    out.append(goal("idle: 0 decode engine blocks in use", str(idle["decode_used"]), idle["decode_used"] == 0))
    figure = (
        f"index {idle['index_by_node']} (distinct {idle['index_blocks']}), pool {idle['pool_used']:g}: "
        f"{gap(idle['index_gap'])}"
    )
    met = idle["index_gap"] is not None and idle["index_gap"] <= INDEX_GOAL
    out.append(goal(f"idle: the Conductor's index within {INDEX_GOAL:.0%} of the pool", figure, met))
    a, b = first["ttft_p99_s"], last["ttft_p99_s"]
    figure = f"{a:.2f} s -> {b:.2f} s" if a is not None and b is not None else f"{a} -> {b}"
    met = a is not None and b is not None and b <= a * (1 + TTFT_GOAL)
    out.append(goal(f"TTFT p99 of the last window at most {TTFT_GOAL:.0%} above the first's", figure, met))
    return out


def gap(value: float | None) -> str:
    """A share as a percentage with one decimal, "-" for none."""
    return "-" if value is None else f"{value:.1%}"


def render(report: dict, console: Console) -> None:
    """The windows, the processes' memory, the growth and the goals, as tables."""

    def f(v, digits=0) -> str:
        return "-" if v is None else f"{v:.{digits}f}"

    def slash(r: dict, *keys: str, digits: int = 0) -> str:
        return "/".join(f(r[k], digits) for k in keys)

    rows = report["windows"]
    t = Table(title="per window (requests that ended in it; pool, decode and index at its end)")
    columns = (
        "window|end s|ok/refused/failed|TTFT p50/p99 s|TBT p50/p99 s|pool used/res/leases|evicted|"
        "decode used/res/run|index distinct/by node|gap|CPU others s"
    )
    for col in columns.split("|"):
        t.add_column(col, justify="right")

    for r in rows:
        t.add_row(
            str(r["window"]),
            f(r["end_s"]),
            f"{r['ok']}/{r['refused']}/{r['failed']}",
            slash(r, "ttft_p50_s", "ttft_p99_s", digits=2),
            slash(r, "tbt_p50_s", "tbt_p99_s", digits=3),
            slash(r, "pool_used", "pool_reserved", "pool_leases"),
            f(r["pool_evictions"]),
            slash(r, "decode_used", "decode_reserved", "decode_running"),
            slash(r, "index_blocks", "index_by_node"),
            gap(r["index_gap"]),
            f(r["cpu_other_s"]),
        )
    console.print(t)
    m = Table(title="each process: RSS MiB / private MiB / descriptors")
    names = report["processes"]
    for name in ["window", *names]:
        m.add_column(name, justify="right")
    for r in rows:
        cells = [f"{f(r.get(f'{n}.rss_mib'))}/{f(r.get(f'{n}.anon_mib'))}/{f(r.get(f'{n}.fds'))}" for n in names]
        m.add_row(str(r["window"]), *cells)
    console.print(m)
    g = Table(title=f"growth: window {report['first_window']} (first after warm-up) -> window {report['last_window']}")
    for col in ("series", "first", "last", "growth"):
        g.add_column(col, justify="right" if col != "series" else "left")
    for s in report["growth"]:
        digits = 3 if s["series"].endswith(("_s", "gap")) else 1 if s["series"].endswith("mib") else 0
        rel = "-" if s["growth"] is None else f"{s['growth']:+.1%}"
        g.add_row(s["series"], f(s["first"], digits), f(s["last"], digits), rel)
    console.print(g)
    for goal in report["goals"]:
        mark = "[green]PASS[/]" if goal["met"] else "[red]FAIL[/]"
        console.print(f"{mark} {goal['goal']}: {goal['figure']}")
    totals = report["totals"]
    console.print(
        f"{totals['sent']} requests sent in {totals['loops']} loop(s) of the trace: {totals['ok']} ok, "
        f"{totals['refused']} refused, {totals['failed']} failed; restarts: {report['restarts'] or 'none'}"
    )


# -- the run -------------------------------------------------------------------------------------


def run(args: argparse.Namespace, console: Console) -> dict:
    workdir = Path(tempfile.mkdtemp(prefix="soak-"))
    cluster = None
    channel = None
    try:
        model_dir, model = resolve_model(args, workdir)
        vocab = Tokenizer.from_dir(str(model_dir)).vocab_size
        trace, period = trace_loop(args.records, vocab)
        longest = max(t.prompt_tokens + t.max_tokens for t in trace)
        # max_model_len in 512s, as chaos.py and the tests; SLOs and the pool at their defaults
        config = ClusterConfig(
            model=str(model_dir),
            model_name=MODEL_NAME,
            prefill=args.prefill,
            decode=args.decode,
            port=0,
            threads=args.threads,
            workdir=workdir / "cluster",
            max_model_len=-(-longest // 512) * 512,
            ready_timeout_s=600.0,
        )
        speed, duration = tr.DEFAULTS["speed"] * args.load, args.minutes * 60.0
        report: dict = {
            "command": shlex.join([sys.executable, *sys.argv]),
            "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "machine": describe_machine(torch=torch.__version__, grpc=grpc.__version__),
            "git": git_state(),
            "model": model,
            "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "config": config.model_dump(mode="json"),
            "trace": tr.Scaling(vocab_size=vocab, limit=args.records, **tr.PRESETS["conversation"]).describe(speed),
            "loop_s": period / speed,
            "slo": (config.ttft_slo_s, config.tbt_slo_s),
        }
        console.print(
            f"model {model}; {args.prefill} prefill + {args.decode} decode workers; the first {args.records} "
            f"requests of the trace in loops of {period / speed:.0f} s, open loop at x{args.load:g}, for "
            f"{args.minutes:g} min; a sample every {args.every_s:g} s, {args.warmup_windows} warm-up window(s)"
        )
        records: list[RequestRecord] = []
        samples: list[Sample] = []
        rows: list[dict] = []
        # a window every --every-s; the last one ends with the load (under 1.5 --every-s long)
        times = [args.every_s * k for k in range(1, max(1, round(duration / args.every_s)))] + [duration]
        progress = make_progress(console, args.no_progress)
        with progress:
            task = progress.add_task("starting the cluster", total=len(times) + 1)
            cluster = LocalCluster(config, lambda msg: progress.update(task, description=f"cluster: {msg}"))
            t_start = time.perf_counter()
            cluster.start()
            report["startup_s"] = time.perf_counter() - t_start
            channel = tls.grpc_channel(cluster.conductor_address)
            stub = cpb_grpc.ConductorStub(channel)

            def close_window(sample: Sample) -> None:
                samples.append(sample)
                n = len(samples) - 1
                rows.append(window_row("idle" if sample.idle else n, samples[-2], sample, records))
                r = rows[-1]
                ttft = "-" if r["ttft_p99_s"] is None else f"{r['ttft_p99_s']:.2f} s"
                progress.advance(task)
                progress.update(task, description=f"window {n}: {len(records)} sent")
                console.log(
                    f"window {r['window']} ({r['end_s']:.0f} s): {r['ok']} ok, {r['refused']} refused, {r['failed']} "
                    f"failed; TTFT p99 {ttft}; pool {r['pool_used']:g} used, "
                    f"{r['pool_leases']:g} leases; index gap {gap(r['index_gap'])}; private RSS "
                    f"{sum(v for k, v in r.items() if k.endswith('.anon_mib')):.0f} MiB in all"
                    + (f"; [red]{'; '.join(sample.errors)}[/]" if sample.errors else "")
                )

            async def soak() -> None:
                t0 = time.perf_counter()
                samples.append(await asyncio.to_thread(take_sample, cluster, stub, 0.0, CpuMeter(cluster)))
                drain = config.ttft_slo_s + 120.0
                load = asyncio.create_task(
                    send_load(cluster, arrivals(trace, period, speed, duration), t0, records, drain)
                )
                for at in times:
                    cpu = CpuMeter(cluster)
                    await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
                    if load.done() and load.exception() is not None:
                        raise load.exception()
                    close_window(await asyncio.to_thread(take_sample, cluster, stub, at, cpu))
                cpu = CpuMeter(cluster)
                progress.update(task, description="the last requests, then idle")
                await load
                report["idle_wait_s"] = await wait_idle(cluster, stub)
                close_window(await asyncio.to_thread(take_sample, cluster, stub, time.perf_counter() - t0, cpu, True))

            asyncio.run(soak())
        first, last, idle = rows[args.warmup_windows], rows[-2], rows[-1]
        processes = [n for n in samples[0].processes if samples[-1].processes.get(n) is not None]
        report |= {
            "processes": processes,
            "first_window": first["window"],
            "last_window": last["window"],
            "windows": rows,
            "growth": growth(first, last),
            "goals": goals(first, last, idle, processes),
            "restarts": {k: v for k, v in samples[-1].restarts.items() if v},
            "totals": {
                "sent": len(records),
                "loops": max((r.loop for r in records), default=-1) + 1,
                **{k: sum(r.outcome == k for r in records) for k in ("ok", "refused", "failed")},
            },
            "samples": [asdict(s) for s in samples],
            "requests": [asdict(r) for r in records],
        }
        return report
    finally:
        with shielded():
            if channel is not None:
                channel.close()
            if cluster is not None:
                cluster.stop()
            shutil.rmtree(workdir, ignore_errors=True)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=60.0, help="how long the load runs (default 60)")
    p.add_argument("--every-s", type=float, default=60.0, help="seconds between samples: one window each (default 60)")
    p.add_argument("--warmup-windows", type=int, default=1, help="windows the growth and goals leave out (default 1)")
    p.add_argument("--load", type=float, default=1.0, help="multiple of the trace's default speed, x1 (default 1)")
    p.add_argument("--records", type=int, help=f"trace requests a loop (default {tr.DEFAULTS['limit']}, quick 60)")
    p.add_argument("--quick", action="store_true", help="a smoke run: the tiny random model (unless --model)")
    p.add_argument("--model", default=None, help="a model from the registry (default smollm2-135m) or a directory")
    p.add_argument("--prefill", type=int, default=2, help="prefill workers, each with its pool node (default 2)")
    p.add_argument("--decode", type=int, default=2, help="decode workers (default 2)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker (default 1)")
    p.add_argument("--json", type=Path, help="write every raw number (and the command line) to this file")
    p.add_argument("--log-level", default="WARNING", help="this process's log level")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    if args.records is None:
        args.records = 60 if args.quick else tr.DEFAULTS["limit"]
    windows = max(1, round(args.minutes * 60 / args.every_s)) if args.every_s > 0 else 0
    if args.load <= 0 or args.records < 2 or args.prefill < 1 or args.decode < 1 or args.threads < 1:
        p.error("--load must be > 0, --records >= 2, --prefill, --decode and --threads >= 1")
    if args.warmup_windows < 0 or windows < args.warmup_windows + 2:
        p.error(
            f"--minutes / --every-s gives {windows} window(s): at least --warmup-windows + 2 are needed (a first and a "
            "last window after warm-up)"
        )
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    console = log_console(args.log_level)
    report = run_interruptible(lambda: run(args, console), console)
    if report is None:
        return 130
    render(report, console)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2, default=str) + "\n")
        console.print(f"raw numbers written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
