"""Chaos: the same replay with a component SIGKILLed mid-run; what each kind of failure costs a request.

    python -m benchmarks.chaos [--json PATH] [--model smollm2-135m|DIR] [--quick]
        [--victims prefill-0,decode-0,conductor,kv1]

1. A LocalCluster starts (the Conductor, ``--prefill`` prefill workers each with its pool
   node ``kv{i}``, ``--decode`` decode workers; every component its own process, one torch
   thread each; the launcher restarts a component that dies). SLOs are out of reach (TTFT
   300 s, TBT 10 s) so nothing is turned away; requests wait up to ``--hold-s`` while the
   Conductor is away.
2. The requests go through a ``ClusterBackend`` in this process (the gateway's code, with
   the gateway's ``RecoveryConfig``: ``hold_s``, and the TTFT SLO as the retry budget),
   ``--concurrency`` at a time. Each is a prompt of token ids, one of 4 shared 64-token
   prefixes and a suffix of 8 to 60 tokens, greedy, ``ignore_eos``, ``--max-tokens``.
   Per request: when it was issued, when each token came back, the tokens, and the
   ``Recovery`` of its last chunk (the faults it outlived, placements, resumes, tokens
   loaded from the pool and recomputed on a resume).
3. A warm-up replay (not counted: it fills the pool with every prompt's full blocks, as
   every later replay finds it), then the **baseline**: the same replay undisturbed.
4. One replay per victim in ``--victims``: the victim gets SIGKILL once a third of the
   requests are streaming. Before the next replay, the benchmark waits until the launcher
   has restarted it and the Conductor lists every worker and pool node alive again.

Reported per victim: requests ok and failed; for requests that outlived a fault, the
**extra latency** (their end-to-end time minus the same request's in the baseline;
p50 / p99, also per kind of fault); for resumed streams (a decode worker died
mid-stream), tokens **recomputed** against tokens **loaded** from the pool (sum, and the
most one stream recomputed, in blocks of the block size), and the largest gap between
two consecutive tokens of the stream (p50 / max); whether every output equals the
baseline's, token for token. Goals: a resumed stream recomputes at most one block, and
its gap across the failure stays under 2 s. Beside them, for reading the latencies on a
shared machine: each replay's e2e p50 over all its requests, the CPU time the machine's
other processes took during it (from /proc), the requests each decode worker finished,
and a warning when the code the components import changed during the run (a restarted
component would run the new code). See benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import logging
import math
import os
import random
import shlex
import shutil
import signal
import sys
import tempfile
import threading
import time
from dataclasses import asdict
from pathlib import Path

import grpc
import torch
from rich.console import Console
from rich.progress import (
    Progress,
)

from benchmarks import trace as tr
from benchmarks.benchutil import (
    code_mtimes,
    describe_machine,
    git_state,
    log_console,
    make_progress,
    resolve_model,
    run_interruptible,
    shielded,
)
from benchmarks.chaos_faults import DRAIN, Events, drain, victims, wait_drained, wait_recovered
from benchmarks.chaos_report import Replay, Report, RequestRecord, render, summarize
from conductor.local import LocalPrefill
from mooncake.blocks import blocks_for, model_fingerprint
from mooncake.cluster.config import ClusterConfig
from mooncake.cluster.launcher import LocalCluster
from mooncake.engine.tokenizer import Tokenizer
from mooncake.engine.weights import model_identity
from mooncake.gateway.cluster_backend import ClusterBackend
from mooncake.gateway.recovery import RecoveryConfig
from mooncake.localproc import RedisServer
from mooncake.serving.types import BackendError, GenerationRequest, Rejected

log = logging.getLogger("chaos")

SHARED_PREFIXES = 4
PREFIX_TOKENS = 64
SUFFIX_TOKENS = (8, 60)
MODEL_NAME = "chaos"
FULL = {"requests": 60}
QUICK = {"requests": 30}
DEFAULT_VICTIMS = "prefill-0,decode-0,conductor,kv1"


# -- the workload ---------------------------------------------------------------------------------


def workload(n: int, max_tokens: int, vocab: int) -> list[GenerationRequest]:
    """``n`` greedy requests sharing ``SHARED_PREFIXES`` prefixes; the same for the same arguments in every run."""
    rng = random.Random(f"chaos/{n}")

    def ids(k: int) -> list[int]:
        return [rng.randrange(32, vocab) for _ in range(k)]

    prefixes = [ids(PREFIX_TOKENS) for _ in range(SHARED_PREFIXES)]
    return [
        GenerationRequest.of(
            f"chaos-{i}",
            prefixes[i % SHARED_PREFIXES] + ids(rng.randint(*SUFFIX_TOKENS)),
            max_tokens,
            temperature=0.0,
            ignore_eos=True,
        )
        for i in range(n)
    ]


def trace_workload(n: int, vocab: int, load: float) -> tuple[list[GenerationRequest], dict[str, float]]:
    """The first ``n`` requests of the conversation trace, scaled as ``benchmarks.replay`` scales it (its preset and
    defaults), greedy; and when each is sent (seconds after the start) at ``load`` x the trace's default speed, the
    rate benchmarks/README.md measured as this cluster's capacity (x1)."""
    scaled = tr.load_trace(tr.DEFAULT_TRACE, limit=n, vocab_size=vocab, **tr.PRESETS["conversation"])
    speed = tr.DEFAULTS["speed"] * load
    requests = [
        GenerationRequest.of(f"chaos-{t.index}", t.prompt(), t.max_tokens, temperature=0.0, ignore_eos=True)
        for t in scaled
    ]
    return requests, {r.request_id: t.arrival_s / speed for r, t in zip(requests, scaled)}


def make_backend(cluster: LocalCluster) -> ClusterBackend:
    """What the cluster's gateway runs, with its recovery settings (hold_s, the TTFT SLO as the retry budget)."""
    c = cluster.config
    recovery = RecoveryConfig(hold_s=c.hold_s, retry_budget_s=c.ttft_slo_s)
    fingerprint = model_fingerprint(model_identity(c.model, getattr(torch, c.dtype)))
    return ClusterBackend(  # every Conductor: the gateway's code follows whichever leads
        cluster.conductor_addresses, c.model_name, c.max_model_len, c.block_size, fingerprint, recovery=recovery
    )


def replay(
    cluster: LocalCluster,
    requests: list[GenerationRequest],
    concurrency: int,
    result: Replay,
    events: Events,
    progress: Progress,
    task,
    console: Console,
    arrivals: dict[str, float] | None = None,
) -> None:
    """Run every request, ``concurrency`` at a time, into ``result``; kill ``result.victim`` (components joined by
    ``+``: all at once) once a third stream. With ``arrivals`` (request id -> seconds after the start), each request is
    sent at its time (open loop, ``concurrency`` is then a cap far above what the cluster holds) and the kill comes
    when a third have arrived.

    After a kill, returns only once the victim is back and registered (``wait_recovered``, watched from the kill on,
    so its times are not bounded by the replay's end).
    """
    records = {r.request_id: RequestRecord(r.request_id, len(r.prompt_token_ids), 0.0) for r in requests}
    result.requests = list(records.values())
    streaming = 0
    done = asyncio.Event()
    watcher: list[threading.Thread] = []
    failures: list[Exception] = []
    cpu = CpuMeter(cluster)
    served = decode_ok(cluster)

    async def one(req: GenerationRequest, gate: asyncio.Semaphore, be: ClusterBackend, t0: float) -> None:
        nonlocal streaming
        if arrivals is not None:  # open loop: sent at its time, whatever the others are doing
            await asyncio.sleep(max(0.0, t0 + arrivals[req.request_id] - time.perf_counter()))
        async with gate:
            rec = records[req.request_id]
            arrival = time.perf_counter()
            rec.arrival_s = arrival - t0
            try:
                async for chunk in be.generate(req):
                    now = round(time.perf_counter() - arrival, 6)
                    if chunk.token_ids and not rec.token_ids:
                        streaming += 1
                    rec.token_ids.extend(chunk.token_ids)
                    rec.token_times_s.extend([now] * len(chunk.token_ids))
                    if chunk.recovery is not None:
                        rec.recovery = asdict(chunk.recovery)
                    if chunk.finish_reason:
                        rec.finish_reason = chunk.finish_reason
            except Rejected as e:  # 429: turned away before any work when nothing streamed yet
                rec.error, rec.refused = f"Rejected: {e.message}", not rec.token_ids
                if not rec.refused:
                    console.log(f"[red]{req.request_id} refused[/] after {len(rec.token_ids)} tokens: {rec.error}")
            except BackendError as e:
                rec.error = f"{type(e).__name__}: {e.message}"
                console.log(f"[red]{req.request_id} failed[/] after {len(rec.token_ids)} tokens: {rec.error}")
            except Exception as e:  # a bug, not a fault the request should outlive: record it, keep the run going
                rec.error = f"unexpected {type(e).__name__}: {e}"
                log.exception("request %s", req.request_id)
            rec.e2e_s = time.perf_counter() - arrival
            progress.advance(task)

    def watch(killed_at: float) -> None:
        try:
            wait = wait_drained if result.victim.startswith(DRAIN) else functools.partial(wait_recovered, events=events)
            wait(cluster, result=result, since=killed_at, timeout_s=cluster.config.ready_timeout_s + 120)
        except Exception as e:  # noqa: BLE001  (raised in the caller's thread once the replay is done)
            failures.append(e)

    async def kill_when_busy(t0: float) -> None:
        if arrivals is not None:  # under load: once a third of the requests have arrived (many may be refused)
            await asyncio.sleep(max(0.0, t0 + sorted(arrivals.values())[len(requests) // 3] - time.perf_counter()))
        while arrivals is None and streaming < len(requests) // 3 and not done.is_set():
            await asyncio.sleep(0.02)
        if done.is_set():
            return
        if result.victim.startswith(DRAIN):
            drain(cluster, victims(result.victim)[0])
            result.kill_s = time.perf_counter() - t0
            console.log(f"drained {victims(result.victim)[0]} at {result.kill_s:.1f} s, {streaming} streaming")
            watcher.append(threading.Thread(target=watch, args=(time.perf_counter(),), daemon=True))
            watcher[0].start()
            return
        pids = [cluster.component(v).proc.pid for v in victims(result.victim)]
        for pid in pids:  # all at once
            cpu.before_kill(pid)
            os.kill(pid, signal.SIGKILL)
        killed_at = time.perf_counter()
        result.kill_s, result.killed_pid, result.streaming_at_kill = killed_at - t0, pids[0], streaming
        console.log(
            f"killed {result.victim} (pid {', '.join(map(str, pids))}) at {result.kill_s:.1f} s, {streaming} of "
            f"{len(requests)} requests streaming"
        )
        watcher.append(threading.Thread(target=watch, args=(killed_at,), name="chaos-recovery-watch", daemon=True))
        watcher[0].start()

    async def run() -> None:
        be = make_backend(cluster)
        gate = asyncio.Semaphore(concurrency)
        t0 = time.perf_counter()
        killer = asyncio.create_task(kill_when_busy(t0)) if result.victim else None
        try:
            await asyncio.gather(*(one(r, gate, be, t0) for r in requests))
        finally:
            done.set()
            if killer is not None:
                await killer
            await be.close()
            result.wall_s = time.perf_counter() - t0

    asyncio.run(run())
    result.cpu_machine_s, result.cpu_cluster_s = cpu.stop()
    result.load_average = os.getloadavg()[0]
    if watcher:
        progress.update(task, description=f"{result.name}: waiting until {result.victim} is back and registered")
        watcher[0].join()
        if failures:
            raise failures[0]
        if result.victim.startswith(DRAIN):
            console.log(f"{victims(result.victim)[0]} stopped {result.back_after_s:.1f} s after the drain")
        else:
            console.log(
                f"{result.victim} back {result.back_after_s:.1f} s after the kill, every instance registered "
                f"{result.registered_after_s:.1f} s after it"
            )
    for name, n in decode_ok(cluster).items():
        before = served.get(name)
        restarted = name in victims(result.victim or "") or before is None or (n is not None and n < before)
        result.decode_ok[name] = n if n is None or restarted else n - before


# -- what else ran: CPU time, which decode worker served, whether the code changed ----------------


def _machine_busy_s() -> float:
    """CPU seconds every core of the machine spent busy since boot (/proc/stat)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:9]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (0 once it is gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0.0
    rest = stat.rsplit(")", 1)[1].split()  # fields 3.. of proc(5); utime and stime are fields 14 and 15
    return (int(rest[11]) + int(rest[12])) / os.sysconf("SC_CLK_TCK")


class CpuMeter:
    """CPU time used during one replay: by the whole machine, and by the cluster's components plus this process.

    The difference is what other work on the machine took (on a shared 2-core machine, it moves every latency).
    """

    def __init__(self, cluster: LocalCluster) -> None:
        self._cluster = cluster
        self._machine = _machine_busy_s()
        self._own = sum(os.times()[:2])
        self._pids = self._component_cpu()
        self._killed_pid, self._killed = None, 0.0

    def _component_cpu(self) -> dict[int, float]:
        return {c.proc.pid: _process_cpu_s(c.proc.pid) for c in self._cluster.components.values() if c.proc is not None}

    def before_kill(self, pid: int) -> None:
        self._killed_pid, self._killed = pid, _process_cpu_s(pid) - self._pids.get(pid, 0.0)

    def stop(self) -> tuple[float, float]:
        """(machine CPU s, cluster + this process CPU s) since the meter started."""
        now = self._component_cpu()  # the victim's old process, while the launcher has not started it again: gone, 0
        cluster = (
            sum(cpu - self._pids.get(pid, 0.0) for pid, cpu in now.items() if pid != self._killed_pid) + self._killed
        )
        return _machine_busy_s() - self._machine, cluster + sum(os.times()[:2]) - self._own


def decode_ok(cluster: LocalCluster) -> dict[str, int | None]:
    """Requests each decode worker finished since it started (its mooncake_decode_requests counter), None if it does not
    answer."""
    import httpx

    out: dict[str, int | None] = {}
    for name, comp in cluster.components.items():
        if not name.startswith("decode-"):
            continue
        try:
            text = httpx.get(f"http://{comp.info['metrics']}/metrics", timeout=5).text
            out[name] = int(
                sum(
                    float(ln.split()[-1])
                    for ln in text.splitlines()
                    if ln.startswith('mooncake_decode_requests_total{outcome="ok"}')
                )
            )
        except (httpx.HTTPError, KeyError, ValueError):
            out[name] = None
    return out


# -- the run ---------------------------------------------------------------------------------------


def run(args: argparse.Namespace, console: Console) -> Report:
    started = time.perf_counter()
    workdir = Path(tempfile.mkdtemp(prefix="chaos-"))
    ok = False
    cluster = redis = None
    try:
        model_dir, model = resolve_model(args, workdir)
        vocab = Tokenizer.from_dir(str(model_dir)).vocab_size
        if args.load:
            requests, arrivals = trace_workload(args.requests, vocab, args.load)
        else:
            requests, arrivals = workload(args.requests, args.max_tokens, vocab), None
        longest = max(len(r.prompt_token_ids) + r.sampling.max_tokens for r in requests)
        base = {
            "model": str(model_dir),
            "model_name": MODEL_NAME,
            "prefill": args.prefill,
            "decode": args.decode,
            "port": 0,
            # every prompt through a prefill worker: the kills hit the hand-off paths
            "local_prefill": LocalPrefill.NEVER,
            # max_model_len in 512s, as the tests: a decode worker's landing slots are two full contexts
            "threads": args.threads,
            "workdir": workdir / "cluster",
            "max_model_len": -(-longest // 512) * 512,
            "hold_s": args.hold_s,
            "ready_timeout_s": 600.0,
        }
        if args.conductors > 1:  # standbys elect their leader in Redis
            redis = RedisServer(workdir)
            base |= {"conductors": args.conductors, "redis_url": redis.url}
        if not args.load:  # quiet: nothing turned away; under load the SLOs stay at their defaults (rejection live)
            base |= {"ttft_slo_s": 300.0, "tbt_slo_s": 10.0}
        block_size = ClusterConfig(**base).block_size
        blocks = sum(blocks_for(len(r.prompt_token_ids) + r.sampling.max_tokens, block_size) for r in requests) + 64
        config = ClusterConfig(
            **base, pool_dram_mib=max(64, math.ceil(blocks * ClusterConfig(**base).block_bytes() / 2**20))
        )
        report = Report(
            command=shlex.join([sys.executable, *sys.argv]),
            started_at=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            machine=describe_machine(torch=torch.__version__, grpc=grpc.__version__),
            model=model,
            quick=args.quick,
            git=git_state(),
            requests=args.requests,
            concurrency=args.concurrency,
            max_tokens=args.max_tokens,
            block_size=block_size,
            victims=list(args.victims),
            config={"cluster": config.model_dump(mode="json")},
            load=args.load,
            slo=(config.ttft_slo_s, config.tbt_slo_s),
        )
        console.print(
            f"model {model} ({model_dir}); {args.prefill} prefill + {args.decode} decode workers, {args.threads} torch "
            f"thread(s) each; {args.requests} requests, "
            + (f"the trace open loop at x{args.load:g}" if args.load else f"{args.concurrency} at a time")
            + f"; victims {', '.join(args.victims)}"
        )
        progress = make_progress(console, args.no_progress)
        with progress:
            task = progress.add_task("starting the cluster", total=args.requests * (2 + len(args.victims)))
            t0 = time.perf_counter()
            events = Events(console)
            code = code_mtimes()
            cluster = LocalCluster(
                config, lambda msg: (events.on_event(msg), progress.update(task, description=f"cluster: {msg}"))
            )
            cluster.start()
            report.startup_s = time.perf_counter() - t0
            unknown = [v for vs in args.victims for v in victims(vs) if v not in cluster.components]
            if unknown:
                raise ValueError(
                    f"no component {', '.join(unknown)} in this cluster; it has {', '.join(cluster.components)}"
                )
            for name, victim in [("warm-up", None), ("baseline", None), *((v, v) for v in args.victims)]:
                progress.update(
                    task, description=f"{name}: {args.requests} requests" + (f", killing {victim}" if victim else "")
                )
                result = Replay(name, victim)
                concurrency = len(requests) if args.load else args.concurrency
                replay(cluster, requests, concurrency, result, events, progress, task, console, arrivals)
                report.replays.append(result)
                refused = sum(r.refused for r in result.requests)
                failed = sum(not r.ok for r in result.requests) - refused
                served = ", ".join(f"{k} {'?' if v is None else v}" for k, v in sorted(result.decode_ok.items()))
                console.log(
                    f"{name}: {args.requests - failed - refused} ok, {refused} refused, {failed} failed, "
                    f"{sum(r.recovery is not None for r in result.requests)} outlived a fault, {result.wall_s:.1f} s; "
                    f"requests per decode worker: {served}; CPU used by other processes "
                    f"{result.cpu_machine_s - result.cpu_cluster_s:.0f} s of {result.cpu_machine_s:.0f} s"
                )
            report.events = [(when - t0, msg) for when, msg in events.seen]
            report.code_changed = sorted(f for f, m in code_mtimes().items() if code.get(f) != m)
        report.total_wall_s = time.perf_counter() - started
        ok = True
        return report
    finally:
        with shielded():
            if cluster is not None:
                cluster.stop()
            if redis is not None:
                redis.stop()
            if args.keep_logs or (not ok and args.keep_logs_on_failure):
                console.print(f"logs kept in {workdir / 'cluster'}")
            else:
                shutil.rmtree(workdir, ignore_errors=True)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", type=Path, help="write every raw number (and the command line) to this file")
    p.add_argument(
        "--model", default=None, help="a model pulled into the cache (smollm2-135m, the default) or a model directory"
    )
    p.add_argument(
        "--quick", action="store_true", help="a smoke run: the tiny random model (unless --model) and fewer requests"
    )
    p.add_argument(
        "--requests", type=int, help=f"requests per replay (default {FULL['requests']}, quick {QUICK['requests']})"
    )
    p.add_argument("--concurrency", type=int, default=6, help="requests in flight at once (default 6)")
    p.add_argument(
        "--load",
        type=float,
        default=None,
        help="under load: the conversation trace open loop at this multiple of the cluster's capacity (1, 2), the "
        "SLOs at their defaults (early rejection live), instead of --concurrency synthetic requests; --max-tokens is "
        "then the trace's (at most 32)",
    )
    p.add_argument("--max-tokens", type=int, default=64, help="output tokens per request (default 64)")
    p.add_argument(
        "--victims",
        default=DEFAULT_VICTIMS,
        help=f"components to kill, comma-separated, one replay each (default {DEFAULT_VICTIMS}; any of "
        "conductor, kv<i>, prefill-<i>, decode-<i>, or several joined by + killed at once: conductor+kv0, or "
        "drain:prefill-<i> / drain:decode-<i> / drain:kv<i> (with its prefill worker, its blocks copied to the other "
        "nodes first), drained as `mooncake pool drain` does and not restarted, so put drains "
        "last; the gateway is not on the requests' path here)",
    )
    p.add_argument("--prefill", type=int, default=2, help="prefill workers, each with its pool node (default 2)")
    p.add_argument("--decode", type=int, default=2, help="decode workers (default 2)")
    p.add_argument(
        "--conductors",
        type=int,
        default=1,
        help="Conductors (default 1); more: one leads, the others stand by (a Redis server is started), so the "
        "victim `conductor` (the first, which leads at the start) is taken over by a standby",
    )
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker (default 1)")
    p.add_argument(
        "--hold-s", type=float, default=30.0, help="how long a request waits while the Conductor is away (default 30)"
    )
    p.add_argument(
        "--log-level",
        default="WARNING",
        help="this process's log level (the ClusterBackend logs each fault at WARNING)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--keep-logs", action="store_true", help="keep the components' logs (their directory is printed)")
    p.add_argument("--keep-logs-on-failure", action="store_true", help="keep the components' logs when the run fails")
    args = p.parse_args(argv)
    if args.requests is None:
        args.requests = (QUICK if args.quick else FULL)["requests"]
    args.victims = [v.strip() for v in args.victims.split(",") if v.strip()]
    if (
        args.requests < 3
        or args.concurrency < 1
        or args.max_tokens < 2
        or args.threads < 1
        or args.prefill < 1
        or args.decode < 1
        or (args.load is not None and args.load <= 0)
    ):
        p.error(
            "--requests must be >= 3, --max-tokens >= 2, --concurrency, --threads, --prefill and --decode >= 1, "
            "--load > 0"
        )
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    console = log_console(args.log_level)
    report = run_interruptible(lambda: run(args, console), console)
    if report is None:
        return 130
    rows, kind_rows, goals = summarize(report)
    render(report, rows, kind_rows, goals, console)
    if args.json:
        data = asdict(report) | {"summary": rows, "by_fault": kind_rows, "goals": goals}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(data, indent=2) + "\n")
        console.print(f"raw numbers written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
