"""End-to-end benchmark: TTFT and TBT through the OpenAI gateway, disaggregated against coupled, and layer-wise overlap.

    python -m benchmarks.e2e_bench [--json PATH] [--model smollm2-135m|DIR] [--quick] [--engine native|vllm]

``--engine vllm`` runs every engine as stock vLLM (the cluster's workers, the coupled
gateway and the overlap's prefill worker; block size 32): the overlap then measures our
KV connector's cost inside vLLM, and the warm rows how much a prefix from the pool cuts
vLLM's TTFT.

**Serving** (the same prompts, one system at a time so they never share the cores):

- disaggregated: a LocalCluster (Conductor, one pool node, one prefill and one decode
  worker, the gateway), every component its own process, all on one host (the hand-off
  in shared memory), or with ``--network-hosts`` the prefill worker with its pool node
  and the decode worker each on a network host of its own (the hand-off over tcp);
- coupled: ``python -m mooncake.gateway --local``, one engine in one process (prefill
  and decode on the same engine, its own prefix cache, no pool): the baseline.

Each engine runs with ``--threads`` torch threads (1: the two workers of the cluster then
have a core each on a 2-core machine, and the coupled engine computes with as many
threads as either worker). Prompts are deterministic token-id lists sent to
``/v1/completions`` (``prompt=[ids]``, greedy, ``ignore_eos``, streamed with
``stream_options.include_usage``). For every prompt length and repetition, a prompt
never seen before (cold) and then the same prompt again (warm: its full blocks come
from the pool, or from the coupled engine's prefix cache) are timed:

- TTFT: request sent -> the first SSE event carrying text (the gateway sends an event
  only for tokens with text, and the finish event carries none);
- TBT mean: (last token event - first token event) / (completion tokens - 1);
- TBT tail (the paper's TBT): mean of the longest 10% of the gaps between token events;
- cached tokens: ``usage.prompt_tokens_details.cached_tokens``.

The median over ``--reps`` repetitions is reported with the ratio disaggregated /
coupled (below 1: the disaggregated system is faster).

**Layer-wise overlap** (in this process): a pool node process, a PrefillWorker on it and
a decode cache segment. For each length, alternating in ABBA order, (a) ``worker.prefill`` of
a fresh prompt with a cold plan (every layer streamed into that cache in place, every full
block written to the pool after the answer; checked through the pool's stats) and (b) the same engine
computing a fresh prompt of the same length with nothing streamed
(``engine.generate``, max_tokens=1, on the engine's thread). Ratio (a)/(b) of the wall
times, goal <= 1.15; the ratio of (a)'s ``prefill_s`` to (b)'s time inside the engine
thread is printed beside it. See benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import torch
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from benchmarks.benchutil import describe_machine, make_progress, resolve_model, run_interruptible, shielded
from mooncake import tls
from mooncake.blocks import blocks_for
from mooncake.cluster.components import component_argv
from mooncake.cluster.config import ClusterConfig
from mooncake.cluster.launcher import Component, LocalCluster
from mooncake.engine.config import DTYPE_NAMES
from mooncake.engine.interface import parse_vllm_args
from mooncake.engine.tokenizer import Tokenizer
from mooncake.serving.worker_args import default_block_size

GOAL_OVERLAP = {"native": 1.15, "vllm": 1.10}  # prefill with KV streaming and pool writes on / off, at most
GOAL_POOL_CUT = 5.0  # vLLM: cold TTFT / TTFT with the prefix from the pool, at the longest prompt, at least
MODEL_NAME = "bench"
BLOCK_SIZE = 16  # the engine's block size: set from --engine in parse_args
FULL = dict(sizes=(128, 1024, 4096), overlap_sizes=(1024, 4096), max_tokens=32, reps=3)
QUICK = dict(sizes=(128, 512), overlap_sizes=(256, 1024), max_tokens=8, reps=2)


@dataclass
class Sample:
    """One streamed request through a gateway."""

    system: str  # disaggregated, coupled
    prompt_tokens: int
    cache: str  # cold, warm
    rep: int
    ttft_s: float
    tbt_mean_s: float
    tbt_tail_s: float
    cached_tokens: int
    completion_tokens: int
    token_events: list[float]  # seconds after the request was sent, one per SSE event with text


@dataclass
class OverlapRun:
    """One prefill in the overlap measurement: (a) streamed or (b) plain."""

    prompt_tokens: int
    mode: str  # streamed, plain
    rep: int
    wall_s: float
    engine_s: float  # streamed: the response's prefill_s; plain: generate() timed on the engine's thread
    computed_tokens: int = 0
    pool_blocks_written: int = 0


@dataclass
class Report:
    command: str
    started_at: str
    machine: dict[str, object]
    model: str
    quick: bool
    threads: int
    sizes: list[int]
    overlap_sizes: list[int]
    max_tokens: int
    reps: int
    config: dict[str, object] = field(default_factory=dict)
    startup_s: dict[str, float] = field(default_factory=dict)
    samples: list[Sample] = field(default_factory=list)
    overlap: list[OverlapRun] = field(default_factory=list)
    landing_transport: str = ""
    total_wall_s: float = 0.0
    engine: str = "native"


# -- the workload ---------------------------------------------------------------------------


def prompt_of(length: int, tag: str, vocab: int) -> list[int]:
    """``length`` token ids, the same for the same (length, tag) in every run; ids under 32 (specials) are avoided."""
    rng = random.Random(f"e2e/{tag}/{length}")
    return [rng.randrange(32, vocab) for _ in range(length)]


def stream_once(client: httpx.Client, endpoint: str, prompt: list[int], max_tokens: int) -> tuple[list[float], dict]:
    """Send one streamed completion; return each text event's time (s after sending) and the usage."""
    body = json.dumps(
        {
            "model": MODEL_NAME,
            "prompt": [prompt],
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
            "ignore_eos": True,
            "stream_options": {"include_usage": True},
        }
    ).encode()
    events: list[float] = []
    usage: dict = {}
    t0 = time.perf_counter()
    with client.stream(
        "POST", f"{endpoint}/completions", content=body, headers={"content-type": "application/json"}
    ) as r:
        if r.status_code != 200:
            raise RuntimeError(
                f"POST /v1/completions answered {r.status_code}: {r.read().decode(errors='replace')[:500]}"
            )
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: ") :]
            if data == "[DONE]":
                break
            now = time.perf_counter() - t0
            event = json.loads(data)
            if "error" in event:
                raise RuntimeError(f"the stream failed: {event['error']}")
            choices = event.get("choices") or []
            if choices and choices[0].get("finish_reason") is None and choices[0].get("text"):
                events.append(now)
            if event.get("usage"):
                usage = event["usage"]
    if not events or not usage:
        raise RuntimeError(f"the stream ended with {len(events)} text events and usage {usage!r}")
    return events, usage


def measure(
    client: httpx.Client, system: str, endpoint: str, prompt: list[int], cache: str, rep: int, max_tokens: int
) -> Sample:
    events, usage = stream_once(client, endpoint, prompt, max_tokens)
    tokens = int(usage["completion_tokens"])
    gaps = sorted((b - a for a, b in zip(events, events[1:])), reverse=True)
    tail = statistics.fmean(gaps[: max(1, math.ceil(len(gaps) / 10))]) if gaps else 0.0
    mean = (events[-1] - events[0]) / (tokens - 1) if tokens > 1 else 0.0
    cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    return Sample(system, len(prompt), cache, rep, events[0], mean, tail, cached, tokens, events)


# -- serving: the two systems ------------------------------------------------------------------


def serve_and_measure(
    system: str,
    endpoint: str,
    args,
    vocab: int,
    report: Report,
    progress: Progress,
    task,
    console: Console,
    index: IndexWatch | None = None,
) -> None:
    """One warm-up request (not counted), then cold + warm of every length, ``reps`` times."""
    with httpx.Client(timeout=httpx.Timeout(900.0, connect=10.0)) as client:
        progress.update(task, description=f"{system}: warm-up request")
        stream_once(client, endpoint, prompt_of(min(300, max(args.sizes)), "warmup", vocab), args.max_tokens)
        for rep in range(args.reps):
            for size in args.sizes:
                prompt = prompt_of(size, f"rep{rep}", vocab)
                for cache in ("cold", "warm"):
                    progress.update(task, description=f"{system}: {size:,} tokens, {cache}, rep {rep + 1}/{args.reps}")
                    before = index.count() if index is not None and cache == "cold" else None
                    s = measure(client, system, endpoint, prompt, cache, rep, args.max_tokens)
                    if before is not None:  # the warm request must find the blocks the cold one stored
                        index.wait_for(before + size // BLOCK_SIZE)
                    report.samples.append(s)
                    console.log(
                        f"{system:>14} {size:>6,} {cache}  TTFT {s.ttft_s * 1e3:9.1f} ms  TBT mean "
                        f"{s.tbt_mean_s * 1e3:7.1f} ms  tail {s.tbt_tail_s * 1e3:7.1f} ms  cached {s.cached_tokens:>5}"
                    )
                    progress.advance(task)


class IndexWatch:
    """How many blocks of pool node kv0 the Conductor's index lists (stored blocks reach it as events, a moment
    later)."""

    def __init__(self, conductor_address: str) -> None:
        from protos import conductor_pb2 as cpb
        from protos import conductor_pb2_grpc as cpb_grpc

        self._request = cpb.ListInstancesRequest()
        self._channel = tls.grpc_channel(conductor_address)
        self._stub = cpb_grpc.ConductorStub(self._channel)

    def count(self) -> int:
        listing = self._stub.ListInstances(self._request, timeout=5)
        return sum(i.indexed_blocks for i in listing.instances if i.id == "kv0")

    def wait_for(self, want: int, timeout_s: float = 5.0) -> int:
        """Poll until the index lists ``want`` blocks or ``timeout_s`` passes; return the last count."""
        deadline = time.monotonic() + timeout_s
        while (n := self.count()) < want and time.monotonic() < deadline:
            time.sleep(0.05)
        return n

    def close(self) -> None:
        self._channel.close()


def run_disaggregated(
    args, model_dir: Path, workdir: Path, vocab: int, report: Report, progress: Progress, task, console
) -> None:
    blocks = (1 + args.reps) * sum(blocks_for(s, BLOCK_SIZE) for s in args.sizes) + 64  # every prompt stays in the pool
    engine = dict(
        engine=args.engine, vllm_args=args.vllm_arg, block_size=BLOCK_SIZE, device=args.device, dtype=args.dtype
    )
    block_bytes = ClusterConfig(model=str(model_dir), model_name=MODEL_NAME, **engine).block_bytes()
    config = ClusterConfig(
        model=str(model_dir),
        model_name=MODEL_NAME,
        prefill=1,
        decode=1,
        port=0,
        workdir=workdir / "cluster",
        pool_dram_mib=max(64, math.ceil(blocks * block_bytes / 2**20)),
        max_model_len=args.max_model_len,
        threads=args.threads,
        ttft_slo_s=3600.0,
        tbt_slo_s=60.0,
        restart=False,
        ready_timeout_s=600.0,
        insecure=args.insecure,
        network_hosts=args.network_hosts,
        local_prefill=args.local_prefill,
        **engine,
    )
    report.config["cluster"] = config.model_dump(mode="json")
    progress.update(task, description="disaggregated: starting the cluster")
    t0 = time.perf_counter()
    cluster = LocalCluster(config, lambda msg: progress.update(task, description=f"disaggregated: {msg}"))
    index = None
    try:
        cluster.start()
        report.startup_s["disaggregated"] = time.perf_counter() - t0
        index = IndexWatch(cluster.conductor_address)
        serve_and_measure("disaggregated", cluster.endpoint, args, vocab, report, progress, task, console, index)
    finally:
        progress.update(task, description="disaggregated: stopping the cluster")
        with shielded():
            if index is not None:
                index.close()
            cluster.stop()


def run_coupled(
    args, model_dir: Path, workdir: Path, vocab: int, report: Report, progress: Progress, task, console
) -> None:
    argv = component_argv(
        "gateway",
        local=True,
        model=model_dir,
        model_name=MODEL_NAME,
        port=0,
        max_model_len=args.max_model_len,
        threads=args.threads,
        log_level="WARNING",
        engine=args.engine,
        block_size=BLOCK_SIZE,
        device=args.device,
        dtype=args.dtype,
        vllm_arg=args.vllm_arg,
    )
    report.config["coupled"] = {"argv": argv}
    progress.update(task, description="coupled: starting python -m mooncake.gateway --local")
    t0 = time.perf_counter()
    gateway = Component("coupled-gateway", argv, workdir / "coupled" / "gateway.log")
    try:
        gateway.start()
        gateway.wait_ready(600.0)
        report.startup_s["coupled"] = time.perf_counter() - t0
        serve_and_measure("coupled", f"{gateway.info['http']}/v1", args, vocab, report, progress, task, console)
    finally:
        progress.update(task, description="coupled: stopping")
        with shielded():
            gateway.terminate()
            deadline = time.monotonic() + 15
            while gateway.alive and time.monotonic() < deadline:
                time.sleep(0.05)
            gateway.kill()


# -- layer-wise overlap ------------------------------------------------------------------------


class PoolNode:
    """A ``python -m kvstore`` process of ``dram_blocks`` blocks, its shared memory in ``shm_dir``, its log in
    ``log_path``."""

    def __init__(self, block_bytes: int, dram_blocks: int, shm_dir: str, log_path: Path) -> None:
        argv = [
            sys.executable,
            "-m",
            "kvstore",
            "--node",
            "bench-kv",
            "--block-bytes",
            str(block_bytes),
            "--dram-blocks",
            str(dram_blocks),
            "--shm-dir",
            shm_dir,
            "--log-level",
            "WARNING",
        ]
        self.component = Component("bench-kv", argv, log_path)
        self.info: dict = {}

    def start(self) -> None:
        """Start the process and wait for its READY line (separate from __init__, so an interrupt here still finds it to
        stop)."""
        self.component.start()
        self.info = self.component.wait_ready(60.0)

    def stop(self) -> None:
        if self.component.proc is None:
            return
        self.component.terminate()
        try:
            self.component.proc.wait(10)
        except subprocess.TimeoutExpired:
            pass
        self.component.kill()


def run_overlap(
    args, model_dir: Path, workdir: Path, vocab: int, report: Report, progress: Progress, task, console
) -> None:
    from kvstore.wire import segment_to_pb
    from mooncake.engine.request import SamplingParams
    from prefill.config import PrefillConfig
    from prefill.worker import PrefillWorker
    from protos import conductor_pb2 as cpb
    from protos import worker_pb2 as wpb
    from transfer import TransferConfig, TransferEngine

    largest = blocks_for(max(args.overlap_sizes), BLOCK_SIZE)
    block_bytes = ClusterConfig(
        model=str(model_dir), model_name=MODEL_NAME, block_size=BLOCK_SIZE, dtype=args.dtype
    ).block_bytes()
    shm_dir = tempfile.mkdtemp(prefix="e2e-bench-", dir="/dev/shm")
    node = worker = landing_engine = None
    try:
        progress.update(task, description="overlap: starting a pool node and a prefill worker")
        node = PoolNode(block_bytes, 3 * largest, shm_dir, workdir / "overlap" / "kvstore.log")  # evicts as it goes
        node.start()
        config = PrefillConfig(
            id="bench-prefill",
            model=str(model_dir),
            kvstore=node.info["grpc"],
            num_kv_blocks=largest + 16,
            max_model_len=max(args.overlap_sizes) + BLOCK_SIZE,
            num_threads=args.threads,
            engine=args.engine,
            vllm_args=parse_vllm_args(args.vllm_arg),
            block_size=BLOCK_SIZE,
            device=args.device,
            dtype=args.dtype,
        )
        report.config["prefill_worker"] = config.model_dump(mode="json")
        worker = PrefillWorker(config)
        landing_engine = TransferEngine(TransferConfig(node="bench-landing", shm_dir=shm_dir))
        landing = landing_engine.allocate("kvcache", largest * block_bytes)  # a decode engine's cache, written in place
        landing_pb = segment_to_pb(landing)
        counter = iter(range(1 << 30))

        def streamed(prompt: list[int], rep: int) -> OverlapRun:
            n = blocks_for(len(prompt), BLOCK_SIZE)
            req = wpb.PrefillRequest(
                request_id=f"overlap-{next(counter)}",
                prompt_token_ids=prompt,
                sampling=wpb.Sampling(max_tokens=1, temperature=0.0, ignore_eos=True),
                plan=cpb.PrefixPlan(local_blocks=0),
                landing=wpb.Landing(
                    segment=landing_pb, cache_blocks=range(n), cache_num_blocks=largest, block_bytes=block_bytes
                ),
            )
            before = worker.kv.stats().dram
            t0 = time.perf_counter()
            resp = worker.prefill(req, threading.Event())
            wall = time.perf_counter() - t0
            worker.flush_pool_writes()  # the pool write follows the answer (off the critical path): counted, not timed
            after = worker.kv.stats().dram
            written = (after.used_blocks + after.evictions) - (before.used_blocks + before.evictions)
            if resp.computed_tokens != len(prompt) or written != len(prompt) // BLOCK_SIZE:
                raise RuntimeError(
                    f"a cold prefill of {len(prompt)} tokens computed {resp.computed_tokens} and wrote {written} "
                    f"blocks to the pool (expected {len(prompt) // BLOCK_SIZE})"
                )
            return OverlapRun(len(prompt), "streamed", rep, wall, resp.prefill_s, resp.computed_tokens, written)

        def plain(prompt: list[int], rep: int) -> OverlapRun:
            params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

            def on_engine_thread(engine) -> float:
                t = time.perf_counter()
                engine.add_request(prompt, params, request_id=f"plain-{next(counter)}")
                while engine.has_unfinished():
                    engine.step()
                return time.perf_counter() - t

            t0 = time.perf_counter()
            engine_s = worker.loop.call(on_engine_thread).result()
            return OverlapRun(len(prompt), "plain", rep, time.perf_counter() - t0, engine_s, len(prompt))

        progress.update(task, description="overlap: warm-up (not counted)")
        warm = min(512, *args.overlap_sizes)
        streamed(prompt_of(warm, "overlap-warmup-a", vocab), -1)
        plain(prompt_of(warm, "overlap-warmup-b", vocab), -1)
        seg = worker.transfer.segment(landing.name)
        report.landing_transport = worker.transfer.backend_for(seg).kind.value
        for rep in range(args.reps):
            for size in args.overlap_sizes:
                order = (streamed, plain) if rep % 2 == 0 else (plain, streamed)  # ABBA: drift hits both alike
                for fn in order:
                    progress.update(
                        task, description=f"overlap: {size:,} tokens, {fn.__name__}, rep {rep + 1}/{args.reps}"
                    )
                    run = fn(prompt_of(size, f"overlap-{fn.__name__}-{rep}", vocab), rep)
                    report.overlap.append(run)
                    console.log(
                        f"overlap {size:>6,} {run.mode:<8}  wall {run.wall_s * 1e3:9.1f} ms  engine "
                        f"{run.engine_s * 1e3:9.1f} ms"
                        + (f"  pool blocks written {run.pool_blocks_written}" if run.mode == "streamed" else "")
                    )
                    progress.advance(task)
    finally:
        progress.update(task, description="overlap: stopping")
        with shielded():
            try:
                if worker is not None:
                    worker.close()
                if landing_engine is not None:
                    landing_engine.close()
            finally:
                if node is not None:
                    node.stop()
                shutil.rmtree(shm_dir, ignore_errors=True)


# -- report --------------------------------------------------------------------------------------


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def serving_rows(report: Report) -> list[dict]:
    rows = []
    for size in report.sizes:
        for cache in ("cold", "warm"):
            row: dict = {"prompt_tokens": size, "cache": cache}
            for system in ("disaggregated", "coupled"):
                got = [s for s in report.samples if s.system == system and s.prompt_tokens == size and s.cache == cache]
                for metric in ("ttft_s", "tbt_mean_s", "tbt_tail_s", "cached_tokens"):
                    row[f"{system}_{metric}"] = _median([getattr(s, metric) for s in got])
            for metric in ("ttft_s", "tbt_mean_s", "tbt_tail_s"):
                d, c = row[f"disaggregated_{metric}"], row[f"coupled_{metric}"]
                row[f"ratio_{metric}"] = d / c if d is not None and c else None
            rows.append(row)
    return rows


def pool_cut(srows: list[dict]) -> float | None:
    """Cold over warm disaggregated TTFT at the longest prompt: what the pool saves."""
    longest = max((r["prompt_tokens"] for r in srows), default=None)
    ttft = {r["cache"]: r["disaggregated_ttft_s"] for r in srows if r["prompt_tokens"] == longest}
    return ttft["cold"] / ttft["warm"] if ttft.get("cold") and ttft.get("warm") else None


def overlap_rows(report: Report) -> list[dict]:
    rows = []
    for size in report.overlap_sizes:
        runs = {
            m: [r for r in report.overlap if r.prompt_tokens == size and r.mode == m and r.rep >= 0]
            for m in ("streamed", "plain")
        }
        row = {
            "prompt_tokens": size,
            **{
                f"{m}_{k}": _median([getattr(r, k) for r in rs])
                for m, rs in runs.items()
                for k in ("wall_s", "engine_s")
            },
        }
        if row["streamed_wall_s"] is None or not row["plain_wall_s"]:
            continue
        row["ratio_wall"] = row["streamed_wall_s"] / row["plain_wall_s"]
        row["ratio_engine"] = row["streamed_engine_s"] / row["plain_engine_s"]
        row["goal"] = GOAL_OVERLAP[report.engine]
        row["met"] = row["ratio_wall"] <= row["goal"]
        rows.append(row)
    return rows


def render(report: Report, srows: list[dict], orows: list[dict], console: Console) -> None:
    m = report.machine
    ms = lambda v: "" if v is None else f"{v * 1e3:,.1f}"
    ratio = lambda v: "" if v is None else f"{v:.2f}x"
    if srows and report.samples:
        hosts = "on two network hosts" if report.config.get("cluster", {}).get("network_hosts") else "on one host"
        table = Table(
            title=f"Through the gateway: disaggregated (1 prefill + 1 decode, {hosts}) vs coupled (one engine); "
            f"{report.model}, {report.max_tokens} output tokens, {report.threads} torch thread(s) per engine, "
            f"{m['cpu_model']} ({m['logical_cores']} cores)"
            + (f", {m['gpu']}" if m.get("gpu") else "")
            + f", median of {report.reps}",
            caption="ms; ratio = disaggregated / coupled (below 1: disaggregated faster); TBT tail = mean of the "
            "longest 10% of gaps; cached = usage.prompt_tokens_details.cached_tokens (disagg / coupled)",
        )
        for col in (
            "prompt",
            "cache",
            "cached",
            "TTFT disagg",
            "TTFT coupled",
            "ratio",
            "TBT disagg",
            "TBT coupled",
            "ratio",
            "tail disagg",
            "tail coupled",
            "ratio",
        ):
            table.add_column(col, justify="left" if col == "cache" else "right")
        for r in srows:
            cached = "/".join(
                "" if r[f"{s}_cached_tokens"] is None else f"{r[f'{s}_cached_tokens']:.0f}"
                for s in ("disaggregated", "coupled")
            )
            cells = [f"{r['prompt_tokens']:,}", r["cache"], cached]
            for metric in ("ttft_s", "tbt_mean_s", "tbt_tail_s"):
                cells += [ms(r[f"disaggregated_{metric}"]), ms(r[f"coupled_{metric}"]), ratio(r[f"ratio_{metric}"])]
            table.add_row(*cells)
        console.print(table)
    if orows:
        table = Table(
            title="Layer-wise overlap: a cold prefill streaming every layer into a decode cache "
            f"({report.landing_transport}) and writing the pool, vs the same engine with nothing "
            f"streamed; median of {report.reps}",
            caption="ms; wall = the call as the caller sees it; engine = (a) the response's prefill_s, (b) "
            "generate() on the engine's thread",
        )
        for col in (
            "prompt",
            "streamed wall",
            "plain wall",
            "streamed engine",
            "plain engine",
            "ratio (engine)",
            "ratio (wall)",
            "goal",
        ):
            table.add_column(col, justify="right")
        for r in orows:
            goal = f"<= {r['goal']:.2f} " + ("[green]PASS[/]" if r["met"] else "[red]MISS[/]")
            table.add_row(
                f"{r['prompt_tokens']:,}",
                ms(r["streamed_wall_s"]),
                ms(r["plain_wall_s"]),
                ms(r["streamed_engine_s"]),
                ms(r["plain_engine_s"]),
                ratio(r["ratio_engine"]),
                ratio(r["ratio_wall"]),
                goal,
            )
        console.print(table)
    cut = pool_cut(srows)
    if cut is not None and report.engine == "vllm":
        mark = "[green]PASS[/]" if cut >= GOAL_POOL_CUT else "[red]MISS[/]"
        console.print(
            f"a prefix from the pool cuts the disaggregated TTFT at {max(report.sizes):,} tokens {cut:.1f}x "
            f"(cold / warm; goal >= {GOAL_POOL_CUT:g}x) {mark}"
        )
    starts = ", ".join(f"{k} {v:.1f} s" for k, v in report.startup_s.items())
    goals = f"{sum(r['met'] for r in orows)}/{len(orows)} met" if orows else "none measured"
    console.print(
        f"start-up (not counted): {starts or 'n/a'}; goals: {goals}; "
        f"load average {m['load_average'][0]:.2f}; total wall {report.total_wall_s:.0f} s"
    )


# -- the run ---------------------------------------------------------------------------------------


def run(args: argparse.Namespace, console: Console) -> Report:
    started = time.perf_counter()
    workdir = Path(tempfile.mkdtemp(prefix="e2e-bench-"))
    ok = False
    try:
        model_dir, model = resolve_model(args, workdir)
        vocab = Tokenizer.from_dir(str(model_dir)).vocab_size
        report = Report(
            command=shlex.join([sys.executable, *sys.argv]),
            started_at=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            machine=describe_machine(torch=torch.__version__, httpx=httpx.__version__),
            model=model,
            quick=args.quick,
            threads=args.threads,
            sizes=list(args.sizes),
            overlap_sizes=list(args.overlap_sizes),
            max_tokens=args.max_tokens,
            reps=args.reps,
            engine=args.engine,
        )
        report.config["max_model_len"] = args.max_model_len
        console.print(
            f"model {model} ({model_dir}); each engine runs {args.threads} torch thread(s): the cluster's prefill and "
            f"decode workers one core each, the coupled engine as many as either"
        )
        serving = 2 * args.reps * 2 * len(args.sizes) if not args.no_serving else 0
        overlap = 2 * args.reps * len(args.overlap_sizes) if not args.no_overlap else 0
        progress = make_progress(console, args.no_progress)
        with progress:
            task = progress.add_task("starting", total=serving + overlap)
            parts = []
            if not args.no_serving:
                parts += [run_disaggregated, run_coupled]
            if not args.no_overlap:
                parts.append(run_overlap)
            for part in parts:
                part(args, model_dir, workdir, vocab, report, progress, task, console)
        report.total_wall_s = time.perf_counter() - started
        ok = True
        return report
    finally:
        if ok or not args.keep_logs_on_failure:
            with shielded():
                shutil.rmtree(workdir, ignore_errors=True)
        else:
            console.print(f"[red]failed[/]: logs kept in {workdir}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    sizes = lambda s: tuple(int(x) for x in s.split(",") if x.strip())
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", type=Path, help="write every raw number (and the command line) to this file")
    p.add_argument("--model", default=None, help="a registry name (smollm2-135m, the default) or a model directory")
    p.add_argument(
        "--quick", action="store_true", help="a smoke run: the tiny random model (unless --model) and small sizes"
    )
    p.add_argument(
        "--sizes",
        type=sizes,
        help=f"prompt lengths through the gateway (default {FULL['sizes']}, quick {QUICK['sizes']})",
    )
    p.add_argument(
        "--overlap-sizes",
        type=sizes,
        help=f"prompt lengths of the overlap measurement (default {FULL['overlap_sizes']})",
    )
    p.add_argument(
        "--max-tokens",
        type=int,
        help=f"output tokens per request (default {FULL['max_tokens']}, quick {QUICK['max_tokens']})",
    )
    p.add_argument(
        "--reps", type=int, help=f"repetitions; the median counts (default {FULL['reps']}, quick {QUICK['reps']})"
    )
    p.add_argument(
        "--threads", type=int, default=1, help="torch threads of every engine (default 1: a core per worker)"
    )
    p.add_argument("--engine", choices=["native", "vllm"], default="native", help="the engine of every system measured")
    p.add_argument(
        "--device", default="cpu", help="native engines' device: cpu, or cuda[:N] (every engine on that GPU)"
    )
    p.add_argument("--dtype", default="float32", choices=DTYPE_NAMES, help="every engine's dtype")
    p.add_argument(
        "--vllm-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="with --engine vllm: a vLLM "
        "engine argument for every engine, repeatable (enforce_eager=true starts in seconds, runs slower)",
    )
    p.add_argument(
        "--local-prefill",
        choices=("never", "auto", "always"),
        default="never",
        help="where the cluster computes prompts: its prefill worker (never), its decode worker (always) or "
        "whichever the Conductor predicts sooner (auto; conductor.local)",
    )
    p.add_argument(
        "--insecure",
        action="store_true",
        help="the cluster without TLS between its components (default: "
        "mutual TLS, as mooncake up; benchmarks/tls_bench.py compares the two)",
    )
    p.add_argument(
        "--network-hosts",
        action="store_true",
        help="the cluster's prefill worker (with its pool node) and "
        "decode worker on network hosts of their own (namespaces on a bridge; root only): the hand-off crosses "
        "tcp (or rdma) between hosts instead of shared memory on one",
    )
    p.add_argument("--no-serving", action="store_true", help="skip the gateway measurements")
    p.add_argument("--no-overlap", action="store_true", help="skip the overlap measurement")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--keep-logs-on-failure", action="store_true", help="keep the components' logs when the run fails")
    args = p.parse_args(argv)
    defaults = QUICK if args.quick else FULL
    for name in ("sizes", "overlap_sizes", "max_tokens", "reps"):
        if getattr(args, name) is None:
            setattr(args, name, defaults[name])
    if not args.sizes or not args.overlap_sizes or min(*args.sizes, *args.overlap_sizes) < 2:
        p.error("sizes must be at least 2 tokens")
    if args.reps < 1 or args.max_tokens < 2 or args.threads < 1:
        p.error("--reps and --threads must be >= 1, --max-tokens >= 2")
    global BLOCK_SIZE
    BLOCK_SIZE = default_block_size(args.engine)
    need = max(args.sizes) + args.max_tokens
    args.max_model_len = -(-need // 512) * 512  # the context every engine gets: the longest prompt and its output
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    console = Console(width=None if sys.stdout.isatty() else 170, log_path=False)
    report = run_interruptible(lambda: run(args, console), console)
    if report is None:
        return 130
    srows, orows = serving_rows(report), overlap_rows(report)
    render(report, srows, orows, console)
    if args.json:
        data = asdict(report) | {"serving": srows, "overlap_summary": orows, "pool_ttft_cut": pool_cut(srows)}
        args.json.write_text(json.dumps(data, indent=2) + "\n")
        console.print(f"raw numbers written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
