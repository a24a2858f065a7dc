"""A hand-off's KV pushed by each tensor-parallel rank, its heads only: bytes and time per rank at TP 1 and 2, in the
pool's block layout and in a head-major one, through the transfer engine.

    python -m benchmarks.tp_handoff_bench                        # tcp and shm, TP 1 and 2, both layouts
    python -m benchmarks.tp_handoff_bench --backend tcp --tp 1,2,4 --blocks 64 --json out.json

A prompt of ``--blocks`` blocks (``--block-size`` tokens, ``--layers`` x ``--kv-heads`` x ``--head-dim`` in 2-byte
KV) lands in a decode host's segment (a process of its own serving one shared-memory segment, as a decode worker's
landing slots). Each of TP rank processes holds its heads of every block, as its cache does ([layer][K, V][block]
[token][its heads][head dim]), and pushes them layer by layer (one batch a layer, as the prefill connector does) into
the destination's layout, all ranks at once:

    pool      [layer][K, V][token][head][head dim]   the pool's layout today (DESIGN §4): a rank's heads of one
                                                    layer of a block are 2 x block_size runs of heads/TP x head_dim
    headmajor [layer][head][K, V][token][head dim]   a rank's heads of one layer of a block are one run: its cache's
                                                    [K, V][token][heads] is reordered into a staging buffer first
                                                    (timed with the push)

At TP 1 both are one run a layer. For each (backend, TP, layout) it prints each rank's bytes and median seconds a
hand-off, the hand-off's median (first rank's start to last rank's end), and that against TP 1's in the same run.
The destination is read back after the timed pushes and must hold every block's KV in its layout (a wrong byte
fails the run). What it does not measure: the ranks' own compute, a real decode worker's import, rdma.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from benchmarks.benchutil import describe_machine, human
from transfer import BackendKind, Segment, Slice, TransferConfig, TransferEngine

LAYOUTS = ("pool", "headmajor")
WAIT_S = 120.0
ITEM = 2  # bytes of a KV element (bf16, fp16)


def rank_heads(rank: int, tp: int, heads: int) -> slice:
    """Rank ``rank``'s KV heads (tensor parallelism's split; each head once where there are at least tp heads)."""
    per = heads // tp
    return slice(rank * per, (rank + 1) * per)


def full_kv(args: argparse.Namespace) -> np.ndarray:
    """Every block's KV as the ranks' caches hold it, all heads: [layers, 2, blocks, block_size, heads, head_dim]."""
    shape = (args.layers, 2, args.blocks, args.block_size, args.kv_heads, args.head_dim)
    return np.random.default_rng(7).integers(0, 1 << 16, shape, dtype=np.uint16)


def destination(full: np.ndarray, layout: str) -> np.ndarray:
    """The destination's bytes once every block landed: [blocks, layers, ...] in ``layout``."""
    blocks = full.transpose(2, 0, 1, 3, 4, 5)  # [blocks, layers, 2, bs, heads, D]
    return np.ascontiguousarray(blocks if layout == "pool" else blocks.transpose(0, 1, 4, 2, 3, 5))


def plan(args: argparse.Namespace, tp: int, rank: int, layout: str) -> list[list[Slice]]:
    """Each layer's slices for ``rank``: (offset in its staging of that layer, destination offset, bytes)."""
    L, n, bs, H, D = args.layers, args.blocks, args.block_size, args.kv_heads, args.head_dim
    h = rank_heads(rank, tp, H)
    per = h.stop - h.start
    block_bytes, layer_bytes = L * 2 * bs * H * D * ITEM, 2 * bs * H * D * ITEM
    layers = []
    for layer in range(L):
        slices, local = [], 0
        for b in range(n):
            base = b * block_bytes + layer * layer_bytes
            if layout == "pool":  # [2][bs][H][D]: a run per (K or V, token)
                for kv in range(2):
                    for t in range(bs):
                        run = per * D * ITEM
                        off = base + ((kv * bs + t) * H + h.start) * D * ITEM
                        slices.append(Slice(local, args.segment.name, off, run))
                        local += run
            else:  # [H][2][bs][D]: one run
                run = per * 2 * bs * D * ITEM
                slices.append(Slice(local, args.segment.name, base + h.start * 2 * bs * D * ITEM, run))
                local += run
        layers.append(merged(slices))
    return layers


def merged(slices: list[Slice]) -> list[Slice]:
    """Runs contiguous on both sides as one slice (at TP 1 a layer of a block is one run in either layout)."""
    out: list[Slice] = []
    for s in slices:
        last = out[-1] if out else None
        if (
            last
            and last.local_offset + last.length == s.local_offset
            and last.remote_offset + last.length == s.remote_offset
        ):
            out[-1] = Slice(last.local_offset, last.segment, last.remote_offset, last.length + s.length)
        else:
            out.append(s)
    return out


def staged(own: np.ndarray, layer: int, layout: str) -> np.ndarray:
    """One layer of a rank's cache ([2, blocks, bs, its heads, D]) as its slices read it, contiguous."""
    kv = own[layer].transpose(1, 0, 2, 3, 4)  # [blocks, 2, bs, heads, D]
    return np.ascontiguousarray(kv if layout == "pool" else kv.transpose(0, 3, 1, 2, 4))


def rank_main(rank: int, tp: int, layout: str, args: argparse.Namespace, barrier, results) -> None:
    engine = TransferEngine(TransferConfig(node=f"rank-{tp}-{rank}", serve=False, backend=BackendKind(args.backend)))
    engine.add_segment(args.segment)
    own = np.ascontiguousarray(full_kv(args)[..., rank_heads(rank, tp, args.kv_heads), :])
    layers = plan(args, tp, rank, layout)
    spans, moved = [], sum(s.length for slices in layers for s in slices)
    for i in range(args.warmup + args.repeat):
        barrier.wait()
        start = time.monotonic()
        batches, keep = [], []
        for layer, slices in enumerate(layers):  # one batch a layer, in flight together (as the connector's)
            local = staged(own, layer, layout)
            keep.append(local)
            batches.append(engine.write(local.view(np.uint8).reshape(-1), slices))
        for batch in batches:
            batch.wait(WAIT_S)
        end = time.monotonic()
        if i >= args.warmup:
            spans.append((start, end))
    results.put((rank, moved, spans, sum(len(s) for s in layers)))
    engine.close()


def owner_main(conn, nbytes: int, shm_dir: str, backend: str) -> None:
    engine = TransferEngine(TransferConfig(node="decode-host", shm_dir=shm_dir, backend=BackendKind(backend)))
    seg = engine.allocate("landing", nbytes)
    conn.send(seg.to_dict())
    conn.recv()  # read it back: the parent asks once the pushes are done
    conn.send(bytes(engine.buffer(seg.name)[:nbytes]))
    conn.recv()
    engine.close()


def run_one(args: argparse.Namespace, tp: int, layout: str) -> dict:
    ctx = mp.get_context("spawn")
    full = full_kv(args)
    expected = destination(full, layout)
    shm_dir = tempfile.mkdtemp(prefix="tp-handoff-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    conn, child = ctx.Pipe()
    owner = ctx.Process(target=owner_main, args=(child, expected.nbytes, shm_dir, args.backend), daemon=True)
    owner.start()
    try:
        args.segment = Segment.from_dict(conn.recv())
        barrier, results = ctx.Barrier(tp), ctx.Queue()
        ranks = [ctx.Process(target=rank_main, args=(r, tp, layout, args, barrier, results)) for r in range(tp)]
        for p in ranks:
            p.start()
        got = sorted(results.get(timeout=WAIT_S * (args.repeat + args.warmup)) for _ in ranks)
        for p in ranks:
            p.join(30)
        conn.send("read")
        landed = np.frombuffer(conn.recv(), dtype=np.uint16).reshape(expected.shape)
        if not np.array_equal(landed, expected):
            raise RuntimeError(f"{args.backend} TP {tp} {layout}: the destination does not hold the prompt's KV")
        conn.send("stop")
    finally:
        owner.join(10)
        if owner.is_alive():
            owner.kill()
        shutil.rmtree(shm_dir, ignore_errors=True)
    handoffs = [max(s[i][1] for _, _, s, _ in got) - min(s[i][0] for _, _, s, _ in got) for i in range(args.repeat)]
    return {
        "backend": args.backend,
        "tp": tp,
        "layout": layout,
        "bytes_total": int(expected.nbytes),
        "ranks": [
            {"rank": r, "bytes": b, "slices": n, "median_s": statistics.median(e - s for s, e in spans)}
            for r, b, spans, n in got
        ],
        "handoff_median_s": statistics.median(handoffs),
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--backend", choices=["tcp", "shm", "both"], default="both", help="the transport [both]")
    p.add_argument("--tp", default="1,2", help="tensor-parallel sizes, comma-separated [1,2]")
    p.add_argument("--blocks", type=int, default=32, help="blocks in the prompt [32]")
    p.add_argument("--block-size", type=int, default=16, help="tokens a block [16]")
    p.add_argument("--layers", type=int, default=16, help="layers [16]")
    p.add_argument("--kv-heads", type=int, default=8, help="KV heads [8]")
    p.add_argument("--head-dim", type=int, default=128, help="head dim [128]")
    p.add_argument("--repeat", type=int, default=5, help="timed hand-offs of each (the median counts) [5]")
    p.add_argument("--warmup", type=int, default=1, help="untimed hand-offs first [1]")
    p.add_argument("--json", type=Path, help="write the results here")
    args = p.parse_args(argv)
    args.sizes = [int(x) for x in args.tp.split(",")]
    if any(args.kv_heads % n for n in args.sizes):
        p.error(f"--kv-heads {args.kv_heads} must be divisible by every --tp size ({args.tp})")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    console = Console()
    backends = ["tcp", "shm"] if args.backend == "both" else [args.backend]
    rows = []
    for backend in backends:
        args.backend = backend
        for layout in LAYOUTS:
            for tp in args.sizes:
                console.print(f"[dim]{backend} TP {tp} {layout} ...[/]")
                rows.append(run_one(args, tp, layout))
    table = Table(title=f"a hand-off of {args.blocks} blocks ({human(rows[0]['bytes_total'])}), per rank")
    for col in ("backend", "layout", "TP", "bytes a rank", "slices a rank", "slowest rank s", "hand-off s", "vs TP 1"):
        table.add_column(col, justify="right")
    for row in rows:
        key = (row["backend"], row["layout"], 1)
        base = next((r for r in rows if (r["backend"], r["layout"], r["tp"]) == key), None)
        table.add_row(
            row["backend"],
            row["layout"],
            str(row["tp"]),
            human(max(r["bytes"] for r in row["ranks"])),
            str(max(r["slices"] for r in row["ranks"])),
            f"{max(r['median_s'] for r in row['ranks']):.4f}",
            f"{row['handoff_median_s']:.4f}",
            f"{row['handoff_median_s'] / base['handoff_median_s']:.2f}x" if base else "-",
        )
    console.print(table)
    if args.json:
        report = {"command": " ".join(["python -m benchmarks.tp_handoff_bench", *sys.argv[1:]]), "rows": rows}
        report["machine"] = describe_machine()
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
