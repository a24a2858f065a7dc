"""Transfer benchmark: our engine's tcp and shm backends against a raw socket and memcpy.

    python -m benchmarks.transfer_bench [--json PATH] [--seconds S] [--sizes 64KiB,1MiB,16MiB] [--mooncake]
        [--backend tcp|rdma]

The segment owner is a separate process on loopback (a ``TransferEngine`` that allocates
one shared-memory segment and serves it); this process reads and writes it through a
client engine forced to ``tcp`` or ``shm``. Each op is one batch (one slice, or
``--batch-slices`` slices for sizes under 16 MiB) submitted and waited for, one at a
time: GB/s is bytes over the whole loop, latency the median time of one op.

Baselines, measured in the same run: (a) a raw socket stream between two processes
(``sendall`` of a memoryview, ``recv_into`` a preallocated buffer) over one connection
and over two in parallel threads, the better of the two counting; (b) ``numpy.copyto``
between two preallocated buffers in one process (memcpy). ``--mooncake`` adds Mooncake's
own transfer engine (tcp protocol, P2PHANDSHAKE metadata) on the same shapes, run in
interpreters of its own. A tuning sweep runs our tcp backend at 16 MiB over every
(connections, chunk) pair in ``--tune-connections`` x ``--tune-chunks``.
See benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shlex
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from benchmarks.benchutil import describe_machine, human, make_progress, p50_us, parse_size, size_list, timed_loop
from benchmarks.transfer_baselines import DEFAULT_MOONCAKE_PATH, Cell, RawPeer, bench_mooncake, measure_memcpy
from transfer import BackendKind, Segment, Slice, TransferConfig, TransferEngine

KIB, MIB = 1 << 10, 1 << 20
GOAL_TCP_VS_RAW = 0.8  # at slices of GOAL_TCP_MIN_SIZE and more
GOAL_TCP_MIN_SIZE = MIB
GOAL_SHM_VS_MEMCPY = 0.5
DEFAULTS = TransferConfig(node="defaults")  # the configuration the main tcp rows use
WAIT_TIMEOUT_S = 60.0


# -- the segment owner (a separate process) -----------------------------------------------


def owner_main(conn, seg_bytes: int, shm_dir: str, backend: str = "auto") -> None:
    """Child process: allocate and serve one segment filled with a known pattern; stop when told."""
    engine = TransferEngine(TransferConfig(node="bench-owner", shm_dir=shm_dir, backend=BackendKind(backend)))
    seg = engine.allocate("dram", seg_bytes)
    np.frombuffer(engine.buffer(seg.name), dtype=np.uint8)[:] = pattern(seg_bytes)
    conn.send(seg.to_dict())
    try:
        conn.recv()
    except EOFError:
        pass
    engine.close()


def pattern(n: int) -> np.ndarray:
    return (np.arange(n, dtype=np.uint32) % 251).astype(np.uint8)


class Owner:
    """The owner process and the segment it serves."""

    def __init__(self, ctx, seg_bytes: int, backend: str = "auto") -> None:
        self.shm_dir = tempfile.mkdtemp(prefix="transfer-bench-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
        self._conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=owner_main, args=(child, seg_bytes, self.shm_dir, backend), daemon=True)
        self.proc.start()
        if not self._conn.poll(60):
            raise RuntimeError("the segment owner did not start within 60 s")
        self.segment = Segment.from_dict(self._conn.recv())

    def stop(self) -> None:
        try:
            self._conn.send("stop")
        except OSError:
            pass
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)
        shutil.rmtree(self.shm_dir, ignore_errors=True)


# -- our engine ---------------------------------------------------------------------------


def client_engine(backend: str, connections: int | None = None, chunk: int | None = None) -> TransferEngine:
    config = TransferConfig(
        node=f"bench-client-{backend}",
        serve=False,
        backend=BackendKind(backend),
        tcp_connections=connections or DEFAULTS.tcp_connections,
        tcp_chunk_bytes=chunk or DEFAULTS.tcp_chunk_bytes,
    )
    return TransferEngine(config)


def check_engine(engine: TransferEngine, segment: Segment, size: int, write: bool) -> None:
    """Read the owner's pattern, or write random bytes and read them back: the bytes must match."""
    local = np.zeros(size, dtype=np.uint8)
    expected = pattern(size)
    if write:
        expected = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
        engine.write(expected, [Slice(0, segment.name, 0, size)]).wait(WAIT_TIMEOUT_S)
    engine.read(local, [Slice(0, segment.name, 0, size)]).wait(WAIT_TIMEOUT_S)
    if not np.array_equal(local, expected):
        raise RuntimeError(
            f"{engine.config.backend.value}: {'write' if write else 'read'} of {size} bytes: wrong bytes read back"
        )


def measure_engine(
    engine: TransferEngine, system: str, op: str, segment: Segment, size: int, slices: int, seconds: float
) -> Cell:
    """Time one-at-a-time batches of ``slices`` slices of ``size`` bytes against the owner's segment."""
    local = np.ones(size * slices, dtype=np.uint8)  # touched, so no page faults in the loop
    batch = [Slice(i * size, segment.name, i * size, size) for i in range(slices)]
    submit = engine.read if op == "read" else engine.write

    def one() -> None:
        submit(local, batch).wait(WAIT_TIMEOUT_S)

    for _ in range(3):
        one()
    durations, total = timed_loop(one, seconds)
    config = {"backend": engine.config.backend.value}
    if system == "tcp":
        config |= {"tcp_connections": engine.config.tcp_connections, "tcp_chunk_bytes": engine.config.tcp_chunk_bytes}
    return Cell(system, op, size, slices, len(durations), total, p50_us(durations), config)


# -- the run ------------------------------------------------------------------------------


@dataclass
class Report:
    command: str
    started_at: str
    machine: dict[str, object]
    sizes: list[int]
    batch_slices: int
    seconds: float
    defaults: dict[str, int]
    rounds: int
    runs: list[Cell] = field(default_factory=list)  # every round of every loop
    cells: list[Cell] = field(default_factory=list)  # the best round of each
    tuning: list[Cell] = field(default_factory=list)
    mooncake_error: str | None = None
    total_wall_s: float = 0.0


def shapes_for(sizes: list[int], batch_slices: int) -> list[tuple[int, int]]:
    """(slice size, slices per op) of every row: one slice each, and a batch for sizes under 16 MiB."""
    shapes = [(s, 1) for s in sizes]
    if batch_slices > 1:
        shapes += [(s, batch_slices) for s in sizes if s < 16 * MIB]
    return shapes


def run(args: argparse.Namespace, console: Console) -> Report:
    report = Report(
        command=shlex.join([sys.executable, *sys.argv]),
        started_at=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        machine=describe_machine(numpy=np.__version__),
        sizes=args.sizes,
        batch_slices=args.batch_slices,
        seconds=args.seconds,
        rounds=args.rounds,
        defaults={"tcp_connections": DEFAULTS.tcp_connections, "tcp_chunk_bytes": DEFAULTS.tcp_chunk_bytes},
    )
    shapes = shapes_for(args.sizes, args.batch_slices)
    tune = [(c, k) for c in args.tune_connections for k in args.tune_chunks] if not args.no_tune else []
    if tune and (DEFAULTS.tcp_connections, DEFAULTS.tcp_chunk_bytes) not in tune:
        tune.append((DEFAULTS.tcp_connections, DEFAULTS.tcp_chunk_bytes))  # the sweep always says how the default does
    seg_bytes = max([s * n for s, n in shapes] + [args.tune_size if tune else 0])
    ctx = mp.get_context("spawn")  # the children start clean: no copies of this process's threads
    total = (
        (len(args.sizes) * 7 + len(shapes) * 4) * args.rounds
        + len(tune) * 2 * args.tune_rounds
        + (1 if args.mooncake else 0)
    )
    progress = make_progress(console, args.no_progress)
    started = time.perf_counter()
    owner = Owner(ctx, seg_bytes, "rdma" if args.backend == "rdma" else "auto")
    raw = RawPeer(ctx)
    engines = {b: client_engine(b) for b in (args.backend, "shm")}  # between hosts (tcp or rdma), and this host
    for engine in engines.values():
        engine.add_segment(owner.segment)
    try:
        for write in (False, True):  # every read check sees the owner's pattern before any write lands
            for engine in engines.values():
                for size in sorted(set(args.sizes)):
                    check_engine(engine, owner.segment, size, write)
        with progress:
            task = progress.add_task("measuring", total=total)

            def record(cell: Cell, into: list[Cell], rnd: int) -> None:
                cell.config["round"] = rnd
                into.append(cell)
                progress.advance(task)
                shape = human(cell.size) + (f" x {cell.slices}" if cell.slices > 1 else "")
                console.log(
                    f"{shape:>14} {cell.op:>5} {cell.system:<12} {cell.gbps:7.2f} GB/s  p50 {cell.p50_us:9.1f} us"
                )

            for rnd in range(args.rounds):  # each round puts a size's baselines next to our rows; the best round counts
                for size in args.sizes:
                    progress.update(task, description=f"round {rnd + 1}: baselines at {human(size)}")
                    record(measure_memcpy(size, args.seconds), report.runs, rnd)
                    for op in ("read", "write"):
                        for nconn in (1, 2):
                            record(raw.measure(op, size, nconn, args.seconds), report.runs, rnd)
                        record(raw.measure_rpc(op, size, args.seconds), report.runs, rnd)
                    for slices in [n for s, n in shapes if s == size]:
                        for backend, engine in engines.items():
                            for op in ("read", "write"):
                                progress.update(
                                    task, description=f"round {rnd + 1}: {backend} {op} {human(size)} x {slices}"
                                )
                                cell = measure_engine(engine, backend, op, owner.segment, size, slices, args.seconds)
                                record(cell, report.runs, rnd)
            for rnd in range(args.tune_rounds):  # rounds interleave the configurations, so noise hits them alike
                for conns, chunk in tune if rnd % 2 == 0 else tune[::-1]:
                    engine = client_engine("tcp", conns, chunk)
                    engine.add_segment(owner.segment)
                    try:
                        for op in ("read", "write"):
                            progress.update(
                                task, description=f"tuning: {conns} connections, {human(chunk)} chunks, {op}"
                            )
                            cell = measure_engine(
                                engine, "tcp", op, owner.segment, args.tune_size, 1, args.tune_seconds
                            )
                            record(cell, report.tuning, rnd)
                    finally:
                        engine.close()
            if args.mooncake:
                progress.update(task, description="Mooncake transfer engine (its own processes)")
                cells, report.mooncake_error = bench_mooncake(
                    args.mooncake_path, args.mooncake_python, shapes, seg_bytes, args.seconds, args.rounds
                )
                for cell in cells:
                    report.runs.append(cell)
                    console.log(
                        f"{human(cell.size):>9} x {cell.slices:<3} {cell.op:>5} {cell.system:<12} {cell.gbps:7.2f} GB/s"
                    )
                progress.advance(task)
    finally:
        for engine in engines.values():
            engine.close()
        raw.stop()
        owner.stop()
    report.cells = best_of(report.runs)
    report.total_wall_s = time.perf_counter() - started
    return report


def best_of(runs: list[Cell]) -> list[Cell]:
    """The fastest round of every (system, op, size, slices), in first-measured order."""
    best: dict[tuple, Cell] = {}
    for c in runs:
        key = (c.system, c.op, c.size, c.slices)
        if key not in best or c.gbps > best[key].gbps:
            best[key] = c
    return list(best.values())


# -- report -------------------------------------------------------------------------------


def find(cells: list[Cell], system: str, op: str, size: int, slices: int = 1) -> Cell | None:
    return next((c for c in cells if (c.system, c.op, c.size, c.slices) == (system, op, size, slices)), None)


def best_raw(cells: list[Cell], op: str, size: int) -> Cell | None:
    raws = [c for c in cells if c.system in ("raw-1conn", "raw-2conn") and c.op == op and c.size == size]
    return max(raws, key=lambda c: c.gbps, default=None)


def compare(report: Report) -> list[dict]:
    """Every engine row with its baseline, the ratio, and the goal where one applies."""
    rows = []
    for c in report.cells:
        if c.system not in ("tcp", "rdma", "shm", "mooncake-tcp"):
            continue
        if c.system == "shm":
            base = find(report.cells, "memcpy", "copy", c.size)
            goal = GOAL_SHM_VS_MEMCPY if c.slices == 1 else None
        else:
            base = best_raw(report.cells, c.op, c.size)
            goal = GOAL_TCP_VS_RAW if c.system == "tcp" and c.slices == 1 and c.size >= GOAL_TCP_MIN_SIZE else None
        ratio = c.gbps / base.gbps if base is not None and base.gbps > 0 else None
        ours = find(report.cells, "tcp", c.op, c.size, c.slices) if c.system == "mooncake-tcp" else None
        rpc = find(report.cells, "raw-rpc", c.op, c.size) if c.system != "shm" and c.slices == 1 else None
        rows.append(
            {
                "system": c.system,
                "op": c.op,
                "size": c.size,
                "slices": c.slices,
                "gbps": c.gbps,
                "p50_us": c.p50_us,
                "baseline": base.system if base else None,
                "baseline_gbps": base.gbps if base else None,
                "ratio": ratio,
                "goal": goal,
                "met": None if goal is None or ratio is None else ratio >= goal,
                "vs_raw_rpc": c.gbps / rpc.gbps if rpc and rpc.gbps > 0 else None,
                "ours_tcp_vs_mooncake": ours.gbps / c.gbps if ours and c.gbps > 0 else None,
            }
        )
    return rows


def tuning_summary(report: Report) -> list[dict]:
    """Per (connections, chunk): the best read and write GB/s over the rounds, and their mean."""
    configs: dict[tuple[int, int], dict] = {}
    for c in report.tuning:
        key = (c.config["tcp_connections"], c.config["tcp_chunk_bytes"])
        entry = configs.setdefault(
            key, {"tcp_connections": key[0], "tcp_chunk_bytes": key[1], "read": 0.0, "write": 0.0}
        )
        entry[c.op] = max(entry[c.op], c.gbps)
    rows = sorted(configs.values(), key=lambda r: (r["tcp_connections"], r["tcp_chunk_bytes"]))
    for r in rows:
        r["mean"] = (r["read"] + r["write"]) / 2
    return rows


def render(report: Report, rows: list[dict], tuning: list[dict], console: Console) -> None:
    m = report.machine
    title = f"Transfer benchmark: owner in another process on loopback, {m['cpu_model']} ({m['logical_cores']} cores)"
    table = Table(
        title=title,
        caption="GB/s = 1e9 bytes/s; p50 = median time of one op (raw-Nconn: of one message in the stream); "
        "ratio = GB/s / baseline (tcp: the better raw stream, shm: memcpy); raw-rpc = one request at a time",
    )
    for col, justify in (
        ("slice", "right"),
        ("slices/op", "right"),
        ("op", "left"),
        ("system", "left"),
        ("GB/s", "right"),
        ("p50 us", "right"),
        ("baseline", "left"),
        ("baseline GB/s", "right"),
        ("ratio", "right"),
        ("goal", "right"),
        ("vs raw-rpc", "right"),
    ):
        table.add_column(col, justify=justify)
    shapes = shapes_for(report.sizes, report.batch_slices)
    for size, slices in shapes:
        if slices == 1:
            memcpy = find(report.cells, "memcpy", "copy", size)
            if memcpy:
                table.add_row(
                    human(size),
                    "1",
                    "copy",
                    "memcpy",
                    f"{memcpy.gbps:.2f}",
                    f"{memcpy.p50_us:,.1f}",
                    "",
                    "",
                    "",
                    "",
                    "",
                )
            for op in ("read", "write"):
                for c in [x for x in report.cells if x.system.startswith("raw-") and x.op == op and x.size == size]:
                    best = best_raw(report.cells, op, size) is c
                    table.add_row(
                        human(size),
                        "1",
                        op,
                        c.system + (" (best)" if best else ""),
                        f"{c.gbps:.2f}",
                        f"{c.p50_us:,.1f}",
                        "",
                        "",
                        "",
                        "",
                        "",
                    )
        for r in [r for r in rows if r["size"] == size and r["slices"] == slices]:
            goal = ""
            if r["goal"] is not None:
                verdict = "[green]PASS[/]" if r["met"] else "[red]MISS[/]"
                goal = f">= {r['goal']:.0%} {verdict}"
            ratio = "-" if r["ratio"] is None else f"{r['ratio']:.0%}"
            table.add_row(
                human(size),
                str(slices),
                r["op"],
                r["system"],
                f"{r['gbps']:.2f}",
                f"{r['p50_us']:,.1f}",
                r["baseline"] or "-",
                "-" if r["baseline_gbps"] is None else f"{r['baseline_gbps']:.2f}",
                ratio,
                goal,
                "" if r["vs_raw_rpc"] is None else f"{r['vs_raw_rpc']:.0%}",
            )
        table.add_section()
    console.print(table)

    if tuning:
        default = (report.defaults["tcp_connections"], report.defaults["tcp_chunk_bytes"])
        best = max(tuning, key=lambda r: r["mean"])
        t = Table(
            title=f"tcp tuning at {human(report.tuning[0].size)} (best of "
            f"{max(c.config['round'] for c in report.tuning) + 1} rounds)"
        )
        for col in ("connections", "chunk", "read GB/s", "write GB/s", "mean GB/s", "vs default"):
            t.add_column(col, justify="right")
        base = next((r["mean"] for r in tuning if (r["tcp_connections"], r["tcp_chunk_bytes"]) == default), None)
        for r in tuning:
            key = (r["tcp_connections"], r["tcp_chunk_bytes"])
            mark = " (default)" if key == default else ""
            mark += " [bold](best)[/]" if r is best else ""
            t.add_row(
                str(r["tcp_connections"]),
                human(r["tcp_chunk_bytes"]) + mark,
                f"{r['read']:.2f}",
                f"{r['write']:.2f}",
                f"{r['mean']:.2f}",
                "-" if not base else f"{r['mean'] / base:.2f}x",
            )
        console.print(t)
        if base:
            gain = best["mean"] / base
            console.print(
                f"best tcp config at {human(report.tuning[0].size)}: {best['tcp_connections']} connections, "
                f"{human(best['tcp_chunk_bytes'])} chunks, {gain:.2f}x the default "
                f"({default[0]} connections, {human(default[1])} chunks)"
            )
    for r in rows:
        if r["ours_tcp_vs_mooncake"] is not None:
            console.print(
                f"ours tcp / Mooncake tcp, {r['op']} {human(r['size'])} x {r['slices']}: "
                f"{r['ours_tcp_vs_mooncake']:.2f}x"
            )
    if report.mooncake_error:
        console.print(f"[yellow]Mooncake's transfer engine was not measured:[/] {report.mooncake_error}")
    goals = [r for r in rows if r["goal"] is not None]
    passed = sum(1 for r in goals if r["met"])
    console.print(f"goals: {passed}/{len(goals)} met; total wall {report.total_wall_s:.0f} s")


def to_json(report: Report, rows: list[dict], tuning: list[dict]) -> dict:
    data = asdict(report)
    for name in ("runs", "cells", "tuning"):
        for raw, cell in zip(data[name], getattr(report, name)):
            raw["gbps"] = cell.gbps
    data["comparison"] = rows
    data["tuning_summary"] = tuning
    return data


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", type=Path, help="write every raw number to this file")
    p.add_argument("--seconds", type=float, default=1.0, help="seconds per measured loop (default: 1)")
    p.add_argument("--rounds", type=int, default=2, help="rounds of every measurement; the best counts (default: 2)")
    p.add_argument(
        "--sizes", type=size_list, default=size_list("64KiB,1MiB,16MiB"), help="slice sizes (default: 64KiB,1MiB,16MiB)"
    )
    p.add_argument(
        "--batch-slices",
        type=int,
        default=16,
        help="slices per op in the batched rows, for sizes under 16 MiB (0: none)",
    )
    p.add_argument("--mooncake", action="store_true", help="also measure Mooncake's transfer engine (tcp)")
    p.add_argument(
        "--mooncake-path",
        type=Path,
        default=DEFAULT_MOONCAKE_PATH if DEFAULT_MOONCAKE_PATH.is_dir() else None,
        help="directory holding the Mooncake wheel's packages, put on PYTHONPATH (default: "
        f"{DEFAULT_MOONCAKE_PATH} if it exists)",
    )
    p.add_argument("--mooncake-python", default=sys.executable, help="interpreter for the Mooncake processes")
    p.add_argument("--no-tune", action="store_true", help="skip the tcp tuning sweep")
    p.add_argument(
        "--tune-size", type=parse_size, default=16 * MIB, help="slice size of the tuning sweep (default: 16MiB)"
    )
    p.add_argument("--tune-connections", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 4])
    p.add_argument("--tune-chunks", type=size_list, default=size_list("1MiB,2MiB,4MiB"))
    p.add_argument(
        "--tune-rounds", type=int, default=2, help="rounds over every tuning config; the best counts (default: 2)"
    )
    p.add_argument("--tune-seconds", type=float, default=None, help="seconds per tuning loop (default: --seconds / 2)")
    p.add_argument(
        "--backend",
        choices=["tcp", "rdma"],
        default="tcp",
        help="the between-hosts backend measured beside "
        "shm (rdma: over an active RDMA port, which the owner's segment is registered on; exits 2 without one)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    if not args.sizes or any(s <= 0 for s in args.sizes):
        p.error("--sizes needs positive sizes")
    if args.tune_seconds is None:
        args.tune_seconds = args.seconds / 2
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    console = Console(width=None if sys.stdout.isatty() else 160, log_path=False)
    if args.backend == "rdma":
        from transfer.rdma import RdmaUnavailable, probe

        try:
            console.print(f"rdma: {probe().describe()}")
        except RdmaUnavailable as e:
            console.print(f"[red]error:[/red] --backend rdma: {e}")
            return 2
    report = run(args, console)
    rows, tuning = compare(report), tuning_summary(report)
    render(report, rows, tuning, console)
    if args.json:
        args.json.write_text(json.dumps(to_json(report, rows, tuning), indent=2) + "\n")
        console.print(f"raw numbers written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
