"""KV store benchmark: put and get through a kvstore node process, against Redis SET and GET.

    python -m benchmarks.kvstore_bench [--json PATH] [--seconds S] [--sizes 64KiB,1MiB,16MiB]

For each block size a node is started as its own process (``python -m kvstore``, a
``--dram-mib`` DRAM tier) and filled once, so its shared memory is touched before anything
is timed. A client in this process then puts and gets one block per call
(``--batch-blocks`` blocks per call in extra rows for blocks under 1 MiB), through shared
memory (the client's defaults: the node is on this host, so its Unix control socket and
its shared-memory segment) and through tcp (an engine forced to tcp, control calls on the
node's tcp control port: what a client on another host does). Puts use fresh keys, so a
full store evicts (LRU) as it goes; gets cycle over keys stored last.

Baseline in the same run: a redis-server this benchmark starts on a free loopback port
(no persistence), driven by redis-py: SET of a pre-built value, over a ring of keys as
large as the get working set (so Redis replaces values instead of growing), GET (which
returns bytes), and MSET and MGET for the batched rows. A size's Redis rows run next to its store rows, and every
measurement runs ``--rounds`` times with the best counting, so a noisy moment hits both.
See benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shlex
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import grpc
import numpy as np
import redis
from rich.console import Console
from rich.table import Table

from benchmarks.benchutil import describe_machine, human, make_progress, parse_size, timed_loop
from kvstore.client import KVStoreClient
from mooncake.localproc import RedisServer
from mooncake.runtime.process import parse_ready
from transfer import BackendKind, TransferConfig, TransferEngine

REPO = Path(__file__).resolve().parent.parent

MIB = 1 << 20
GOAL_GET_VS_REDIS = 3.0  # store get vs Redis GET, at GOAL_SIZE
GOAL_SIZE = MIB
MAX_WORKING_SET = 4096  # keys a get loop cycles over, at most


@dataclass
class Cell:
    """One measured loop: ``ops`` calls of ``blocks`` blocks of ``block_bytes`` in ``seconds``."""

    system: str  # store-shm, store-tcp, redis
    op: str  # put, get (Redis: SET/MSET, GET/MGET)
    block_bytes: int
    blocks: int  # blocks per call
    ops: int
    seconds: float
    p50_us: float
    round: int = 0

    @property
    def ops_per_s(self) -> float:
        return self.ops / self.seconds if self.seconds > 0 else 0.0

    @property
    def gbps(self) -> float:
        return self.ops * self.blocks * self.block_bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


# -- the processes: a kvstore node, redis-server ------------------------------------------


class Node:
    """A ``python -m kvstore`` process with a DRAM tier of ``dram_mib`` MiB, on loopback."""

    def __init__(self, block_bytes: int, dram_mib: int) -> None:
        self.shm_dir = tempfile.mkdtemp(prefix="kvstore-bench-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
        self.args = [
            sys.executable,
            "-m",
            "kvstore",
            "--node",
            "bench-kv",
            "--block-bytes",
            str(block_bytes),
            "--dram-mib",
            str(dram_mib),
            "--shm-dir",
            self.shm_dir,
            "--log-level",
            "WARNING",
        ]
        self.proc = subprocess.Popen(self.args, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()
        if (info := parse_ready(line)) is None:
            self.proc.kill()
            err = self.proc.communicate(timeout=10)[1]
            shutil.rmtree(self.shm_dir, ignore_errors=True)
            raise RuntimeError(f"kvstore node did not start: {line.strip()} {err.strip()}")
        self.info = info

    @property
    def grpc(self) -> str:
        return self.info["grpc"]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        shutil.rmtree(self.shm_dir, ignore_errors=True)


# -- the measurements ---------------------------------------------------------------------


class Keys:
    """16-byte block keys, fresh ones for every call or, with ``ring``, reused after ``ring`` calls.

    Remembers the batches handed out last, for the get loops.
    """

    def __init__(self, tag: int, ring: int | None = None) -> None:
        self._calls = itertools.count()
        self._tag = tag
        self._ring = ring
        self.recent: list[list[bytes]] = []

    def fresh(self, n: int) -> list[bytes]:
        call = next(self._calls)
        if self._ring:
            call %= self._ring
        keys = [struct.pack(">QQ", self._tag, call * n + i) for i in range(n)]
        self.recent.append(keys)
        if len(self.recent) > 4 * MAX_WORKING_SET:
            del self.recent[:-MAX_WORKING_SET]
        return keys

    def working_set(self, num_batches: int) -> list[list[bytes]]:
        return self.recent[-num_batches:]


def store_cells(
    client: KVStoreClient,
    system: str,
    keys: Keys,
    value: np.ndarray,
    bb: int,
    blocks: int,
    working_batches: int,
    seconds: float,
    rnd: int,
) -> list[Cell]:
    """Put fresh keys for ``seconds``, then get the batches stored last for ``seconds``."""
    data = value[: bb * blocks]
    out = np.empty(bb * blocks, dtype=np.uint8)

    def put() -> None:
        client.put(keys.fresh(blocks), data)

    for _ in range(3):
        put()
    durations, total = timed_loop(put, seconds)
    cells = [Cell(system, "put", bb, blocks, len(durations), total, statistics.median(durations) * 1e6, rnd)]
    # The get loop cycles over batches stored last: still in DRAM, since gets evict nothing.
    batches = itertools.cycle(keys.working_set(working_batches))
    got = client.get(next(batches), out=out)
    if got.num_blocks != blocks or not np.array_equal(out, data):
        raise RuntimeError(f"{system}: get of {blocks} x {human(bb)} returned {got.num_blocks} blocks or wrong bytes")

    def get() -> None:
        if client.get(next(batches), out=out).num_blocks != blocks:
            raise RuntimeError(f"{system}: a block stored moments ago is missing (evicted during gets?)")

    durations, total = timed_loop(get, seconds)
    cells.append(Cell(system, "get", bb, blocks, len(durations), total, statistics.median(durations) * 1e6, rnd))
    return cells


def redis_cells(
    r: redis.Redis, keys: Keys, value: bytes, bb: int, blocks: int, working_batches: int, seconds: float, rnd: int
) -> list[Cell]:
    """SET (MSET) ``keys`` for ``seconds``, then GET (MGET) the keys set last; one block = one value.

    ``keys`` is a ring, so a SET replaces a value set earlier (Redis frees the old one)
    where the store, whose puts skip stored keys, gets fresh keys and evicts.
    """

    def put() -> None:
        ks = keys.fresh(blocks)
        if blocks == 1:
            r.set(ks[0], value)
        else:
            r.mset(dict.fromkeys(ks, value))

    for _ in range(3):
        put()
    durations, total = timed_loop(put, seconds)
    cells = [Cell("redis", "put", bb, blocks, len(durations), total, statistics.median(durations) * 1e6, rnd)]
    batches = itertools.cycle(keys.working_set(working_batches))
    first = next(batches)
    got = [r.get(first[0])] if blocks == 1 else r.mget(first)
    if any(v != value for v in got):
        raise RuntimeError(f"redis: GET of a {human(bb)} value set moments ago returned something else")

    def get() -> None:
        ks = next(batches)
        got = [r.get(ks[0])] if blocks == 1 else r.mget(ks)
        if any(v is None for v in got):
            raise RuntimeError("redis: a value set moments ago is missing (evicted?)")

    durations, total = timed_loop(get, seconds)
    cells.append(Cell("redis", "get", bb, blocks, len(durations), total, statistics.median(durations) * 1e6, rnd))
    return cells


def fill(client: KVStoreClient, keys: Keys, value: np.ndarray, bb: int, dram_blocks: int) -> float:
    """Put one block per DRAM slot, in puts of up to 16 MiB, so every slot's memory is touched; return seconds."""
    per_put = max(1, min(16 * MIB // bb, dram_blocks))
    data = np.resize(value, per_put * bb)
    start = time.perf_counter()
    for _ in range(0, dram_blocks, per_put):
        client.put(keys.fresh(per_put), data)
    keys.recent.clear()
    return time.perf_counter() - start


# -- the run ------------------------------------------------------------------------------


@dataclass
class Report:
    command: str
    started_at: str
    machine: dict[str, object]
    sizes: list[int]
    batch_blocks: int
    dram_mib: int
    seconds: float
    rounds: int
    redis_version: str = ""
    transports: dict[str, str] = field(default_factory=dict)  # client -> the backend its engine picked
    fill_s: dict[str, float] = field(default_factory=dict)
    runs: list[Cell] = field(default_factory=list)
    cells: list[Cell] = field(default_factory=list)
    total_wall_s: float = 0.0


def shapes_for(sizes: list[int], batch_blocks: int) -> list[tuple[int, int]]:
    """(block bytes, blocks per call) of every row: one block each, and a batch for blocks under 1 MiB."""
    return [(s, 1) for s in sizes] + ([(s, batch_blocks) for s in sizes if s < MIB] if batch_blocks > 1 else [])


def run(args: argparse.Namespace, console: Console) -> Report:
    report = Report(
        command=shlex.join([sys.executable, *sys.argv]),
        started_at=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        machine=describe_machine(redis_py=redis.__version__, grpcio=grpc.__version__),
        sizes=args.sizes,
        batch_blocks=args.batch_blocks,
        dram_mib=args.dram_mib,
        seconds=args.seconds,
        rounds=args.rounds,
    )
    shapes = shapes_for(args.sizes, args.batch_blocks)
    progress = make_progress(console, args.no_progress)
    started = time.perf_counter()
    workdir = tempfile.mkdtemp(prefix="kvstore-bench-redis-")
    server = RedisServer(workdir)
    redis_client = redis.Redis.from_url(server.url, socket_timeout=30)
    report.redis_version = redis_client.info("server")["redis_version"]
    try:
        with progress:
            task = progress.add_task("starting", total=len(shapes) * args.rounds * 3)
            for size in args.sizes:
                progress.update(task, description=f"{human(size)}: starting a node and filling {args.dram_mib} MiB")
                node = Node(size, args.dram_mib)
                tcp_engine = TransferEngine(TransferConfig(node="bench-client", serve=False, backend=BackendKind.TCP))
                clients = {
                    "store-shm": KVStoreClient(node.grpc),
                    "store-tcp": KVStoreClient(node.grpc, engine=tcp_engine, control="tcp"),
                }
                try:
                    dram_blocks = int(node.info["dram_blocks"])
                    value = np.random.default_rng(size).integers(
                        0, 256, size * max(n for s, n in shapes if s == size), dtype=np.uint8
                    )
                    report.fill_s[human(size)] = fill(clients["store-shm"], Keys(0), value, size, dram_blocks)
                    for rnd in range(args.rounds):
                        for blocks in [n for s, n in shapes if s == size]:
                            # gets cycle over at most half the DRAM tier's worth of the batches put last:
                            # all still stored
                            working = max(1, min(MAX_WORKING_SET, dram_blocks // (2 * blocks)))
                            for name, client in clients.items():
                                progress.update(task, description=f"round {rnd + 1}: {name} {human(size)} x {blocks}")
                                cells = store_cells(
                                    client,
                                    name,
                                    Keys(1 + len(report.runs)),
                                    value,
                                    size,
                                    blocks,
                                    working,
                                    args.seconds,
                                    rnd,
                                )
                                record(report, cells, console)
                                progress.advance(task)
                            progress.update(task, description=f"round {rnd + 1}: redis {human(size)} x {blocks}")
                            ring = Keys(
                                1 + len(report.runs), ring=working
                            )  # Redis overwrites: its memory stays bounded
                            cells = redis_cells(
                                redis_client, ring, value[:size].tobytes(), size, blocks, working, args.seconds, rnd
                            )
                            record(report, cells, console)
                            progress.advance(task)
                    for name, client in clients.items():
                        report.transports[name] = transport_of(client, node)
                finally:
                    for client in clients.values():
                        client.close()
                    tcp_engine.close()
                    node.stop()
                    redis_client.flushall()
    finally:
        redis_client.close()
        server.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    report.cells = best_of(report.runs)
    report.total_wall_s = time.perf_counter() - started
    return report


def transport_of(client: KVStoreClient, node: Node) -> str:
    """The backend the client's engine uses for the node's DRAM segment (shm or tcp)."""
    seg = client.engine.segment(node.info["segment"])
    return client.engine.backend_for(seg).kind.value


def record(report: Report, cells: list[Cell], console: Console) -> None:
    for c in cells:
        report.runs.append(c)
        shape = human(c.block_bytes) + (f" x {c.blocks}" if c.blocks > 1 else "")
        console.log(
            f"{shape:>12} {c.op:>4} {c.system:<10} {c.ops_per_s:9,.0f} ops/s {c.gbps:6.2f} GB/s  p50 {c.p50_us:9.1f} us"
        )


def best_of(runs: list[Cell]) -> list[Cell]:
    """The fastest round of every (system, op, block size, blocks per call)."""
    best: dict[tuple, Cell] = {}
    for c in runs:
        key = (c.system, c.op, c.block_bytes, c.blocks)
        if key not in best or c.gbps > best[key].gbps:
            best[key] = c
    return list(best.values())


# -- report -------------------------------------------------------------------------------


def compare(report: Report) -> list[dict]:
    """Every row with its ratio to Redis doing the same, and the goal where one applies."""
    redis_of = {(c.op, c.block_bytes, c.blocks): c for c in report.cells if c.system == "redis"}
    rows = []
    for c in report.cells:
        base = redis_of.get((c.op, c.block_bytes, c.blocks))
        ratio = c.gbps / base.gbps if base is not None and c.system != "redis" and base.gbps > 0 else None
        goal = (
            GOAL_GET_VS_REDIS
            if c.system != "redis" and c.op == "get" and c.block_bytes == GOAL_SIZE and c.blocks == 1
            else None
        )
        rows.append(
            {
                "system": c.system,
                "op": c.op,
                "block_bytes": c.block_bytes,
                "blocks": c.blocks,
                "ops_per_s": c.ops_per_s,
                "gbps": c.gbps,
                "p50_us": c.p50_us,
                "vs_redis": ratio,
                "goal": goal,
                "met": None if goal is None or ratio is None else ratio >= goal,
            }
        )
    order = {"store-shm": 0, "store-tcp": 1, "redis": 2}
    rows.sort(key=lambda r: (r["blocks"], r["block_bytes"], r["op"] != "put", order.get(r["system"], 9)))
    return rows


def render(report: Report, rows: list[dict], console: Console) -> None:
    m = report.machine
    title = (
        f"KV store benchmark: a kvstore node process ({report.dram_mib} MiB DRAM) vs redis-server "
        f"{report.redis_version}, loopback, {m['cpu_model']} ({m['logical_cores']} cores), best "
        f"of {report.rounds} rounds"
    )
    caption = "put = reserve + write + commit (Redis SET / MSET); get = lease + read + release (Redis GET / MGET)"
    table = Table(title=title, caption=caption)
    for col in ("block", "blocks/call", "op", "system", "ops/s", "GB/s", "p50 us", "vs redis", "goal"):
        table.add_column(col, justify="left" if col in ("op", "system") else "right")
    last = None
    for r in rows:
        if last is not None and (r["block_bytes"], r["blocks"]) != last:
            table.add_section()
        last = (r["block_bytes"], r["blocks"])
        goal = ""
        if r["goal"] is not None:
            goal = f">= {r['goal']:g}x " + ("[green]PASS[/]" if r["met"] else "[red]MISS[/]")
        system = r["system"] + (f" ({report.transports[r['system']]})" if r["system"] in report.transports else "")
        table.add_row(
            human(r["block_bytes"]),
            str(r["blocks"]),
            r["op"],
            system,
            f"{r['ops_per_s']:,.0f}",
            f"{r['gbps']:.2f}",
            f"{r['p50_us']:,.1f}",
            "" if r["vs_redis"] is None else f"{r['vs_redis']:.2f}x",
            goal,
        )
    console.print(table)
    fills = ", ".join(f"{k} {v:.1f} s" for k, v in report.fill_s.items())
    goals = [r for r in rows if r["goal"] is not None]
    console.print(f"fill (not counted): {fills}")
    console.print(
        f"goals: {sum(1 for r in goals if r['met'])}/{len(goals)} met; total wall {report.total_wall_s:.0f} s"
    )


def to_json(report: Report, rows: list[dict]) -> dict:
    data = asdict(report)
    for name in ("runs", "cells"):
        for raw, cell in zip(data[name], getattr(report, name)):
            raw.update(ops_per_s=cell.ops_per_s, gbps=cell.gbps)
    data["comparison"] = rows
    return data


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", type=Path, help="write every raw number to this file")
    p.add_argument("--seconds", type=float, default=1.0, help="seconds per measured loop (default: 1)")
    p.add_argument("--rounds", type=int, default=2, help="rounds of every measurement; the best counts (default: 2)")
    p.add_argument(
        "--sizes",
        type=lambda s: [parse_size(x) for x in s.split(",") if x.strip()],
        default=[64 << 10, MIB, 16 * MIB],
        help="block sizes (default: 64KiB,1MiB,16MiB)",
    )
    p.add_argument(
        "--batch-blocks",
        type=int,
        default=16,
        help="blocks per call in the batched rows, for blocks under 1 MiB (0: none)",
    )
    p.add_argument("--dram-mib", type=int, default=1024, help="the node's DRAM tier, MiB (default: 1024)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    if not args.sizes or any(s <= 0 for s in args.sizes):
        p.error("--sizes needs positive sizes")
    if any(args.dram_mib * MIB < 8 * s * max(1, args.batch_blocks) for s in args.sizes if s < MIB) or any(
        args.dram_mib * MIB < 8 * s for s in args.sizes
    ):
        p.error("--dram-mib must hold at least 8 calls' worth of blocks of every size")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    console = Console(width=None if sys.stdout.isatty() else 160, log_path=False)
    report = run(args, console)
    rows = compare(report)
    render(report, rows, console)
    if args.json:
        args.json.write_text(json.dumps(to_json(report, rows), indent=2) + "\n")
        console.print(f"raw numbers written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
