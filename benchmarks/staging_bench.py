"""Where a prefill's layer-wise pushes cost time: one engine (CUDA or CPU), the prefill connector bound to its cache,
a cold prompt run four ways in the same process, alternating:

    plain    no job: nothing pushed (the baseline)
    stage    every layer's blocks gathered and copied to pinned host memory (CUDA) and handed to the staging
             thread, which drops them: the device side of the path alone
    landing  ... and written to landing slots (a segment of another transfer engine in this process, shm)
    full     ... and to pool slots too (a shared-memory pool tensor), as a prefill worked before its pool write
             followed the answer
    cache    into a decode cache's blocks in place (its layout, through the segment: shm here, tcp/rdma across hosts),
             the pool written after the request ends (timed to its end; the write itself is waited for untimed)
    device   into a decode cache on the same device by device copies (what CUDA IPC maps on one host; on the CPU a
             plain copy), the pool written after the request ends as in ``cache``

    python -m benchmarks.staging_bench --model DIR --device cuda --dtype bfloat16 --tokens 4096

Prints each mode's median prefill time and its ratio to plain. The e2e_bench overlap measures the same through a
prefill worker; this one takes the worker, the pool node and gRPC away, to tell the parts apart.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
import uuid
from pathlib import Path

import torch

from mooncake.blocks import blocks_for
from mooncake.engine import EngineConfig, LLMEngine
from mooncake.engine.config import DTYPE_NAMES
from mooncake.engine.request import SamplingParams
from mooncake.serving.kvlayout import slot_tensor
from prefill.connector import PoolConnector, PrefillJob
from transfer import TransferConfig, TransferEngine

MODES = ("plain", "stage", "landing", "full", "cache", "device")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="a model directory")
    ap.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    ap.add_argument("--dtype", default="float32", choices=DTYPE_NAMES)
    ap.add_argument("--tokens", type=int, default=4096, help="the prompt's tokens")
    ap.add_argument("--chunk", type=int, default=512, help="tokens per engine step")
    ap.add_argument("--reps", type=int, default=3, help="timed runs of each mode (after one warm-up each)")
    ap.add_argument("--json", type=Path, help="write the results here")
    args = ap.parse_args(argv)

    bs = 16
    n = blocks_for(args.tokens, bs)
    owner = TransferEngine(TransferConfig(node=f"bench-land-{uuid.uuid4().hex[:6]}", serve=False))
    sender = TransferEngine(TransferConfig(node=f"bench-push-{uuid.uuid4().hex[:6]}", serve=False))
    connector = PoolConnector(sender, None, bs, io_timeout_s=60)
    engine = LLMEngine(
        EngineConfig(
            model=args.model,
            block_size=bs,
            num_kv_blocks=2 * n + 16,
            max_model_len=args.tokens + bs,
            max_num_batched_tokens=args.chunk,
            device=args.device,
            dtype=args.dtype,
            enable_prefix_caching=False,
        ),
        connector=connector,
    )
    connector.bind(engine.runner.kv_cache, staged=True)  # a CUDA cache always is; on the CPU the same path
    landing = owner.allocate("landing", n * engine.block_bytes)
    sender.add_segment(landing)
    decode_cache = owner.allocate("kvcache", n * engine.block_bytes)  # a decode engine's cache of n blocks
    sender.add_segment(decode_cache)
    device_cache = torch.zeros(
        (engine.block_shape[0], 2, n, *engine.block_shape[2:]), dtype=engine.runner.kv_cache.dtype, device=args.device
    )
    owner.allocate("pool", n * engine.block_bytes)
    connector.pool = slot_tensor(owner.buffer("pool"), engine.block_shape, engine.runner.kv_cache.dtype)
    push_staged = connector._push_staged
    rng = random.Random(0)
    vocab = engine.args.vocab_size
    counter = iter(range(1 << 30))

    def run(mode: str) -> float:
        rid = f"{mode}-{next(counter)}"
        prompt = [rng.randrange(10, vocab - 10) for _ in range(args.tokens)]
        if mode != "plain":
            pool = {b: b for b in range(args.tokens // bs)} if mode in ("full", "cache", "device") else {}
            into = decode_cache.name if mode == "cache" else landing.name
            job = connector.jobs[rid] = PrefillJob(
                rid, len(prompt), n, into, [i * engine.block_bytes for i in range(n)], pool_slots=pool
            )
            if mode in ("cache", "device"):
                job.landing_blocks, job.landing_num_blocks, job.store_later = list(range(n)), n, True
                job.mapped_cache = device_cache if mode == "device" else None
        connector._push_staged = (lambda *a: None) if mode == "stage" else push_staged
        _sync(args.device)
        t0 = time.perf_counter()
        engine.add_request(prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True), request_id=rid)
        while engine.has_unfinished():
            engine.step()
        _sync(args.device)
        wall = time.perf_counter() - t0
        connector.flush(60)  # the pool write after the answer, untimed
        engine.step()  # gives the blocks the writer kept back to the engine
        job = connector.jobs.pop(rid, None)
        if job is not None and (job.error is not None or job.pushed != n):
            raise RuntimeError(f"{mode}: the job ended with {job.pushed} of {n} blocks pushed ({job.error!r})")
        return wall

    times: dict[str, list[float]] = {m: [] for m in MODES}
    for m in MODES:
        run(m)  # warm-up: first touches, allocator caches
    for rep in range(args.reps):
        for m in MODES if rep % 2 == 0 else reversed(MODES):
            times[m].append(run(m))
    base = statistics.median(times["plain"])
    gpu = torch.cuda.get_device_name(0) if args.device.startswith("cuda") else "cpu"
    print(
        f"{args.tokens} tokens in steps of {args.chunk}, {args.dtype} on {args.device} ({gpu}); "
        f"{engine.block_bytes * n / 2**20:,.0f} MiB of KV; median of {args.reps}"
    )
    rows = []
    for m in MODES:
        med = statistics.median(times[m])
        rows.append({"mode": m, "median_s": med, "ratio": med / base, "runs_s": times[m]})
        print(f"  {m:<8} {med * 1e3:9.1f} ms  {med / base:5.2f}x")
    if args.json:
        args.json.write_text(json.dumps({"command": sys.argv, "device": gpu, "rows": rows}, indent=2) + "\n")
    owner.close()
    sender.close()
    return 0


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


if __name__ == "__main__":
    sys.exit(main())
