"""Overload: how fast a refused request hears 429, and whether the accepted ones still meet the SLOs.

    python -m benchmarks.overload_bench [--url URL] [--model smollm2-135m | --quick] [--factor 10] [--open-s 30]
                                        [--burst 300] [--capacity-s 20] [--concurrency 4] [--json PATH]

Without ``--url`` it starts the cluster ``mooncake up`` starts (one prefill worker with its
pool node, one decode worker, the Conductor and the gateway; the same defaults) and stops
it at the end. Every request is what a new user sends: a chat completion of a few hundred
words of text (``--prompt-words``, different in every request so no cache helps),
streamed, ``--max-tokens`` tokens, so tokenization and key hashing are part of the path.

1. **Capacity**: ``--concurrency`` clients send requests back to back for
   ``--capacity-s``; capacity = requests finished (200) per second.
2. **Open loop**: Poisson arrivals at ``--factor`` x capacity for ``--open-s``, each sent
   whatever the others are doing; then the stragglers finish.
3. **Burst**: once the cluster is idle, ``--burst`` requests sent at once.

For each phase: offered requests and rate, accepted (200), rejected (429), errors; the
429 latency (request sent to response received) p50/p90/p99/max; the accepted requests'
TTFT and TBT (the paper's: mean of the longest 10% of a request's gaps) and the share
meeting the cluster's SLOs; the 429s by reason, those the gateway answered itself (shed
before any work, or a prompt as long as one the Conductor just refused) apart as
``reason (gateway)``. Goals printed: open-loop 429 p99 under 50 ms, burst 429 p99
under 1 s, every accepted request within the SLOs.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from rich.console import Console
from rich.table import Table

from benchmarks.benchutil import describe_machine, percentile, resolve_model, shielded
from benchmarks.replay import Outcome, RequestResult, tail_tbt

GOAL_OPEN_P99_S = 0.050
GOAL_BURST_P99_S = 1.0
RETRY_PAUSE_S = 0.2
GATEWAY_REFUSAL = "refused at the gateway"  # in a 429's message when the gateway refused it without the Conductor
WORDS = (
    "the quick brown fox jumps over a lazy dog while seven wizards quietly judge boxing matches in old "
    "towns near rivers and mountains where bright stars shine above calm lakes"
).split()


def chat_body(model: str, words: int, max_tokens: int, rng: random.Random) -> bytes:
    text = f"Request {rng.getrandbits(48):x}: " + " ".join(rng.choice(WORDS) for _ in range(words))
    return json.dumps(
        {
            "model": model,
            "messages": [{"role": "user", "content": text}],
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
            "ignore_eos": True,
        }
    ).encode()


async def send(url: str, body: bytes, r: RequestResult, clock0: float) -> None:
    """Stream one chat completion into ``r``; ``e2e_s`` is set for every outcome (for a 429: its latency).

    Plain HTTP/1.1 on an asyncio connection of its own, not an HTTP library: with hundreds
    of requests at once, httpx's own per-request work (milliseconds of this process's CPU)
    would be measured as the server's latency."""
    host, port, path = _split(url)
    t0 = time.perf_counter()
    r.sent_s = t0 - clock0
    times: list[float] = []
    writer = None
    try:
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(
            f"POST {path}/chat/completions HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
            + body
        )
        status = int((await reader.readline()).split()[1])
        headers = {}
        while (line := await reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode().partition(":")
            headers[name.strip().lower()] = value.strip()
        r.http_status = status
        if status != 200:
            r.e2e_s = time.perf_counter() - t0  # the answer is here: the body is a few hundred bytes
            text = (await _body(reader, headers)).decode(errors="replace")
            r.outcome = Outcome.REJECTED if status == 429 else Outcome.ERROR
            r.error = f"HTTP {status}: {text[:300]}"
            if status == 429:
                with contextlib.suppress(ValueError, KeyError, AttributeError, TypeError):
                    error = json.loads(text)["error"]
                    r.error = error["code"] or "429"  # the reason (ttft_slo, overload ...)
                    if GATEWAY_REFUSAL in error["message"]:  # the gateway answered for the Conductor
                        r.error += " (gateway)"
            return
        async for event in _events(reader):
            if event.get("error"):
                r.outcome, r.error = Outcome.ERROR, json.dumps(event["error"])[:300]
                return
            choices = event.get("choices") or []
            if choices and choices[0].get("delta", {}).get("content"):
                times.append(time.perf_counter() - t0)
        r.e2e_s = time.perf_counter() - t0
        if times:
            r.outcome, r.ttft_s, r.completion_tokens = Outcome.OK, times[0], len(times)
            r.tbt_s = tail_tbt([b - a for a, b in zip(times, times[1:])])
        else:
            r.outcome, r.error = Outcome.ERROR, "the stream ended without a token"
    except (OSError, ValueError, IndexError, asyncio.IncompleteReadError) as e:
        r.outcome, r.error = Outcome.ERROR, f"{type(e).__name__}: {e}"[:300]
        r.e2e_s = time.perf_counter() - t0
    finally:
        if writer is not None:
            writer.close()


def _split(url: str) -> tuple[str, int, str]:
    """``http://host:port/v1`` -> (host, port, "/v1")."""
    rest = url.split("://", 1)[-1]
    hostport, _, path = rest.partition("/")
    host, _, port = hostport.rpartition(":")
    return host, int(port), "/" + path.rstrip("/")


async def _body(reader: asyncio.StreamReader, headers: dict[str, str]) -> bytes:
    if "content-length" in headers:
        return await reader.readexactly(int(headers["content-length"]))
    return b"".join([chunk async for chunk in _chunks(reader)])


async def _chunks(reader: asyncio.StreamReader):
    """The chunks of a chunked transfer encoding, as they arrive."""
    while True:
        size = int((await reader.readline()).split(b";")[0], 16)
        if size == 0:
            return
        chunk = await reader.readexactly(size + 2)
        yield chunk[:-2]


async def _events(reader: asyncio.StreamReader):
    """The server-sent events of a chunked stream, decoded, until ``[DONE]``."""
    pending = b""
    async for chunk in _chunks(reader):
        pending += chunk
        *lines, pending = pending.split(b"\n")
        for line in lines:
            if line.startswith(b"data:"):
                data = line[5:].strip()
                if data == b"[DONE]":
                    return
                yield json.loads(data)


SHED_METRIC = "mooncake_gateway_rejection_seconds"  # the gateway's own: arrival to a 429's response


def gateway_shedding(url: str) -> dict[float, float]:
    """The gateway's histogram of its 429s' latency, as it measured them (from its ``/metrics``): cumulative count
    by upper bound (s). Empty where the server has no such histogram (not ours)."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        with urllib.request.urlopen(url.removesuffix("/v1") + "/metrics", timeout=10) as resp:
            text = resp.read().decode()
    except OSError:
        return {}
    return {
        float(sample.labels["le"]): sample.value
        for family in text_string_to_metric_families(text)
        if family.name == SHED_METRIC
        for sample in family.samples
        if sample.name == f"{SHED_METRIC}_bucket"
    }


def bucket_quantile(before: dict[float, float], after: dict[float, float], q: float) -> float | None:
    """The upper bound of the histogram bucket that holds quantile ``q`` (0..1) of what was observed between the two
    reads (None: nothing was)."""
    counts = sorted((le, after[le] - before.get(le, 0.0)) for le in after)
    total = counts[-1][1] if counts else 0.0
    if total <= 0:
        return None
    return next(le for le, n in counts if n >= q * total)


async def capacity(url: str, args, rng: random.Random) -> tuple[float, list[RequestResult]]:
    """Closed loop: ``--concurrency`` clients back to back for ``--capacity-s``; finished requests per second."""
    results: list[RequestResult] = []
    clock0 = time.perf_counter()
    deadline = clock0 + args.capacity_s

    async def client_loop():
        while time.perf_counter() < deadline:
            r = RequestResult(len(results), 0.0, 0.0, args.prompt_words, args.max_tokens)
            results.append(r)
            await send(url, chat_body(args.model_name, args.prompt_words, args.max_tokens, rng), r, clock0)
            if r.outcome is not Outcome.OK:
                await asyncio.sleep(RETRY_PAUSE_S)  # a refused client waits a little before its next request

    await asyncio.gather(*(client_loop() for _ in range(args.concurrency)))
    elapsed = time.perf_counter() - clock0
    done = [r for r in results if r.outcome is Outcome.OK]
    return len(done) / elapsed, results


async def open_loop(url: str, rate: float, seconds: float, args, rng: random.Random) -> list[RequestResult]:
    """Poisson arrivals at ``rate`` per second for ``seconds``; every request sent on time, whatever is in flight."""
    results, tasks = [], []
    clock0 = time.perf_counter()
    t = 0.0
    while True:
        t += rng.expovariate(rate)
        if t > seconds:
            break
        await asyncio.sleep(max(0.0, clock0 + t - time.perf_counter()))
        r = RequestResult(len(results), t, 0.0, args.prompt_words, args.max_tokens)
        results.append(r)
        tasks.append(
            asyncio.create_task(
                send(url, chat_body(args.model_name, args.prompt_words, args.max_tokens, rng), r, clock0)
            )
        )
    await asyncio.gather(*tasks)
    return results


async def burst(url: str, n: int, args, rng: random.Random) -> list[RequestResult]:
    bodies = [chat_body(args.model_name, args.prompt_words, args.max_tokens, rng) for _ in range(n)]
    results = [RequestResult(i, 0.0, 0.0, args.prompt_words, args.max_tokens) for i in range(n)]
    clock0 = time.perf_counter()
    await asyncio.gather(*(send(url, b, r, clock0) for b, r in zip(bodies, results)))
    return results


def summarize(results: list[RequestResult], span_s: float, ttft_slo_s: float, tbt_slo_s: float) -> dict:
    ok = [r for r in results if r.outcome is Outcome.OK]
    refused = [r.e2e_s for r in results if r.outcome is Outcome.REJECTED]
    errors = [r.error for r in results if r.outcome is Outcome.ERROR]
    by_reason: dict[str, list[float]] = {}
    for r in results:
        if r.outcome is Outcome.REJECTED:
            by_reason.setdefault(str(r.error), []).append(r.e2e_s)
    reasons = {k: len(v) for k, v in by_reason.items()}
    reason_p99_s = {k: percentile(v, 99, "rank") for k, v in by_reason.items()}
    within = [r for r in ok if r.ttft_s <= ttft_slo_s and (r.tbt_s or 0.0) <= tbt_slo_s]
    out = {
        "offered": len(results),
        "offered_rate_rps": len(results) / span_s if span_s else None,
        "accepted": len(ok),
        "rejected": len(refused),
        "reasons": reasons,
        "reject_p99_s_by_reason": reason_p99_s,
        "errors": len(errors),
        "first_errors": errors[:3],
        "accepted_within_slo": len(within),
        "accepted_within_slo_share": len(within) / len(ok) if ok else None,
    }
    for q in (50, 90, 99, 100):
        out[f"reject_p{q}_s"] = percentile(refused, q, "rank")
        out[f"ttft_p{q}_s"] = percentile([r.ttft_s for r in ok], q, "rank")
        out[f"tbt_p{q}_s"] = percentile([r.tbt_s or 0.0 for r in ok], q, "rank")
    return out


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1e3:,.1f}"


def render(phases: dict[str, dict], capacity_rps: float, args, console: Console) -> list[dict]:
    table = Table(
        title=f"Overload: capacity {capacity_rps:.2f} requests/s ({args.prompt_words}-word chats, "
        f"{args.max_tokens} tokens out)"
    )
    for col in (
        "phase",
        "offered",
        "rate/s",
        "200",
        "429",
        "err",
        "429 p50 ms",
        "429 p90 ms",
        "429 p99 ms",
        "429 max ms",
        "TTFT p50 ms",
        "TTFT p99 ms",
        "TBT p99 ms",
        "within SLO",
    ):
        table.add_column(col, justify="left" if col == "phase" else "right")
    for name, s in phases.items():
        share = s["accepted_within_slo_share"]
        table.add_row(
            name,
            str(s["offered"]),
            f"{s['offered_rate_rps']:.1f}" if s["offered_rate_rps"] else "-",
            str(s["accepted"]),
            str(s["rejected"]),
            str(s["errors"]),
            _ms(s["reject_p50_s"]),
            _ms(s["reject_p90_s"]),
            _ms(s["reject_p99_s"]),
            _ms(s["reject_p100_s"]),
            _ms(s["ttft_p50_s"]),
            _ms(s["ttft_p99_s"]),
            _ms(s["tbt_p99_s"]),
            "-" if share is None else f"{share:.0%}",
        )
    console.print(table)
    for name, s in phases.items():
        if s.get("gateway_reject_p99_le_s") is not None:
            console.print(
                f"{name}: the gateway's own 429 latency (arrival to response, its histogram): p99 <= "
                f"{_ms(s['gateway_reject_p99_le_s'])} ms; the rest of the client's figure is the client and the "
                "network (and, here, the client waiting for the cores it shares)"
            )
        if s["reasons"]:
            console.print(
                f"{name}: 429s by reason (count, p99 ms): "
                + ", ".join(f"{k} {v} ({_ms(s['reject_p99_s_by_reason'][k])})" for k, v in sorted(s["reasons"].items()))
            )
    goals = []
    for phase, limit in (("open loop", GOAL_OPEN_P99_S), ("burst", GOAL_BURST_P99_S)):
        s = phases.get(phase)
        if s is None:
            continue
        p99 = s["reject_p99_s"]
        goals.append(
            {
                "goal": f"{phase}: 429 p99 under {limit * 1e3:.0f} ms",
                "value_s": p99,
                "pass": p99 is not None and p99 < limit,
            }
        )
        share = s["accepted_within_slo_share"]
        goals.append(
            {"goal": f"{phase}: every accepted request within the SLOs", "value": share, "pass": share in (None, 1.0)}
        )
    for g in goals:
        value = _ms(g["value_s"]) + " ms" if "value_s" in g else ("-" if g["value"] is None else f"{g['value']:.0%}")
        console.print(f"{'PASS' if g['pass'] else 'MISS'}  {g['goal']}: {value}")
    return goals


@contextlib.contextmanager
def local_cluster(args, console: Console):
    """The cluster ``mooncake up`` starts, on free ports; yields (its OpenAI base URL, its TTFT and TBT SLOs)."""
    from mooncake.cluster.config import ClusterConfig
    from mooncake.cluster.launcher import LocalCluster

    workdir = Path(tempfile.mkdtemp(prefix="overload-bench-"))
    model_dir, args.model_label = resolve_model(args, workdir)
    config = ClusterConfig(
        model=str(model_dir),
        model_name=args.model_name,
        port=0,
        restart=False,
        workdir=workdir,
        local_prefill=args.local_prefill or ClusterConfig.model_fields["local_prefill"].default,
    )
    cluster = LocalCluster(config, lambda msg: console.log(msg))
    try:
        cluster.start()
        yield cluster.endpoint, config.ttft_slo_s, config.tbt_slo_s
    finally:
        with shielded():
            cluster.stop()


async def run_phases(url: str, ttft_slo_s: float, tbt_slo_s: float, args, console: Console) -> dict:
    rng = random.Random(args.seed)
    await burst(url, 2, args, rng)  # warm-up, not counted
    phases = {}
    if args.rate:
        cap, rate = args.rate / args.factor, args.rate
    else:
        console.log(f"capacity: {args.concurrency} clients back to back for {args.capacity_s:.0f} s")
        cap, cap_results = await capacity(url, args, rng)
        if cap <= 0:
            raise RuntimeError(f"no request finished while measuring capacity: {[r.error for r in cap_results][:3]}")
        phases["capacity"] = summarize(cap_results, args.capacity_s, ttft_slo_s, tbt_slo_s)
        rate = args.factor * cap
    console.log(f"open loop: {rate:.1f} requests/s ({args.factor:g} x {cap:.2f}) for {args.open_s:.0f} s")
    before = await asyncio.to_thread(gateway_shedding, url)
    phases["open loop"] = summarize(
        await open_loop(url, rate, args.open_s, args, rng), args.open_s, ttft_slo_s, tbt_slo_s
    )
    phases["open loop"]["gateway_reject_p99_le_s"] = bucket_quantile(
        before, await asyncio.to_thread(gateway_shedding, url), 0.99
    )
    if args.burst:
        await asyncio.sleep(args.settle_s)
        console.log(f"burst: {args.burst} requests at once")
        before = await asyncio.to_thread(gateway_shedding, url)
        phases["burst"] = summarize(await burst(url, args.burst, args, rng), 0.0, ttft_slo_s, tbt_slo_s)
        phases["burst"]["gateway_reject_p99_le_s"] = bucket_quantile(
            before, await asyncio.to_thread(gateway_shedding, url), 0.99
        )
    return {"capacity_rps": cap, "offered_rate_rps": rate, "phases": phases}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", help="an OpenAI base URL (…/v1) to measure instead of starting the cluster")
    p.add_argument("--model", help="model directory or registry name for the started cluster (default smollm2-135m)")
    p.add_argument("--model-name", default="mooncake", help="the name requests send as `model`")
    p.add_argument("--quick", action="store_true", help="a tiny random-weight llama instead of real weights")
    p.add_argument("--ttft-slo", type=float, help="with --url: the cluster's TTFT SLO, seconds (default 30)")
    p.add_argument("--tbt-slo", type=float, help="with --url: the cluster's TBT SLO, seconds (default 0.5)")
    p.add_argument("--prompt-words", type=int, default=200)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=4, help="clients while measuring capacity")
    p.add_argument("--capacity-s", type=float, default=20.0)
    p.add_argument("--factor", type=float, default=10.0, help="open-loop rate, as a multiple of the capacity")
    p.add_argument("--rate", type=float, help="open-loop requests/s, given: capacity is not measured")
    p.add_argument("--open-s", type=float, default=30.0)
    p.add_argument("--burst", type=int, default=300, help="requests sent at once (0: no burst)")
    p.add_argument("--settle-s", type=float, default=5.0, help="pause before the burst")
    p.add_argument(
        "--local-prefill",
        choices=("never", "auto", "always"),
        help="where the started cluster computes prompts (default: mooncake up's, auto)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, help="write every number to this file")
    args = p.parse_args(argv)
    console = Console(width=None if sys.stdout.isatty() else 160, log_path=False)
    if args.url:
        url = args.url.rstrip("/")
        url = url if url.endswith("/v1") else f"{url}/v1"
        cm = contextlib.nullcontext((url, args.ttft_slo or 30.0, args.tbt_slo or 0.5))
    else:
        cm = local_cluster(args, console)
    with cm as (url, ttft_slo_s, tbt_slo_s):
        result = asyncio.run(run_phases(url, ttft_slo_s, tbt_slo_s, args, console))
    goals = render(result["phases"], result["capacity_rps"], args, console)
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "command": " ".join(sys.argv),
                    "args": {k: str(v) for k, v in vars(args).items()},
                    "machine": describe_machine(),
                    **result,
                    "goals": goals,
                },
                indent=2,
                default=str,
            )
            + "\n"
        )
        console.print(f"raw numbers written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
