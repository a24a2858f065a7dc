"""Abort storm: a burst of streams whose clients hang up mid-request; how soon everything held for them is back.

    python -m benchmarks.abort_storm [--quick] [--model smollm2-135m|DIR] [--streams 100] [--prefill 2]
        [--decode 2] [--moments prefill,handoff,decode] [--json PATH] [--no-progress]

Issue 48, item 2 ("abort storms free everything, promptly"), on a LocalCluster (the Conductor, ``--prefill``
prefill workers each with its pool node ``kv{i}``, ``--decode`` decode workers, the gateway; each its own process;
every prompt computed on a prefill worker; the SLOs at their defaults, so part of a storm is refused with 429,
counted apart):

1. **Idle**: before any traffic, what each component's ``/metrics`` says is held (``watched_counts``): per decode
   worker reserved cache blocks, running requests, free landing slots, requests in prefill; per prefill worker
   prefills queued or running; per pool node read leases and slots reserved by uncommitted puts; the gateway's
   running requests, the Conductor's waiting ones. Beside them, out of the goal, what the Conductor counts per
   decode worker (placed in prefill, decoding, landing blocks held): no metric has these, ``ListInstances`` does.
2. A warm-up (not counted; one request per shared prefix puts the prefixes in the pool, so the storm's prefills
   lease or fetch them), then the **undisturbed TTFT**: ``--probes`` requests one at a time through a
   ``ClusterBackend`` (the gateway's code), each a fresh 128-token prompt, greedy, 8 tokens.
3. The **storm**: ``--streams`` HTTP streams to the gateway's ``/v1/completions`` at once, each one of 4 shared
   64-token prefixes and a suffix of 16 to 128 tokens, ``--max-tokens`` tokens, ``ignore_eos``. A third hang up
   0.25 to 0.6 x the undisturbed TTFT after being sent (``prefill``: their prefill waits or runs), a third 0.7 to
   1.1 x (``handoff``: about when their KV crosses), a third after reading ``--events`` chunks (``decode``;
   ``--moments`` picks the kinds, split evenly). The counts are read every 100 ms meanwhile, for the most held.
4. **Release**: from the moment the last client left, every count is read every 20 ms until all are at their
   idle values; per count, when it got back (after 30 s: which were still held). In the mixed storm the decode
   third leaves last, seconds after the others: ``--moments prefill,handoff`` times what those two hold.
5. The **next requests**: ``--after`` requests as in step 2, right after; their TTFT p50 against the undisturbed.

Goals printed: every metric back at idle within 1 s of the last hang-up; the next requests' TTFT p50 within 20%
of the undisturbed p50. ``--json`` writes every raw number, the command line and the machine.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import random
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
from rich.console import Console
from rich.table import Table

from benchmarks.benchutil import describe_machine, make_progress, percentile, resolve_model, run_interruptible, shielded
from benchmarks.chaos import make_backend
from benchmarks.overload_bench import _body, _events, _split
from conductor.local import LocalPrefill
from mooncake import tls
from mooncake.blocks import blocks_for
from mooncake.cluster.config import ClusterConfig
from mooncake.cluster.launcher import LocalCluster
from mooncake.engine.tokenizer import Tokenizer
from mooncake.serving.types import BackendError, GenerationRequest
from protos import conductor_pb2 as cpb
from protos import conductor_pb2_grpc as cpb_grpc

MODEL_NAME = "abort-storm"
PREFIXES = 4
PREFIX_TOKENS = 64
SUFFIX_TOKENS = (16, 128)
PROBE_TOKENS = 128
PROBE_MAX_TOKENS = 8
MOMENTS = ("prefill", "handoff", "decode")
PREFILL_AT = (0.25, 0.6)  # hang-up, x the undisturbed TTFT p50 after the stream was sent
HANDOFF_AT = (0.7, 1.1)
HANG_UP = {m: f"{m} ({a:g}-{b:g} x TTFT)" for m, (a, b) in (("prefill", PREFILL_AT), ("handoff", HANDOFF_AT))}
HANG_UP["decode"] = "decode (after {} chunks)"
POLL_S = 0.02
STORM_POLL_S = 0.1
GIVE_UP_S = 30.0
STREAM_TIMEOUT_S = 300.0  # a stream of the decode third that never reaches its chunks hangs up then
GOAL_RELEASE_S = 1.0
GOAL_TTFT_RATIO = 1.2

# what a cancelled request can hold, per kind of component: (what, the Prometheus metric)
DECODE_METRICS = (
    ("reserved cache blocks", "mooncake_decode_reserved_cache_blocks"),
    ("running", "mooncake_decode_running_requests"),
    ("free landing slots", "mooncake_decode_landing_free_slots"),
    ("in prefill", "mooncake_decode_in_prefill"),
)
PREFILL_METRICS = (("prefill jobs", "mooncake_prefill_inflight"),)
POOL_METRICS = (("leases", "mooncake_pool_leases"), ("reserved slots", "mooncake_pool_reserved_blocks"))
GATEWAY_METRICS = (("running", "mooncake_gateway_running_requests"),)
CONDUCTOR_METRICS = (("waiting", "mooncake_conductor_waiting_requests"),)
# the Conductor's own count of each decode worker (InstanceInfo fields; no metric reports them)
CONDUCTOR_VIEW = (
    ("placed in prefill", "placed_in_prefill"),
    ("placed decoding", "placed_decoding"),
    ("landing blocks held", "landing_held"),
)


# -- reading what is held --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Watched:
    """One count a cancelled request can hold: where it is read (a component's ``/metrics``, or with ``url`` None
    the Conductor's ``ListInstances`` entry of ``instance``)."""

    label: str
    component: str
    metric: str  # the Prometheus metric (summed over its labels), or the InstanceInfo field
    url: str | None
    instance: str = ""
    in_goal: bool = True  # a metric: it counts in the goal


def watched_counts(cluster: LocalCluster) -> list[Watched]:
    """Every count this cluster's components report that a cancelled request can hold."""
    c, out = cluster.config, []

    def add(name: str, metrics: tuple[tuple[str, str], ...], url: str) -> None:
        out.extend(Watched(f"{name} {what}", name, metric, url) for what, metric in metrics)

    def scrape(name: str) -> str:
        return f"http://{cluster.component(name).info['metrics']}/metrics"

    for i in range(c.decode):
        add(f"decode-{i}", DECODE_METRICS, scrape(f"decode-{i}"))
    for i in range(c.prefill):
        add(f"prefill-{i}", PREFILL_METRICS, scrape(f"prefill-{i}"))
        add(f"kv{i}", POOL_METRICS, scrape(f"kv{i}"))
    add("gateway", GATEWAY_METRICS, cluster.endpoint.removesuffix("/v1") + "/metrics")
    add("conductor", CONDUCTOR_METRICS, scrape("conductor"))
    for i in range(c.decode):
        out.extend(
            Watched(f"conductor's decode-{i} {what}", "conductor", fld, None, f"decode-{i}", False)
            for what, fld in CONDUCTOR_VIEW
        )
    return out


def metric_sums(text: str) -> dict[str, float]:
    """Prometheus text -> each metric's samples summed over their labels (0 for a metric with none yet)."""
    sums: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            sums.setdefault(line.split()[2], 0.0)
        elif line and not line.startswith("#"):
            name = line.split("{", 1)[0].split(" ", 1)[0]
            sums[name] = sums.get(name, 0.0) + float(line.rsplit(" ", 1)[-1])
    return sums


class Reader:
    """Reads every watched count at once: the components' ``/metrics`` concurrently, and ``ListInstances``."""

    def __init__(self, cluster: LocalCluster, watched: list[Watched]) -> None:
        self.watched = watched
        self._urls = sorted({w.url for w in watched if w.url is not None})
        self._http = httpx.AsyncClient(timeout=5)
        self._channel = tls.grpc_channel(cluster.conductor_address)
        self._stub = cpb_grpc.ConductorStub(self._channel)

    async def read(self) -> dict[str, float | None]:
        """label -> value now (None: its component did not answer, or has no such metric)."""
        *texts, listing = await asyncio.gather(*(self._get(u) for u in self._urls), asyncio.to_thread(self._listing))
        sums = {u: metric_sums(t) for u, t in zip(self._urls, texts)}
        out: dict[str, float | None] = {}
        for w in self.watched:
            if w.url is None:
                info = listing.get(w.instance)
                out[w.label] = None if info is None else float(getattr(info, w.metric))
            else:
                out[w.label] = sums[w.url].get(w.metric)
        return out

    async def _get(self, url: str) -> str:
        with contextlib.suppress(httpx.HTTPError):
            r = await self._http.get(url)
            return r.text if r.status_code == 200 else ""
        return ""

    def _listing(self) -> dict:
        with contextlib.suppress(grpc.RpcError):
            return {i.id: i for i in self._stub.ListInstances(cpb.ListInstancesRequest(), timeout=5).instances}
        return {}

    async def close(self) -> None:
        await self._http.aclose()
        self._channel.close()


@dataclass
class Release:
    """Counts read every ``POLL_S`` from a moment on until all are at their idle values (or ``GIVE_UP_S``)."""

    back_s: dict[str, float | None]  # label -> seconds after the moment it was back (None: still held)
    first: dict[str, float | None]  # the first read
    last: dict[str, float | None]  # the last read
    changes: dict[str, list[tuple[float, float | None]]]  # label -> (seconds, value) each time it changed
    reads: list[tuple[float, float]] = field(default_factory=list)  # each read's start and end, in seconds
    metrics_back_s: float | None = None  # when every metric was back (the goal's); None: not within GIVE_UP_S
    view_back_s: float | None = None  # when the Conductor's view was


async def watch_release(reader: Reader, idle: dict[str, float | None], since: float) -> Release:
    """Read every count each ``POLL_S`` until all equal ``idle``; times are seconds after ``since``
    (a perf_counter)."""
    labels = list(idle)
    rel = Release({k: None for k in labels}, {}, {}, {k: [] for k in labels})
    while True:
        started = time.perf_counter()
        values = await reader.read()
        at = time.perf_counter() - since  # the read's end: the count was back by then at the latest
        rel.reads.append((round(started - since, 4), round(at, 4)))
        rel.first = rel.first or values
        for k in labels:
            if not rel.changes[k] or rel.changes[k][-1][1] != values[k]:
                rel.changes[k].append((round(at, 4), values[k]))
            if values[k] != idle[k]:
                rel.back_s[k] = None  # (held again: counted from its last return)
            elif rel.back_s[k] is None:
                rel.back_s[k] = at
        rel.last = values
        if all(v is not None for v in rel.back_s.values()) or at > GIVE_UP_S:
            break
        await asyncio.sleep(max(0.0, started + POLL_S - time.perf_counter()))
    goal = {w.label: w.in_goal for w in reader.watched}
    for in_goal, name in ((True, "metrics_back_s"), (False, "view_back_s")):
        times = [t for k, t in rel.back_s.items() if goal[k] == in_goal]
        setattr(rel, name, max(times, default=0.0) if all(t is not None for t in times) else None)
    return rel


async def probe(cluster: LocalCluster, prompts: list[list[int]], tag: str, progress, task) -> list[dict]:
    """Each prompt in turn through a ClusterBackend, greedy, ``PROBE_MAX_TOKENS`` tokens: its TTFT and e2e."""
    be, out = make_backend(cluster), []
    try:
        for i, prompt in enumerate(prompts):
            req = GenerationRequest.of(f"{tag}-{i}", prompt, PROBE_MAX_TOKENS, temperature=0.0, ignore_eos=True)
            t0, r = time.perf_counter(), {"ttft_s": None, "e2e_s": None, "tokens": 0, "error": ""}
            try:
                async for chunk in be.generate(req):
                    if chunk.token_ids and r["ttft_s"] is None:
                        r["ttft_s"] = time.perf_counter() - t0
                    r["tokens"] += len(chunk.token_ids)
            except BackendError as e:
                r["error"] = f"{type(e).__name__}: {e.message}"
            r["e2e_s"] = time.perf_counter() - t0
            out.append(r)
            progress.advance(task)
    finally:
        await be.close()
    return out


@dataclass(slots=True)
class Stream:
    """One client of the storm, and what became of it."""

    moment: str  # prefill, handoff or decode: when it hangs up
    prompt_tokens: int
    after_s: float | None  # prefill, handoff: hangs up this long after it was sent
    after_events: int | None  # decode: hangs up after reading this many streamed chunks
    outcome: str = ""  # hung up, completed, refused (429), HTTP <status>, timed out, error
    http_status: int | None = None
    events: int = 0  # streamed chunks read
    first_event_s: float | None = None  # after the storm began
    closed_s: float = 0.0  # when its connection closed, after the storm began
    error: str = ""


async def run_stream(url: str, body: bytes, s: Stream, t0: float) -> None:
    """Send one streamed completion and hang up at ``s``'s moment (closing the connection at once)."""
    host, port, path = _split(url)
    writer = None
    try:
        async with asyncio.timeout(s.after_s if s.after_s is not None else STREAM_TIMEOUT_S):
            reader, writer = await asyncio.open_connection(host, port)
            writer.write(
                f"POST {path}/completions HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
                + body
            )
            s.http_status = int((await reader.readline()).split()[1])
            headers = {}
            while (line := await reader.readline()) not in (b"\r\n", b""):
                name, _, value = line.decode().partition(":")
                headers[name.strip().lower()] = value.strip()
            if s.http_status != 200:
                s.outcome = "refused" if s.http_status == 429 else f"HTTP {s.http_status}"
                s.error = (await _body(reader, headers)).decode(errors="replace")[:300]
                return
            async for event in _events(reader):
                if event.get("error"):
                    s.outcome, s.error = "error", json.dumps(event["error"])[:300]
                    return
                if event.get("choices"):
                    s.events += 1
                    if s.first_event_s is None:
                        s.first_event_s = time.perf_counter() - t0
                    if s.after_events is not None and s.events >= s.after_events:
                        s.outcome = "hung up"
                        return
            s.outcome = "completed"
    except TimeoutError:
        s.outcome = "hung up" if s.after_s is not None else "timed out"
    except (OSError, ValueError, IndexError, asyncio.IncompleteReadError) as e:
        s.outcome, s.error = "error", f"{type(e).__name__}: {e}"[:300]
    finally:
        if writer is not None:
            writer.transport.abort()  # no lingering close: the gateway sees the client gone now
        s.closed_s = time.perf_counter() - t0


async def storm(
    url: str, streams: list[Stream], bodies: list[bytes], reader: Reader, idle: dict, progress, task
) -> tuple[float, dict[str, float], list]:
    """Every stream at once, the counts read every ``STORM_POLL_S`` meanwhile; (when the storm began, the most
    each count was away from idle, every read: (seconds after the beginning, values))."""
    peaks, reads = {k: 0.0 for k in idle}, []

    async def watch() -> None:
        while True:
            started = time.perf_counter()
            reads.append((round(started - t0, 3), await reader.read()))
            for k, v in reads[-1][1].items():
                if v is not None and idle[k] is not None:
                    peaks[k] = max(peaks[k], abs(v - idle[k]))
            await asyncio.sleep(max(0.0, started + STORM_POLL_S - time.perf_counter()))

    async def one(s: Stream, body: bytes) -> None:
        await run_stream(url, body, s, t0)
        progress.advance(task)

    t0 = time.perf_counter()
    watcher = asyncio.create_task(watch())
    try:
        await asyncio.gather(*(one(s, b) for s, b in zip(streams, bodies)))
    finally:
        watcher.cancel()  # now, not after its next read: the release is timed from the last client's leaving
        with contextlib.suppress(asyncio.CancelledError):
            await watcher
    return t0, peaks, reads


def plan_storm(args, rng: random.Random, prefixes: list[list[int]], vocab: int, ttft_s: float):
    """The storm's streams (a third for each moment) and their request bodies."""
    streams, bodies = [], []
    for i in range(args.streams):
        moment = args.moments[i % len(args.moments)]
        prompt = prefixes[i % PREFIXES] + [rng.randrange(32, vocab) for _ in range(rng.randint(*SUFFIX_TOKENS))]
        span = {"prefill": PREFILL_AT, "handoff": HANDOFF_AT}.get(moment)
        after_s = ttft_s * rng.uniform(*span) if span else None
        streams.append(Stream(moment, len(prompt), after_s, args.events if moment == "decode" else None))
        body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": args.max_tokens, "stream": True}
        bodies.append(json.dumps(body | {"temperature": 0, "ignore_eos": True}).encode())
    return streams, bodies


# -- the run ----------------------------------------------------------------------------------------


async def measure(cluster: LocalCluster, args, vocab: int, report: dict, progress, task, console: Console) -> None:
    """Steps 1 to 5 of the module's docstring, every number into ``report``."""
    rng = random.Random(args.seed)

    def ids(n: int) -> list[int]:
        return [rng.randrange(32, vocab) for _ in range(n)]

    reader = Reader(cluster, watched_counts(cluster))
    try:
        idle = await reader.read()
        missing = [k for k, v in idle.items() if v is None]
        if missing:
            raise RuntimeError(f"before any traffic, these counts could not be read: {', '.join(missing)}")
        report["watched"], report["idle"] = [asdict(w) for w in reader.watched], idle
        prefixes = [ids(PREFIX_TOKENS) for _ in range(PREFIXES)]
        progress.update(task, description="warm-up")
        warm = [ids(PROBE_TOKENS) for _ in range(2)] + [p + ids(8) for p in prefixes]
        report["warm_up"] = await probe(cluster, warm, "warm", progress, task)
        progress.update(task, description=f"undisturbed: {args.probes} requests one at a time")
        base = [ids(PROBE_TOKENS) for _ in range(args.probes)]
        report["undisturbed"] = await probe(cluster, base, "base", progress, task)
        ttfts = [r["ttft_s"] for r in report["undisturbed"] if r["ttft_s"] is not None]
        if not ttfts:
            raise RuntimeError(f"no undisturbed request got a token: {report['undisturbed'][0]['error']}")
        progress.update(task, description="waiting until nothing is held")
        settled = await watch_release(reader, idle, time.perf_counter())
        report["settled_before_storm"] = asdict(settled)
        if settled.metrics_back_s is None:
            held = {k: settled.last[k] for k, t in settled.back_s.items() if t is None}
            console.log(f"[yellow]after the undisturbed requests, still not at idle[/]: {held}")
        streams, bodies = plan_storm(args, rng, prefixes, vocab, percentile(ttfts, 50))
        progress.update(task, description=f"storm: {args.streams} streams at once")
        t0, peaks, storm_reads = await storm(cluster.endpoint, streams, bodies, reader, idle, progress, task)
        last_close = t0 + max(s.closed_s for s in streams)
        hung = [s.closed_s for s in streams if s.outcome in ("hung up", "timed out")]
        progress.update(task, description="release: reading every 20 ms")
        release = await watch_release(reader, idle, last_close)
        for k, changes in release.changes.items():  # the storm's last read may come before a count's peak
            peaks[k] = max([peaks[k], *(abs(v - idle[k]) for _, v in changes if v is not None)])
        report["storm"] = {
            "streams": [asdict(s) for s in streams],
            "last_close_s": last_close - t0,
            "last_hang_up_s": max(hung, default=None),
            "most_held": peaks,
            "reads": storm_reads,
        }
        report["release"] = asdict(release)
        progress.update(task, description=f"after: {args.after} requests one at a time")
        report["after"] = await probe(cluster, [ids(PROBE_TOKENS) for _ in range(args.after)], "after", progress, task)
    finally:
        await reader.close()


def run(args: argparse.Namespace, console: Console) -> dict:
    """Start the cluster, measure, stop it (whatever happens); the report's every number."""
    workdir = Path(tempfile.mkdtemp(prefix="abort-storm-"))
    cluster = None
    try:
        model_dir, model = resolve_model(args, workdir)
        vocab = Tokenizer.from_dir(str(model_dir)).vocab_size
        longest = PREFIX_TOKENS + SUFFIX_TOKENS[1] + max(args.max_tokens, PROBE_MAX_TOKENS)
        base = {
            "model": str(model_dir),
            "model_name": MODEL_NAME,
            "prefill": args.prefill,
            "decode": args.decode,
            "port": 0,
            # every prompt through a prefill worker: the hand-off is what is cut short
            "local_prefill": LocalPrefill.NEVER,
            "threads": args.threads,
            "workdir": workdir / "cluster",
            "max_model_len": -(-longest // 512) * 512,  # in 512s, as the tests
            "ready_timeout_s": 600.0,
        }
        sizing = ClusterConfig(**base)
        requests = args.streams + args.probes + args.after + 2 + PREFIXES
        blocks = requests * blocks_for(longest, sizing.block_size) + 64
        config = ClusterConfig(**base, pool_dram_mib=max(64, math.ceil(blocks * sizing.block_bytes() / 2**20)))
        report = {
            "command": shlex.join([sys.executable, *sys.argv]),
            "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "machine": describe_machine(torch=torch.__version__, grpc=grpc.__version__),
            "model": model,
            "args": {k: str(v) for k, v in vars(args).items()},
            "config": config.model_dump(mode="json"),
        }
        console.print(
            f"model {model}; {args.prefill} prefill + {args.decode} decode workers, {args.threads} torch thread(s) "
            f"each; {args.streams} streams hung up mid-request; TTFT SLO {config.ttft_slo_s:g} s (early rejection on)"
        )
        progress = make_progress(console, args.no_progress)
        with progress:
            total = 2 + PREFIXES + args.probes + args.streams + args.after
            task = progress.add_task("starting the cluster", total=total)
            t = time.perf_counter()
            cluster = LocalCluster(config, lambda msg: progress.update(task, description=f"cluster: {msg}"))
            cluster.start()
            report["startup_s"] = time.perf_counter() - t
            asyncio.run(measure(cluster, args, vocab, report, progress, task, console))
        return report
    finally:
        with shielded():
            if cluster is not None:
                cluster.stop()
            if args.keep_logs:
                console.print(f"logs kept in {workdir / 'cluster'}")
            else:
                shutil.rmtree(workdir, ignore_errors=True)


# -- the report -------------------------------------------------------------------------------------


def summarize(report: dict) -> tuple[dict, list[dict]]:
    """The headline numbers and the goals (each with its value and pass)."""
    base = [r["ttft_s"] for r in report["undisturbed"] if r["ttft_s"] is not None]
    after = [r["ttft_s"] for r in report["after"] if r["ttft_s"] is not None]
    base_p50, after_p50 = percentile(base, 50), percentile(after, 50)
    ratio = after_p50 / base_p50 if base_p50 and after_p50 is not None else None
    release = report["release"]
    summary = {
        "undisturbed_ttft_p50_s": base_p50,
        "undisturbed_ttft_p90_s": percentile(base, 90),
        "after_ttft_p50_s": after_p50,
        "after_first_ttft_s": report["after"][0]["ttft_s"] if report["after"] else None,
        "after_ttft_ratio": ratio,
        "after_failed": sum(bool(r["error"]) or r["ttft_s"] is None for r in report["after"]),
        "metrics_back_s": release["metrics_back_s"],
        "conductor_view_back_s": release["view_back_s"],
        "still_held": {k: release["last"][k] for k, t in release["back_s"].items() if t is None},
    }
    back_s, ratio_ok = release["metrics_back_s"], ratio is not None and ratio <= GOAL_TTFT_RATIO
    release_goal = f"every metric back at idle within {GOAL_RELEASE_S:g} s of the last hang-up"
    ttft_goal = f"the next requests' TTFT p50 within {GOAL_TTFT_RATIO - 1:.0%} of the undisturbed p50"
    goals = [
        {"goal": release_goal, "value": back_s, "pass": back_s is not None and back_s <= GOAL_RELEASE_S},
        {"goal": ttft_goal, "value": ratio, "pass": ratio_ok and not summary["after_failed"]},
    ]
    return summary, goals


def _s(v: float | None, digits: int | None = 3) -> str:
    return "-" if v is None else f"{v:g}" if digits is None else f"{v:.{digits}f}"


def render(report: dict, summary: dict, goals: list[dict], console: Console) -> None:
    streams = report["storm"]["streams"]
    t = Table(title=f"the storm: {len(streams)} streams sent at once")
    for col in ("hangs up", "streams", "hung up", "completed", "refused (429)", "other", "saw a chunk", "closed p50 s"):
        t.add_column(col, justify="left" if col == "hangs up" else "right")
    usual = ("hung up", "completed", "refused")
    for moment in [m for m in MOMENTS if any(s["moment"] == m for s in streams)]:
        group = [s for s in streams if s["moment"] == moment]
        outcomes = [s["outcome"] for s in group]
        counts = [len(group), *(outcomes.count(o) for o in usual), len(group) - sum(outcomes.count(o) for o in usual)]
        label = HANG_UP[moment].format(report["args"]["events"])
        closed = _s(percentile([s["closed_s"] for s in group], 50), 2)
        t.add_row(label, *map(str, counts), str(sum(s["events"] > 0 for s in group)), closed)
    console.print(t)
    errors = sorted({f"{s['outcome']}: {s['error'][:120]}" for s in streams if s["outcome"] not in usual})
    for e in errors[:5]:
        console.print(f"  [red]{e}[/]")

    rel, idle, peaks = report["release"], report["idle"], report["storm"]["most_held"]
    t = Table(title="held and released (seconds after the last client left)")
    for col in ("count", "idle", "most held", "first read after", "back after s", "last read"):
        t.add_column(col, justify="left" if col == "count" else "right")
    for w in report["watched"]:
        k, back = w["label"], rel["back_s"][w["label"]]
        back_text = "[red]still held[/]" if back is None else _s(back)
        counts = [_s(v, None) for v in (idle[k], peaks[k], rel["first"][k])]
        t.add_row(k + ("" if w["in_goal"] else " (ListInstances)"), *counts, back_text, _s(rel["last"][k], None))
    console.print(t)
    console.print(
        f"last client left {report['storm']['last_close_s']:.2f} s after the storm began; {len(rel['reads'])} reads "
        f"(the first {rel['reads'][0][0]:.3f} to {rel['reads'][0][1]:.3f} s after); "
        f"every metric back after {_s(summary['metrics_back_s'])} s, the Conductor's view after "
        f"{_s(summary['conductor_view_back_s'])} s"
    )
    console.print(
        f"TTFT undisturbed p50 {_s(summary['undisturbed_ttft_p50_s'])} s, p90 {_s(summary['undisturbed_ttft_p90_s'])}; "
        f"after the storm: first {_s(summary['after_first_ttft_s'])} s, p50 {_s(summary['after_ttft_p50_s'])} s "
        f"(x{_s(summary['after_ttft_ratio'], 2)}), {summary['after_failed']} failed"
    )
    for g in goals:
        console.print(f"{'[green]PASS[/]' if g['pass'] else '[red]FAIL[/]'}  {g['goal']}: {_s(g['value'], 3)}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", type=Path, help="write every raw number (and the command line) to this file")
    p.add_argument("--model", help="a model pulled into the cache (smollm2-135m, the default) or a directory")
    p.add_argument("--quick", action="store_true", help="a smoke run: the tiny random model (unless --model)")
    p.add_argument("--streams", type=int, default=100, help="streams in the storm, sent at once (default 100)")
    p.add_argument("--probes", type=int, default=10, help="undisturbed requests, one at a time (default 10)")
    p.add_argument("--after", type=int, default=5, help="requests right after the release (default 5)")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens each storm stream asks for (default 128)")
    p.add_argument("--moments", default=",".join(MOMENTS), help="when streams hang up, split evenly (default all)")
    p.add_argument("--events", type=int, default=4, help="chunks the decode third reads before it hangs up (default 4)")
    p.add_argument("--prefill", type=int, default=2, help="prefill workers, each with its pool node (default 2)")
    p.add_argument("--decode", type=int, default=2, help="decode workers (default 2)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker (default 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--keep-logs", action="store_true", help="keep the components' logs (their directory is printed)")
    args = p.parse_args(argv)
    args.moments = [m.strip() for m in args.moments.split(",") if m.strip()]
    if not args.moments or set(args.moments) - set(MOMENTS):
        p.error(f"--moments: a comma-separated choice of {', '.join(MOMENTS)}")
    if min(args.streams, args.probes, args.after, args.events, args.prefill, args.decode, args.threads) < 1:
        p.error("--streams, --probes, --after, --events, --prefill, --decode and --threads must be >= 1")
    if args.max_tokens <= args.events:
        p.error("--max-tokens must be above --events (the decode third hangs up before its stream ends)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    console = Console(width=None if sys.stdout.isatty() else 160, log_path=False)
    report = run_interruptible(lambda: run(args, console), console)
    if report is None:
        return 130
    summary, goals = summarize(report)
    render(report, summary, goals, console)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report | {"summary": summary, "goals": goals}, indent=2, default=str) + "\n")
        console.print(f"raw numbers written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
