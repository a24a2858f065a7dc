"""Trace replay against several serving systems on this machine: effective request capacity (or SLO attainment) per
system.

    python -m benchmarks.compare [--trace PATH] [--model smollm2-135m|DIR] [--limit N] [--speed S]
        [--sweep 0.5,1,2] [--policies kvcache_centric,cache_aware_local,least_loaded,random]
        [--vllm] [--json PATH] [--plot PATH] [--quick]

The same scaled trace (benchmarks/replay.py: hash ids -> fixed token runs, lengths x
block_tokens/512, time / speed) is replayed against each system in turn, one at a time so
they never share the cores; every system is started fresh (empty caches), gets one warm-up
request (not counted), then the replay (one per rate factor with ``--sweep``), then is
stopped:

- **coupled** (the baseline): ``python -m mooncake.gateway --local``, one engine doing
  prefill and decode (its own prefix cache, no pool, no Conductor, nothing rejected),
  ``--coupled-threads`` torch threads (default: every usable core, the machine the
  cluster's workers share);
- **disaggregated/<policy>**: a ``LocalCluster`` (Conductor with that prefill policy and
  ``--admission``, ``--prefill`` prefill workers each with its own pool node, ``--decode``
  decode workers, the gateway; every component its own process, 1 torch thread a
  worker). Two prefill workers by default: with one, every policy places every request
  on the same worker and the policies cannot differ;
- **disaggregated-vllm/<policy>** (``--systems disaggregated-vllm``): the same cluster
  with stock vLLM as every worker's engine (``--engine vllm``, block size 32,
  ``--cluster-vllm-arg`` passed to each), one core bound to each worker;
- **vllm-cpu** (``--vllm``): vLLM's own OpenAI server (``--vllm-python``, default this
  interpreter: ``make`` installs vLLM into .venv), run as benchmarks/engine_bench.py runs
  vllm-cpu (float32, its threads bound to every usable core, 4 GiB of KV cache; prefix
  caching on, vLLM's default). Skipped, saying why, when vLLM is missing.

The Conductor gets the benchmark's SLOs (TTFT 10 s, TBT 0.5 s by default) for its
admission and the decode workers' batch cap. Output: one table (per system: effective
request capacity with ``--sweep``, else SLO attainment at ``--speed``; TTFT and TBT p50/p90;
rejections; cache hit ratio; the ratio to coupled), the goals, ``--json`` (every
per-request number) and ``--plot`` (CDFs, effective share vs rate). See
benchmarks/README.md for the defaults and run times.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
from rich.console import Console

from benchmarks import replay as rp
from benchmarks import trace as tr
from benchmarks.benchutil import (
    describe_machine,
    make_progress,
    resolve_model,
    run_interruptible,
    scratch_dir,
    shielded,
)
from benchmarks.prediction_parts import describe_handoffs
from conductor.admission import AdmissionKind
from mooncake.cluster.components import component_argv
from mooncake.cluster.config import ClusterConfig
from mooncake.cluster.launcher import Component, LocalCluster
from mooncake.localproc import usable_cpus

MODEL_NAME = "bench"
ALL_POLICIES = ("kvcache_centric", "cache_aware_local", "least_loaded", "random")
DEFAULT_VLLM_PYTHON = Path(sys.executable)  # vLLM is the project's `vllm` extra, installed into .venv by make
SYSTEM_KINDS = ("coupled", "disaggregated", "disaggregated-fp8pool", "disaggregated-vllm", "vllm")
QUICK = dict(limit=20, speed=0.5)


@dataclass
class SystemRun:
    """One system's part of the comparison."""

    name: str
    kind: str  # coupled, disaggregated, vllm
    config: dict = field(default_factory=dict)
    startup_s: float | None = None
    runs: list[dict] = field(default_factory=list)  # replay.sweep's runs
    capacity: dict | None = None
    skipped: str | None = None  # why it did not run (not a failure of the system)
    error: str | None = None  # why it failed
    conductor_metrics: str | None = None  # a cluster's Conductor's /metrics (its prediction scores), once started


# -- the systems ----------------------------------------------------------------------------------------


def worker_threads(args: argparse.Namespace) -> int | None:
    """The torch threads each cluster worker runs: ``--worker-threads``, or what ``mooncake up`` chooses (None on
    CUDA: torch's)."""
    config = ClusterConfig(
        model="-", model_name=MODEL_NAME, prefill=args.prefill, decode=args.decode, device=args.device
    )
    return args.worker_threads or config.threads


def _stop(proc: subprocess.Popen | None, grace_s: float = 20.0) -> None:
    """SIGTERM, wait up to ``grace_s``, SIGKILL."""
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


@contextlib.contextmanager
def coupled_server(args, model_dir: Path, workdir: Path, run: SystemRun, say: Callable[[str], None]) -> Iterator[str]:
    """``python -m mooncake.gateway --local`` on a free port; yields its OpenAI base URL."""
    argv = component_argv(
        "gateway",
        local=True,
        model=model_dir,
        model_name=MODEL_NAME,
        port=0,
        max_model_len=args.max_model_len,
        threads=args.coupled_threads if args.device == "cpu" else None,
        device=args.device,
        dtype=args.dtype,
        log_level="WARNING",
        max_num_batched_tokens=args.coupled_batched_tokens,
    )
    run.config = {"argv": argv}
    gateway = Component("coupled-gateway", argv, workdir / "coupled" / "gateway.log")
    try:
        say("coupled: starting python -m mooncake.gateway --local")
        gateway.start()
        yield f"{gateway.wait_ready(300.0)['http']}/v1"
    finally:
        with shielded():
            _stop(gateway.proc)


@contextlib.contextmanager
def cluster_server(
    args,
    model_dir: Path,
    workdir: Path,
    policy: str,
    run: SystemRun,
    say: Callable[[str], None],
    engine: str = "native",
) -> Iterator[str]:
    """A LocalCluster with prefill ``policy`` and ``engine`` in its workers ("fp8pool": ours with --pool-kv-dtype fp8,
    the pool and the hand-offs the Conductor narrows in FP8); yields its OpenAI base URL."""
    vllm = dict(engine="vllm", vllm_args=args.cluster_vllm_arg) if engine == "vllm" else {}
    if engine == "fp8pool":
        vllm = dict(pool_kv_dtype="fp8")
    hosts = dict(network_hosts=True, link_mbit=args.link_mbit) if args.network_hosts else {}
    config = ClusterConfig(
        model=str(model_dir),
        model_name=MODEL_NAME,
        prefill=args.prefill,
        decode=args.decode,
        port=0,
        policy=policy,
        admission=args.admission,
        local_prefill=args.local_prefill,
        ttft_slo_s=args.ttft_slo,
        tbt_slo_s=args.tbt_slo,
        workdir=workdir / f"cluster-{engine}-{policy}",
        max_model_len=args.max_model_len,
        device=args.device,
        dtype=args.dtype,
        threads=args.worker_threads,
        restart=False,
        ready_timeout_s=args.vllm_timeout if vllm else 300.0,
        worker_nice=args.worker_nice,
        **vllm,
        **hosts,
    )
    run.config = config.model_dump(mode="json")
    cluster = LocalCluster(config, lambda msg: say(f"{run.name}: {msg}"))
    try:
        cluster.start()
        metrics = cluster.component("conductor").info.get("metrics")
        run.conductor_metrics = f"http://{metrics}/metrics" if metrics else None
        yield cluster.endpoint
    finally:
        with shielded():
            cluster.stop()


VLLM_OPTIONAL_FLAGS = (
    "--enable-prompt-tokens-details",
)  # cached-token counts in usage; dropped if this vLLM lacks them


@contextlib.contextmanager
def vllm_server(args, model_dir: Path, workdir: Path, run: SystemRun, say: Callable[[str], None]) -> Iterator[str]:
    """vLLM's OpenAI server from ``--vllm-python``; yields its base URL once /health answers 200."""
    from benchmarks.engine_bench import (
        vllm_env,  # how this repository runs vllm-cpu: threads bound to every usable core
    )
    from mooncake.localproc import free_port

    port = free_port("127.0.0.1")
    base = [
        str(args.vllm_python),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_dir),
        "--served-model-name",
        MODEL_NAME,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--max-model-len",
        str(args.max_model_len),
        "--seed",
        "0",
        *shlex.split(args.vllm_args),
    ]
    log_path = workdir / "vllm" / "server.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    proc = None
    try:
        for extra in (list(VLLM_OPTIONAL_FLAGS), []):
            argv = base + extra
            run.config = {
                "argv": argv,
                "env": {
                    k: v
                    for k, v in vllm_env(usable_cpus(), 4, args.vllm_python).items()
                    if k.startswith(("VLLM", "OMP", "LD_PRELOAD"))
                },
            }
            say(f"vllm-cpu: starting its OpenAI server (a minute or more){' with ' + ' '.join(extra) if extra else ''}")
            with open(log_path, "ab") as log:
                proc = subprocess.Popen(
                    argv,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    env=vllm_env(usable_cpus(), 4, args.vllm_python),
                    start_new_session=True,
                )
            if _wait_http(f"http://127.0.0.1:{port}/health", proc, args.vllm_timeout):
                yield f"http://127.0.0.1:{port}/v1"
                return
            text = log_path.read_text(errors="replace")
            if extra and "unrecognized arguments" in text:
                log_path.write_text("")
                continue
            raise RuntimeError(
                f"vLLM's server {'exited' if proc.poll() is not None else 'did not answer /health in time'}; "
                f"the end of {log_path}:\n" + "\n".join(text.splitlines()[-25:])
            )
    finally:
        with shielded():
            _stop(proc, 30.0)


def _wait_http(url: str, proc: subprocess.Popen, timeout_s: float) -> bool:
    """Poll ``url`` until 200 (True), or the process exits or time runs out (False)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(url, timeout=2.0, trust_env=False).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    return False


# -- the run ---------------------------------------------------------------------------------------------


def measure(run: SystemRun, server, requests, args, vocab: int, progress, console: Console) -> None:
    """Start the system, warm it up, replay (each rate), stop it; failures land in ``run.error``."""
    status = progress.add_task(f"{run.name}: starting", total=None)
    say = lambda msg: progress.update(status, description=msg)
    t0 = time.perf_counter()
    try:
        with server(say) as url:
            run.startup_s = time.perf_counter() - t0
            say(f"{run.name}: warm-up request")
            rp.warm_up(url, MODEL_NAME, vocab)
            progress.update(status, visible=False)

            def on_run(r: dict) -> None:
                s = r["summary"]
                console.log(
                    f"{run.name:>32} x{r['rate_factor']:<5g} {s['offered_rate_rps']:.2f} req/s: SLO met "
                    f"{s['slo_attainment']:.1%}, TTFT p50 {rp._ms(s['ttft_p50_s'])} ms, TBT p50 "
                    f"{rp._ms(s['tbt_p50_s'])} ms, {s['rejected']} rejected, {s['errors']} errors, cache hit "
                    f"{rp._share(s['cache_hit_ratio'])}"
                    + (f"; {rp.describe_predictions(s)}" if s.get("predicted_requests") else "")
                    + (f"; {describe_handoffs(s['handoffs'])}" if s.get("handoffs") else "")
                )
                for line in rp.describe_phases(r):
                    console.log(f"{run.name:>32}   {line}")

            result = rp.sweep(
                requests,
                url,
                MODEL_NAME,
                args.factors,
                speed=args.speed,
                effective_target=args.effective_target,
                progress=progress,
                label=run.name,
                on_run=on_run,
                ttft_slo_s=args.ttft_slo,
                tbt_slo_s=args.tbt_slo,
                concurrency_limit=args.concurrency_limit,
                timeout_s=args.timeout,
                conductor_metrics=run.conductor_metrics,
                profile=args.rate_profile,
            )
            run.runs, run.capacity = result["runs"], result["capacity"]
            say(f"{run.name}: stopping")
    except (RuntimeError, ValueError, OSError) as e:  # a system that fails to start or serve: say why, run the rest
        run.error = f"{type(e).__name__}: {e}" if not isinstance(e, RuntimeError) else str(e)
        console.log(f"[red]{run.name} failed[/]: {e}")
    finally:
        progress.remove_task(status)


def systems(args, model_dir: Path, workdir: Path) -> list[tuple[SystemRun, Callable | None]]:
    """(the run record, a context-manager factory taking ``say``) per system, in the order they run."""
    out: list[tuple[SystemRun, Callable | None]] = []
    if "coupled" in args.systems:
        r = SystemRun("coupled", "coupled")
        out.append((r, lambda say, r=r: coupled_server(args, model_dir, workdir, r, say)))
    for policy in args.policies if "disaggregated" in args.systems else ():
        r = SystemRun(f"disaggregated/{policy}", "disaggregated")
        out.append((r, lambda say, r=r, policy=policy: cluster_server(args, model_dir, workdir, policy, r, say)))
    for policy in args.policies if "disaggregated-fp8pool" in args.systems else ():
        r = SystemRun(f"disaggregated-fp8pool/{policy}", "disaggregated-fp8pool")
        out.append(
            (r, lambda say, r=r, policy=policy: cluster_server(args, model_dir, workdir, policy, r, say, "fp8pool"))
        )
    for policy in args.policies if "disaggregated-vllm" in args.systems else ():
        r = SystemRun(f"disaggregated-vllm/{policy}", "disaggregated-vllm")
        out.append(
            (r, lambda say, r=r, policy=policy: cluster_server(args, model_dir, workdir, policy, r, say, "vllm"))
        )
    if "vllm" in args.systems:
        r = SystemRun("vllm-cpu", "vllm")
        if not _has_vllm(args.vllm_python):
            r.skipped = f"{args.vllm_python} cannot import vllm (`make vllm` installs it into .venv)"
            out.append((r, None))
        else:
            out.append((r, lambda say, r=r: vllm_server(args, model_dir, workdir, r, say)))
    return out


def _has_vllm(python: Path) -> bool:
    if not python.exists():
        return False
    return subprocess.run([str(python), "-c", "import vllm"], capture_output=True, timeout=120).returncode == 0


def reference_run(run: SystemRun) -> dict | None:
    """The run whose percentiles the table shows: the rate factor closest to 1."""
    return min(run.runs, key=lambda r: abs(r["rate_factor"] - 1.0)) if run.runs else None


def headline(run: SystemRun, sweeping: bool) -> float | None:
    """Effective request capacity (req/s) in a sweep, else SLO attainment."""
    if sweeping:
        return run.capacity["rate_rps"] if run.capacity else None
    ref = reference_run(run)
    return ref["summary"]["slo_attainment"] if ref else None


def rows_and_goals(runs: list[SystemRun], sweeping: bool) -> tuple[list[dict], list[dict]]:
    by_name = {r.name: r for r in runs}
    base = headline(by_name["coupled"], sweeping) if "coupled" in by_name else None
    # coupled missed the target even at the lowest rate: its capacity is below that rate,
    # so a ratio is only bounded below
    coupled_runs = by_name["coupled"].runs if "coupled" in by_name else []
    floor = min(r["summary"]["offered_rate_rps"] for r in coupled_runs) if sweeping and coupled_runs else None
    rows = []
    for run in runs:
        ref = reference_run(run)
        value = headline(run, sweeping)
        rows.append(
            {
                "system": run.name,
                "headline": value,
                "ratio_vs_coupled": value / base if value is not None and base else None,
                "ratio_vs_coupled_above": value / floor if value and base is None and floor else None,
                "capacity": run.capacity,
                "reference_rate_factor": ref["rate_factor"] if ref else None,
                "summary": ref["summary"] if ref else None,
                "skipped": run.skipped,
                "error": run.error,
            }
        )
    goals = []
    ours = by_name.get("disaggregated/kvcache_centric")
    if ours is not None and ours.runs:
        v = headline(ours, sweeping) or 0.0
        others = [("coupled", "disaggregated (kvcache_centric) >= coupled")]
        others += [
            (n, f"kvcache_centric >= {n.split('/')[1]}")
            for n in by_name
            if n.startswith("disaggregated/") and n != ours.name
        ]
        others += [("vllm-cpu", "disaggregated (kvcache_centric) >= vllm-cpu")] if "vllm-cpu" in by_name else []
        for name, text in others:
            if name in by_name and by_name[name].runs:  # a system left out with --systems has no goal
                theirs = headline(by_name[name], sweeping) or 0.0
                goals.append({"goal": text, "ours": v, "theirs": theirs, "met": v >= theirs})
    for name, narrow in by_name.items():  # --pool-kv-dtype fp8 against the same cluster at full precision
        full = by_name.get(name.replace("disaggregated-fp8pool/", "disaggregated/"))
        if name.startswith("disaggregated-fp8pool/") and narrow.runs and full is not None and full.runs:
            v, theirs = headline(narrow, sweeping) or 0.0, headline(full, sweeping) or 0.0
            goals.append({"goal": f"{name} > {full.name}", "ours": v, "theirs": theirs, "met": v > theirs})
    ours_vllm = next((r for n, r in by_name.items() if n.startswith("disaggregated-vllm/") and r.runs), None)
    alone = by_name.get("vllm-cpu")
    if ours_vllm is not None and alone is not None and alone.runs:
        v, theirs = headline(ours_vllm, sweeping) or 0.0, headline(alone, sweeping) or 0.0
        # vLLM alone missed the target even at the lowest rate: its capacity is below that rate (the bound used here)
        if sweeping and alone.capacity and alone.capacity.get("rate_factor") is None:
            theirs = min(r["summary"]["offered_rate_rps"] for r in alone.runs)
            text = f"{ours_vllm.name} >= 2x vllm-cpu (vllm-cpu below its lowest rate, {theirs:.2f} req/s)"
        else:
            text = f"{ours_vllm.name} >= 2x vllm-cpu"
        goals.append({"goal": text, "ours": v, "theirs": theirs, "met": v >= 2 * theirs})
    return rows, goals


def render(rows: list[dict], goals: list[dict], args, scaling: tr.Scaling, model: str, console: Console) -> None:
    from rich.table import Table

    sweeping = len(args.factors) > 1
    metric = f"capacity (>= {args.effective_target:.0%} effective)" if sweeping else "SLO met"
    title = (
        f"Trace replay, one system at a time: {model}, {args.limit} requests, SLOs TTFT {args.ttft_slo:g} s / TBT "
        f"{args.tbt_slo:g} s; disaggregated = {args.prefill} prefill + {args.decode} decode (1 thread each), coupled = "
        f"one engine ({args.coupled_threads} threads)"
    )
    caption = (
        scaling.describe(args.speed)
        + (
            f"; rates x{', x'.join(f'{f:g}' for f in args.factors)}; percentiles, 429 and "
            "cache hit at the rate closest to x1"
            if sweeping
            else ""
        )
        + "; ms; ratio = system / coupled (above 1: better)"
    )
    table = Table(title=title, caption=caption)
    for col in (
        "system",
        metric,
        "vs coupled",
        "TTFT p50",
        "TTFT p90",
        "TBT p50",
        "TBT p90",
        "429",
        "err",
        "cache hit",
    ):
        table.add_column(col, justify="left" if col == "system" else "right")
    for r in rows:
        if r["skipped"] or r["error"]:
            table.add_row(r["system"], "skipped (below)" if r["skipped"] else "[red]failed[/] (below)", *[""] * 8)
            continue
        s = r["summary"]
        if sweeping:
            cap = r["capacity"]
            value = (
                "< lowest"
                if cap["rate_factor"] is None
                else f"{cap['rate_rps']:.2f} req/s (x{cap['rate_factor']:g}){'+' if cap['saturated'] else ''}"
            )
        else:
            value = rp._share(r["headline"])
        ratio = (
            "-"
            if r["ratio_vs_coupled"] is None and r["ratio_vs_coupled_above"] is None
            else f"{r['ratio_vs_coupled']:.2f}x"
            if r["ratio_vs_coupled"] is not None
            else f"> {r['ratio_vs_coupled_above']:.2f}x"
        )
        table.add_row(
            r["system"],
            value,
            ratio,
            rp._ms(s["ttft_p50_s"]),
            rp._ms(s["ttft_p90_s"]),
            rp._ms(s["tbt_p50_s"]),
            rp._ms(s["tbt_p90_s"]),
            str(s["rejected"]),
            str(s["errors"]),
            rp._share(s["cache_hit_ratio"]),
        )
    console.print(table)
    if sweeping:
        console.print(
            "'+': every rate met the target (the capacity is at least that); '< lowest': even the lowest rate missed it"
        )
    for g in goals:
        fmt = (lambda v: f"{v:.2f} req/s") if sweeping else rp._share
        mark = "[green]PASS[/]" if g["met"] else "[red]MISS[/]"
        console.print(f"goal {g['goal']}: {fmt(g['ours'])} vs {fmt(g['theirs'])} {mark}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], epilog="See the module docstring and benchmarks/README.md."
    )
    p.add_argument("--model", default=None, help="a registry name (smollm2-135m, the default) or a model directory")
    p.add_argument(
        "--quick",
        action="store_true",
        help=f"smoke run: the tiny random model, --limit {QUICK['limit']}, one rate, kvcache_centric only",
    )
    p.add_argument(
        "--policies",
        default=None,
        help=f"disaggregated prefill policies, comma-separated (default: {','.join(ALL_POLICIES)})",
    )
    p.add_argument(
        "--device",
        default="cpu",
        help="cpu, or cuda[:N]: the cluster's workers and the coupled engine on that GPU (one GPU: a prefill and a "
        "decode worker share it), the trace at GPU_SCALE (benchmarks/trace.py) where its flags are not given; "
        "vllm-cpu is left out",
    )
    p.add_argument(
        "--dtype", choices=("float32", "bfloat16", "float16"), help="default: float32 on the CPU, bfloat16 on CUDA"
    )
    p.add_argument(
        "--prefill",
        type=int,
        default=None,
        help="prefill workers of the cluster, each with its own pool node (default: 2 on the CPU, 1 on CUDA)",
    )
    p.add_argument("--decode", type=int, default=1, help="decode workers of the cluster")
    p.add_argument(
        "--admission",
        choices=[kind.value for kind in AdmissionKind],
        default=ClusterConfig.model_fields["admission"].default.value,
        help="the Conductor's admission policy (default: mooncake up's, %(default)s)",
    )
    p.add_argument(
        "--local-prefill",
        choices=("never", "auto", "always"),
        default="never",
        help="where the cluster computes prompts: a prefill worker (never), the decode worker itself (always) or "
        "whichever the Conductor predicts sooner (auto; conductor.local)",
    )
    p.add_argument(
        "--worker-threads",
        type=int,
        default=None,
        help="torch threads of each cluster worker (default: mooncake up's, the usable cores shared evenly among the "
        "workers that compute, at least 1)",
    )
    p.add_argument(
        "--worker-nice",
        type=int,
        default=ClusterConfig.model_fields["worker_nice"].default,
        help="the cluster's workers and pool nodes this much below normal CPU priority (mooncake up's --worker-nice, "
        "and its default: 0, as vllm-cpu and the client run)",
    )
    p.add_argument(
        "--coupled-threads",
        type=int,
        default=len(usable_cpus()),
        help="torch threads of the coupled engine (default: every usable core)",
    )
    p.add_argument(
        "--coupled-batched-tokens",
        type=int,
        default=512,
        help="the coupled engine's per-step token budget (its prefill chunk)",
    )
    p.add_argument("--vllm", action="store_true", help="also replay against vllm-cpu's OpenAI server")
    p.add_argument(
        "--vllm-python", type=Path, default=DEFAULT_VLLM_PYTHON, help="a Python that imports vllm (default: this one)"
    )
    p.add_argument(
        "--vllm-args", default="", help="more flags for vLLM's server, one string, e.g. '--max-num-batched-tokens 256'"
    )
    p.add_argument(
        "--vllm-timeout", type=float, default=600.0, help="seconds vLLM's server (or a vLLM cluster) may take to start"
    )
    p.add_argument(
        "--cluster-vllm-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="disaggregated-vllm: a vLLM engine argument for every worker, repeatable",
    )
    p.add_argument(
        "--systems",
        default=None,
        help="which to run, comma-separated, from coupled, disaggregated, disaggregated-fp8pool (--pool-kv-dtype "
        "fp8), disaggregated-vllm, vllm (default: coupled,disaggregated, and vllm with --vllm); e.g. --systems vllm "
        "to measure vLLM again alone",
    )
    p.add_argument(
        "--network-hosts",
        action="store_true",
        help="the clusters' prefill workers (each with its pool node) and decode workers each on a network host of its "
        "own (namespaces on a bridge; root only): hand-offs and prefix fetches cross a network, over tcp",
    )
    p.add_argument(
        "--link-mbit",
        type=float,
        default=None,
        help="with --network-hosts: each host's link limited to this many megabits a second each way (tc tbf)",
    )
    p.add_argument("--keep-logs", action="store_true", help="keep the components' logs (their directory is printed)")
    rp.add_trace_args(p)
    args = p.parse_args(argv)
    if not re.fullmatch(r"cpu|cuda(:\d+)?", args.device):
        p.error(f"--device: cpu or cuda[:N], got {args.device!r}")
    cuda = args.device.startswith("cuda")
    scale = tr.GPU_SCALE if cuda else tr.DEFAULTS
    tr.apply_preset(args, scale)
    args.dtype = args.dtype or ("bfloat16" if cuda else "float32")
    args.prefill = args.prefill or (1 if cuda else 2)
    args.limit = args.limit or (QUICK["limit"] if args.quick else tr.DEFAULTS["limit"])
    args.speed = args.speed or (QUICK["speed"] if args.quick else scale["speed"])
    args.factors = [1.0] if args.quick and not args.sweep else (args.sweep or [1.0])
    policies = args.policies or ("kvcache_centric" if args.quick else ",".join(ALL_POLICIES))
    args.policies = [x.strip() for x in policies.split(",") if x.strip()]
    if bad := [x for x in args.policies if x not in (*ALL_POLICIES, "round_robin")]:
        p.error(f"unknown policies {bad}; choose from {', '.join(ALL_POLICIES)}, round_robin")
    default_systems = "coupled,disaggregated" + (",vllm" if args.vllm else "")
    args.systems = [x.strip() for x in (args.systems or default_systems).split(",") if x.strip()]
    if bad := [x for x in args.systems if x not in SYSTEM_KINDS]:
        p.error(f"unknown systems {bad}; choose from {', '.join(SYSTEM_KINDS)}")
    if not args.systems:
        p.error("--systems names nothing to run")
    if cuda and (vllm := [x for x in args.systems if "vllm" in x]):
        p.error(f"--device {args.device}: {', '.join(vllm)} run vllm-cpu, on the CPU; leave them out")
    if min(args.prefill, args.decode, args.coupled_threads, args.worker_threads or 1, args.limit) < 1:
        p.error("--prefill, --decode, --coupled-threads, --worker-threads and --limit must be >= 1")
    return args


def fit_context(args, model_dir: Path, console: Console) -> None:
    """``args.max_input`` within the model's context, and ``args.max_model_len`` the prompt and output rounded up to
    512."""
    config = json.loads((model_dir / "config.json").read_text())
    max_pos = int(config.get("max_position_embeddings") or 8192)
    if args.max_input + args.max_output > max_pos:
        args.max_input = max_pos - args.max_output
        console.print(f"--max-input lowered to {args.max_input}: the model's context is {max_pos} tokens")
    args.max_model_len = min(max_pos, -(-(args.max_input + args.max_output) // 512) * 512)


def run(args: argparse.Namespace, console: Console) -> dict:
    started = time.perf_counter()
    with scratch_dir("replay-compare-", args.keep_logs, console, "logs") as workdir:
        model_dir, model = resolve_model(args, workdir)
        fit_context(args, model_dir, console)
        vocab = tr.vocab_size_of(model_dir)
        requests, scaling = tr.trace_from_args(args, vocab, args.limit)
        console.print(
            f"model {model} ({model_dir}); {len(requests)} requests, {sum(q.prompt_tokens for q in requests):,} prompt "
            f"tokens; {scaling.describe(args.speed)}"
        )
        todo = systems(args, model_dir, workdir)
        with make_progress(console, args.no_progress) as progress:
            for record, server in todo:
                if server is not None:
                    measure(record, server, requests, args, vocab, progress, console)
        runs = [record for record, _ in todo]
        rows, goals = rows_and_goals(runs, len(args.factors) > 1)
        render(rows, goals, args, scaling, model, console)
        for r in runs:
            if r.skipped or r.error:
                console.print(f"{r.name} {'skipped' if r.skipped else '[red]failed[/]'}: {r.skipped or r.error}")
        report = {
            "command": shlex.join([sys.executable, *sys.argv]),
            "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "machine": describe_machine(httpx=httpx.__version__),
            "model": model,
            "model_dir": str(model_dir),
            "scaling": asdict(scaling)
            | {
                "speed": args.speed,
                "length_factor": scaling.length_factor,
                "description": scaling.describe(args.speed),
            },
            "rate_factors": args.factors,
            "slo": {"ttft_s": args.ttft_slo, "tbt_s": args.tbt_slo, "effective_target": args.effective_target},
            "cluster": {
                "prefill": args.prefill,
                "decode": args.decode,
                "device": args.device,
                "dtype": args.dtype,
                "admission": args.admission,
                "threads_per_worker": worker_threads(args),
            },
            "coupled_threads": args.coupled_threads,
            "max_model_len": args.max_model_len,
            "table": rows,
            "goals": goals,
            "systems": [asdict(r) for r in runs],
            "total_wall_s": time.perf_counter() - started,
        }
        if args.plot:
            measured = [r for r in runs if r.runs]
            rp.plot(
                args.plot,
                {r.name: reference_run(r) for r in measured},
                {r.name: r.runs for r in measured},
                args.ttft_slo,
                args.tbt_slo,
                args.effective_target,
                f"trace replay: {model}\n{scaling.describe(args.speed)}",
            )
            console.print(f"plot written to {args.plot}")
        console.print(
            f"total wall {report['total_wall_s']:.0f} s; load average {report['machine']['load_average'][0]:.2f}"
        )
        return report


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    console = Console(width=None if sys.stdout.isatty() else 170, log_path=False)
    report = run_interruptible(lambda: run(args, console), console)
    if report is None:
        return 130
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
        console.print(f"per-request numbers written to {args.json}")
    return 0 if not any(r["error"] for r in report["table"]) else 1


if __name__ == "__main__":
    sys.exit(main())
