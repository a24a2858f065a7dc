"""Replaying streamed requests against a real cluster while components die or drop off the network (issue 17).

Shared by tests/test_chaos.py (kills) and tests/test_partition.py (cut links).
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time
from collections.abc import Callable

import httpx
from clusters import backend

from kvstore.client import KVStoreClient
from mooncake.serving.types import BackendError, GenerationRequest, Recovery

NUM_REQUESTS = 60
CONCURRENCY = 6
MARGIN_TOKENS = 40  # a decode worker is struck while two of its streams have at least this many tokens to go
SHARED_PREFIXES = 4  # requests share system-prompt-like prefixes, so the pool and its pulls are exercised


def requests(count: int = NUM_REQUESTS) -> list[GenerationRequest]:
    rng = random.Random(17)
    prefixes = [[rng.randrange(10, 290) for _ in range(48)] for _ in range(SHARED_PREFIXES)]
    out = []
    for i in range(count):
        prompt = prefixes[i % SHARED_PREFIXES] + [rng.randrange(10, 290) for _ in range(rng.randrange(8, 60))]
        out.append(
            GenerationRequest.of(
                f"chaos-{i}", prompt, max_tokens=rng.randrange(120, 200), temperature=0.0, ignore_eos=True
            )
        )
    return out


def undisturbed_run(
    cluster, settle_s: float = 10.0, count: int = NUM_REQUESTS
) -> tuple[dict[str, list[int]], dict[str, int]]:
    """The replay with nothing struck: (its outputs, the idle counts), asserting nothing failed or was recovered and
    everything came back to idle."""
    idle = idle_counts(cluster)
    outputs, errors, recoveries = replay(cluster, count=count)
    assert not errors and not recoveries and len(outputs) == count, (
        dict(list(errors.items())[:5]),
        recoveries[:5],
    )
    assert wait_idle(cluster, idle, settle_s) == idle
    return outputs, idle


def kill(cluster, victim: str) -> None:
    os.kill(cluster.component(victim).proc.pid, signal.SIGKILL)


def replay(
    cluster,
    victim: str | None = None,
    strike: Callable = kill,
    struck: list[float] | None = None,
    count: int = NUM_REQUESTS,
) -> tuple[dict[str, list[int]], dict[str, str], list[Recovery]]:
    """Run every request; ``strike(cluster, victim)`` once a third of them are streaming (and, for a decode worker,
    once two of its streams have tokens at their client); its time.monotonic() goes into ``struck``. (tokens,
    errors, what outliving took)."""
    be = backend(cluster)
    outputs: dict[str, list[int]] = {}
    errors: dict[str, str] = {}
    recoveries: list[Recovery] = []
    streaming = 0
    received: dict[str, list[int]] = {}  # each request's tokens at its client so far

    async def one(req: GenerationRequest, gate: asyncio.Semaphore) -> None:
        nonlocal streaming
        async with gate:
            got = received.setdefault(req.request_id, [])
            try:
                async for chunk in be.generate(req):
                    if not got:
                        streaming += 1
                    got.extend(chunk.token_ids)
                    if chunk.recovery is not None:
                        recoveries.append(chunk.recovery)
                outputs[req.request_id] = got
            except BackendError as e:
                errors[req.request_id] = f"{type(e).__name__}: {e.message}"

    wanted = {r.request_id: r.sampling.max_tokens for r in requests(count)}

    def mid_stream(rid: str, generated: int, before: dict[str, int]) -> bool:
        """Its client has tokens, and its decode worker has ``generated``, more than at its previous look (``before``:
        the stream is live there, not an ended one still listed), with many more to come. (Struck near its end, or
        after it, nothing would be resumed. The client's own count lags behind the worker's on a loaded machine: a
        worker that has sent every token while the client still reads them is not mid-stream.)"""
        live = before.get(rid, generated) < generated
        return live and len(received.get(rid, ())) > 0 and generated < wanted.get(rid, 0) - MARGIN_TOKENS

    async def kill_when_busy() -> None:
        while streaming < count // 3:
            await asyncio.sleep(0.02)
        if victim.startswith("decode"):
            # mid-stream: when two of its streams have tokens at their client and many to come. Its own count of
            # streams is not enough: a stream counts there once its first output is sent, which the gateway may not
            # have read yet, and a request whose client has no token yet is placed again from the start, not resumed
            health = f"http://{cluster.component(victim).info['metrics']}/health"
            async with httpx.AsyncClient(timeout=5) as http:
                before: dict[str, int] = {}
                while len(outputs) + len(errors) < count:
                    streams = (await http.get(health)).json()["streams"]
                    if sum(mid_stream(rid, generated, before) for rid, generated in streams.items()) >= 2:
                        break
                    before = streams
                    await asyncio.sleep(0.01)
        if struck is not None:
            struck.append(time.monotonic())
        await asyncio.to_thread(strike, cluster, victim)

    async def run() -> None:
        gate = asyncio.Semaphore(CONCURRENCY)
        tasks = [one(r, gate) for r in requests(count)]
        if victim is not None:
            tasks.append(kill_when_busy())
        await asyncio.gather(*tasks)
        await be.close()

    asyncio.run(run())
    return outputs, errors, recoveries


def idle_counts(cluster) -> dict[str, int]:
    """What must come back after any run: leases and reservations on each pool node, free landing slots and no reserved
    cache blocks per decode worker."""
    counts = {}
    for i in range(cluster.config.prefill):
        client = KVStoreClient(cluster.address(f"kv{i}"), control="grpc", timeout_s=5)
        try:
            stats = client.stats()
            counts[f"kv{i} leases"], counts[f"kv{i} reservations"] = stats.leases, stats.reservations
        finally:
            client.close()
    for i in range(cluster.config.decode):
        status = cluster.component(f"decode-{i}").info["metrics"]
        lines = httpx.get(f"http://{status}/metrics", timeout=5).text.splitlines()
        for name, metric in (
            ("free slots", "mooncake_decode_landing_free_slots"),
            ("running", "mooncake_decode_running_requests"),
            ("in prefill", "mooncake_decode_in_prefill"),
            ("reserved cache blocks", "mooncake_decode_reserved_cache_blocks"),
        ):
            counts[f"decode-{i} {name}"] = int(float(next(ln.split()[-1] for ln in lines if ln.startswith(metric))))
    for i in range(cluster.config.prefill):
        status = cluster.component(f"prefill-{i}").info["metrics"]
        lines = httpx.get(f"http://{status}/metrics", timeout=5).text.splitlines()
        counts[f"prefill-{i} inflight"] = int(
            float(next(ln.split()[-1] for ln in lines if ln.startswith("mooncake_prefill_inflight")))
        )
    return counts


def wait_idle(cluster, idle: dict[str, int], timeout_s: float) -> dict[str, int]:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            now = idle_counts(cluster)
        except Exception:  # a restarted component not yet up
            now = {}
        if now == idle or time.monotonic() > deadline:
            return now
        time.sleep(0.5)


def wait_restarted(cluster, name: str, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not (
        cluster.component(name).restarts >= 1 and cluster.component(name).alive and cluster.component(name).info
    ):
        assert time.monotonic() < deadline, f"{name} was not restarted"
        time.sleep(0.2)
