"""What mutual TLS between the components costs (issue 21): the same benchmarks with and without it, in one run.

    python -m benchmarks.tls_bench [--json PATH] [--pairs 2] [--seconds 1] [--sizes 64KiB,1MiB,16MiB]
                                   [--no-e2e] [--e2e-args "--quick"]

1. **Why the data paths are authenticated, not encrypted.** In this process, one
   connection streams ``--stream-mib`` MiB of 1 MiB sends from a thread to a reader,
   over a plain socket and over TLS 1.3 (AES-GCM, the cipher OpenSSL picks here):
   GB/s of each and their ratio.
2. **The transfer path and the pool** (benchmarks/transfer_bench.py and
   benchmarks/kvstore_bench.py, each run as a process of its own): once with
   ``MOONCAKE_TLS_DIR`` naming a CA made for this run (every connection then starts with
   the mutual-TLS handshake of mooncake/tls.py: the owner of a segment, the pool node
   and its client all present certificates) and once without it. ``--pairs`` pairs in
   ABBA order; for each row the better of its runs counts, and the ratio TLS / plain of
   GB/s is printed (goal: at least 0.9 on the transfer path at 1 MiB and up).
3. **End to end** (benchmarks/e2e_bench.py ``--no-overlap``, the cluster through the
   gateway): TTFT of cold and warm prompts with ``--insecure`` and without (gRPC then
   encrypted, the framed paths authenticated); the coupled engine measured in each run
   is the same in both and shows how much of a difference is noise.

See benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from benchmarks.benchutil import describe_machine, human
from mooncake import tls

REPO = Path(__file__).resolve().parent.parent
GOAL_TRANSFER = 0.9  # TLS / plain GB/s at 1 MiB and up
MIB = 1 << 20
console = Console()


def stream_gbps(total_mib: int, ident: tls.Identity | None) -> float:
    """One connection, ``total_mib`` sends of 1 MiB: plain, or encrypted end to end with ``ident``'s certificates."""
    listener = socket.create_server(("127.0.0.1", 0))
    data = memoryview(bytearray(MIB))

    def serve() -> None:
        conn, _ = listener.accept()
        if ident is not None:
            conn = ident.server_context.wrap_socket(conn, server_side=True)
        with conn:
            for _ in range(total_mib):
                conn.sendall(data)

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    sock = socket.create_connection(listener.getsockname())
    if ident is not None:
        sock = ident.client_context.wrap_socket(sock, server_hostname=tls.SERVER_NAME)
    buf = memoryview(bytearray(MIB))
    got, start = 0, time.perf_counter()
    with sock:
        while got < total_mib * MIB:
            n = sock.recv_into(buf)
            if not n:
                raise ConnectionError("the sender stopped early")
            got += n
    seconds = time.perf_counter() - start
    t.join(10)
    listener.close()
    return got / seconds / 1e9


def run_bench(module: str, args: list[str], tls_dir: Path | None, out: Path, log: Path) -> dict:
    """Run ``python -m module`` (from the repository's root) with ``args --json out`` under TLS (``tls_dir``) or
    without; return its JSON."""
    env = {k: v for k, v in os.environ.items() if k != tls.ENV_DIR}
    if tls_dir is not None:
        env[tls.ENV_DIR] = str(tls_dir)
    cmd = [sys.executable, "-m", module, *args, "--json", str(out), "--no-progress"]
    with open(log, "ab") as f:
        f.write(f"\n$ {shlex.join(cmd)}  ({'TLS' if tls_dir else 'plain'})\n".encode())
        f.flush()
        done = subprocess.run(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=3600)
    if done.returncode != 0:
        raise RuntimeError(f"{module} failed (exit {done.returncode}); see {log}")
    return json.loads(out.read_text())


def best_rows(runs: list[dict], key_fields: tuple[str, ...], value: str) -> dict[tuple, float]:
    """The best ``value`` of every row (keyed by ``key_fields``) over the runs' comparison tables."""
    best: dict[tuple, float] = {}
    for run in runs:
        for row in run["comparison"]:
            if row.get(value) is None:
                continue
            key = tuple(row.get(f) for f in key_fields)
            best[key] = max(best.get(key, 0.0), row[value])
    return best


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", type=Path, help="write every raw number (and the command line) to this file")
    p.add_argument("--pairs", type=int, default=2, help="runs of each benchmark with and without TLS, ABBA (default 2)")
    p.add_argument("--seconds", type=float, default=1.0, help="seconds per measured loop of the sub-benchmarks")
    p.add_argument("--sizes", default="64KiB,1MiB,16MiB", help="sizes of the transfer and pool rows")
    p.add_argument("--stream-mib", type=int, default=2048, help="MiB streamed in the plain/TLS socket comparison")
    p.add_argument("--no-e2e", action="store_true", help="skip the end-to-end TTFT comparison")
    p.add_argument("--only-e2e", action="store_true", help="only the end-to-end TTFT comparison (part 3)")
    p.add_argument("--e2e-args", default="", help='more arguments for e2e_bench.py (e.g. "--quick")')
    args = p.parse_args(argv)

    work = Path(tempfile.mkdtemp(prefix="tls-bench-"))
    ident = tls.generate(work / "tls")
    log = work / "runs.log"
    report: dict = {
        "command": shlex.join([sys.argv[0], *(argv if argv is not None else sys.argv[1:])]),
        "machine": describe_machine(),
        "log": str(log),
    }
    t0 = time.perf_counter()

    if args.only_e2e:
        args.pairs = 0
    else:
        stream_part(args, ident, report)
    benches_part(args, ident, work, log, report)
    if not args.no_e2e:
        e2e_part(args, work, log, report)
    report["total_wall_s"] = time.perf_counter() - t0
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1))
        console.print(f"wrote {args.json}")
    return 0


def stream_part(args, ident: tls.Identity, report: dict) -> None:
    console.print("[bold]1. one stream, plain and encrypted[/bold]")
    plain = max(stream_gbps(args.stream_mib, None) for _ in range(2))
    encrypted = max(stream_gbps(args.stream_mib, ident) for _ in range(2))
    report["stream"] = {"plain_gbps": plain, "tls_gbps": encrypted, "ratio": encrypted / plain}
    console.print(
        f"  plain {plain:.2f} GB/s, TLS {encrypted:.2f} GB/s: {encrypted / plain:.2f}x "
        "(why the transfer path is authenticated per connection, not encrypted)"
    )


def benches_part(args, ident: tls.Identity, work: Path, log: Path, report: dict) -> None:
    if not args.pairs:
        return
    sub = ["--seconds", str(args.seconds), "--sizes", args.sizes]
    order = [m for i in range(args.pairs) for m in ((False, True) if i % 2 == 0 else (True, False))]
    runs: dict[str, dict[bool, list[dict]]] = {"transfer": {False: [], True: []}, "pool": {False: [], True: []}}
    for i, with_tls in enumerate(order):
        label = "TLS" if with_tls else "plain"
        console.print(f"[bold]2. run {i + 1}/{len(order)} ({label})[/bold]: transfer_bench, kvstore_bench")
        tls_dir = ident.directory if with_tls else None
        runs["transfer"][with_tls].append(
            run_bench(
                "benchmarks.transfer_bench",
                [*sub, "--no-tune", "--rounds", "1"],
                tls_dir,
                work / f"transfer-{i}.json",
                log,
            )
        )
        runs["pool"][with_tls].append(
            run_bench("benchmarks.kvstore_bench", [*sub, "--rounds", "1"], tls_dir, work / f"pool-{i}.json", log)
        )
    report["runs"] = runs

    rows = []
    table = Table(title="TLS / plain, same run (best of each)")
    for c in ("bench", "path", "op", "size", "plain GB/s", "TLS GB/s", "ratio", "goal"):
        table.add_column(c, justify="left" if c in ("bench", "path", "op") else "right")
    keyed = {"transfer": ("system", "op", "size", "slices"), "pool": ("system", "op", "block_bytes", "blocks")}
    for bench, fields in keyed.items():
        off, on = best_rows(runs[bench][False], fields, "gbps"), best_rows(runs[bench][True], fields, "gbps")
        for key in sorted(off, key=lambda k: tuple(str(x) for x in k)):
            system = key[0]
            if system not in ("tcp", "store-tcp", "store-shm") or key not in on:
                continue  # the baselines (raw sockets, memcpy, Redis) do not change with TLS
            ratio = on[key] / off[key] if off[key] else None
            goal = GOAL_TRANSFER if bench == "transfer" and key[2] >= MIB else None
            rows.append(
                {
                    "bench": bench,
                    "system": system,
                    "op": key[1],
                    "size": key[2],
                    "batch": key[3],
                    "plain_gbps": off[key],
                    "tls_gbps": on[key],
                    "ratio": ratio,
                    "goal": goal,
                    "met": None if goal is None else ratio >= goal,
                }
            )
            table.add_row(
                bench,
                system,
                key[1],
                f"{human(key[2])} x{key[3]}",
                f"{off[key]:.3f}",
                f"{on[key]:.3f}",
                f"{ratio:.2f}" if ratio else "-",
                f">= {goal}" if goal else "",
            )
    report["comparison"] = rows
    console.print(table)


def e2e_part(args, work: Path, log: Path, report: dict) -> None:
    extra = shlex.split(args.e2e_args)
    e2e: dict[bool, list[dict]] = {False: [], True: []}
    for i, with_tls in enumerate((False, True)):
        label = "TLS" if with_tls else "plain"
        console.print(f"[bold]3. e2e_bench ({label})[/bold]")
        e2e_args = ["--no-overlap", *extra, *([] if with_tls else ["--insecure"])]
        e2e[with_tls].append(run_bench("benchmarks.e2e_bench", e2e_args, None, work / f"e2e-{i}.json", log))
    report["e2e_runs"] = e2e
    t = Table(title="end to end, TTFT (s), median of the reps")
    for c in ("prompt", "cache", "plain", "TLS", "ratio", "coupled (plain run)", "coupled (TLS run)"):
        t.add_column(c, justify="right")
    e2e_rows = []
    for a, b in zip(e2e[False][0]["serving"], e2e[True][0]["serving"]):
        ratio = b["disaggregated_ttft_s"] / a["disaggregated_ttft_s"]
        e2e_rows.append(
            {
                "prompt_tokens": a["prompt_tokens"],
                "cache": a["cache"],
                "plain_ttft_s": a["disaggregated_ttft_s"],
                "tls_ttft_s": b["disaggregated_ttft_s"],
                "ratio": ratio,
                "coupled_plain_s": a["coupled_ttft_s"],
                "coupled_tls_s": b["coupled_ttft_s"],
            }
        )
        t.add_row(
            str(a["prompt_tokens"]),
            a["cache"],
            f"{a['disaggregated_ttft_s']:.3f}",
            f"{b['disaggregated_ttft_s']:.3f}",
            f"{ratio:.2f}",
            f"{a['coupled_ttft_s']:.3f}",
            f"{b['coupled_ttft_s']:.3f}",
        )
    report["e2e"] = e2e_rows
    console.print(t)


if __name__ == "__main__":
    raise SystemExit(main())
