"""The baselines benchmarks/transfer_bench.py measures our engine against, in the same run: a raw socket stream
between two processes, memcpy, and Mooncake's own transfer engine (in interpreters of its own); and ``Cell``, one
measured loop of any of them."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from benchmarks.benchutil import p50_us, timed_loop
from mooncake.runtime.process import parse_ready

DEFAULT_MOONCAKE_PATH = (
    Path.home() / ".cache" / "mooncake" / "mooncake-te"
)  # pip install --target of mooncake-transfer-engine-non-cuda
MOONCAKE_RESULT_PREFIX = "TRANSFER_BENCH_MOONCAKE "


# -- what is measured ---------------------------------------------------------------------


@dataclass
class Cell:
    """One measured loop: ``ops`` ops of ``slices`` slices of ``size`` bytes in ``seconds``."""

    system: str  # tcp, shm, raw-1conn, raw-2conn, memcpy, mooncake-tcp
    op: str  # read, write (for raw: the direction; memcpy: copy)
    size: int  # bytes per slice
    slices: int  # slices per op
    ops: int
    seconds: float
    p50_us: float  # median time of one op (raw: of one message of a stream; several connections: per connection)
    config: dict[str, object] = field(default_factory=dict)
    error: str | None = None

    @property
    def gbps(self) -> float:
        return self.ops * self.slices * self.size / self.seconds / 1e9 if self.seconds > 0 else 0.0


# -- baselines: raw socket stream, memcpy -------------------------------------------------


def raw_peer_main(conn) -> None:
    """Child process: on each command, accept connections and stream to them or drain them."""
    listener = socket.create_server(("127.0.0.1", 0), backlog=16)
    conn.send(listener.getsockname()[1])
    while True:
        try:
            cmd = conn.recv()
        except EOFError:
            return
        if cmd is None:
            return
        role, size, nconn, seconds = cmd
        socks = [listener.accept()[0] for _ in range(nconn)]
        if role.startswith("rpc-"):
            serve_rpc(socks[0], role, size)
            conn.send((0, 0.0))
            continue
        counts = [0] * nconn
        marks: list[float] = []

        def send(i: int) -> None:
            view = memoryview(np.ones(size, dtype=np.uint8)).cast("B")
            deadline = time.perf_counter() + seconds
            while time.perf_counter() < deadline:
                socks[i].sendall(view)
                counts[i] += size
            socks[i].shutdown(socket.SHUT_WR)
            socks[i].recv(1)  # wait for the reader to finish

        def drain(i: int) -> None:
            buf = memoryview(np.empty(size, dtype=np.uint8)).cast("B")
            while True:
                n = socks[i].recv_into(buf)
                if n == 0:
                    break
                if not marks:
                    marks.append(time.perf_counter())
                counts[i] += n
            socks[i].close()

        threads = [threading.Thread(target=send if role == "send" else drain, args=(i,)) for i in range(nconn)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        end = time.perf_counter()
        conn.send((sum(counts), end - marks[0] if marks else 0.0))
        for s in socks:
            s.close()


def recv_exact(sock: socket.socket, view: memoryview) -> bool:
    """Fill ``view``; False on EOF before the first byte."""
    pos = 0
    while pos < len(view):
        n = sock.recv_into(view[pos:], len(view) - pos)
        if n == 0:
            if pos:
                raise ConnectionError("connection closed mid-message")
            return False
        pos += n
    return True


def serve_rpc(sock: socket.socket, role: str, size: int) -> None:
    """Answer one request at a time: a 1-byte request gets ``size`` bytes (read), ``size`` bytes get a 1-byte ack
    (write)."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    view = memoryview(np.ones(size, dtype=np.uint8)).cast("B")
    one = memoryview(bytearray(1))
    while recv_exact(sock, one if role == "rpc-read" else view):
        sock.sendall(view if role == "rpc-read" else b"k")
    sock.close()


class RawPeer:
    """The raw-socket peer process: streams to us (the read direction) or drains us (write)."""

    def __init__(self, ctx) -> None:
        self._conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=raw_peer_main, args=(child,), daemon=True)
        self.proc.start()
        if not self._conn.poll(60):
            raise RuntimeError("the raw-socket peer did not start within 60 s")
        self.port = self._conn.recv()

    def measure(self, op: str, size: int, nconn: int, seconds: float) -> Cell:
        """Stream ``size``-byte messages for ``seconds`` over ``nconn`` connections; GB/s from the receiver."""
        self._conn.send(("send" if op == "read" else "recv", size, nconn, seconds))
        socks = [socket.create_connection(("127.0.0.1", self.port)) for _ in range(nconn)]
        per_conn: list[list[float]] = [[] for _ in range(nconn)]
        received = [0] * nconn
        first: list[float] = []

        def recv(i: int) -> None:  # the read direction: the peer sends, we recv_into a preallocated buffer
            view = memoryview(np.empty(size, dtype=np.uint8)).cast("B")
            pos, t = 0, None
            while True:
                n = socks[i].recv_into(view[pos:], size - pos)
                if n == 0:
                    break
                if t is None:
                    t = time.perf_counter()
                    first.append(t)
                received[i] += n
                pos += n
                if pos == size:
                    now = time.perf_counter()
                    per_conn[i].append(now - t)
                    pos, t = 0, now
            socks[i].send(b"x")

        def send(i: int) -> None:  # the write direction: we sendall a memoryview, the peer drains
            view = memoryview(np.ones(size, dtype=np.uint8)).cast("B")
            deadline = time.perf_counter() + seconds
            while (t := time.perf_counter()) < deadline:
                socks[i].sendall(view)
                per_conn[i].append(time.perf_counter() - t)
            socks[i].shutdown(socket.SHUT_WR)

        threads = [threading.Thread(target=recv if op == "read" else send, args=(i,)) for i in range(nconn)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        end = time.perf_counter()
        peer_bytes, peer_seconds = self._conn.recv()
        for s in socks:
            s.close()
        if op == "read":
            total, elapsed = sum(received), end - min(first)
        else:
            total, elapsed = peer_bytes, peer_seconds
        durations = [d for ds in per_conn for d in ds]
        return Cell(f"raw-{nconn}conn", op, size, 1, total // size, elapsed, p50_us(durations), {"connections": nconn})

    def measure_rpc(self, op: str, size: int, seconds: float) -> Cell:
        """One request at a time on one connection, like one-slice ops: ask for ``size`` bytes (read) or send them
        (write)."""
        self._conn.send((f"rpc-{op}", size, 1, seconds))
        sock = socket.create_connection(("127.0.0.1", self.port))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        view = memoryview(np.ones(size, dtype=np.uint8)).cast("B")
        one = memoryview(bytearray(1))

        def call() -> None:
            if op == "read":
                sock.sendall(b"r")
                recv_exact(sock, view)
            else:
                sock.sendall(view)
                recv_exact(sock, one)

        for _ in range(3):
            call()
        durations, total = timed_loop(call, seconds)
        sock.close()
        self._conn.recv()
        return Cell("raw-rpc", op, size, 1, len(durations), total, p50_us(durations), {"connections": 1})

    def stop(self) -> None:
        try:
            self._conn.send(None)
        except OSError:
            pass
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()


def measure_memcpy(size: int, seconds: float) -> Cell:
    """numpy.copyto between two preallocated, touched buffers of ``size`` bytes."""
    src, dst = np.ones(size, dtype=np.uint8), np.zeros(size, dtype=np.uint8)
    for _ in range(3):
        np.copyto(dst, src)
    durations, total = timed_loop(lambda: np.copyto(dst, src), seconds)
    return Cell("memcpy", "copy", size, 1, len(durations), total, p50_us(durations))


# -- Mooncake's transfer engine (in its own interpreters) ---------------------------------

MOONCAKE_OWNER = r"""
import json, sys
import numpy as np
from mooncake.engine import TransferEngine
engine = TransferEngine()
rc = engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
if rc != 0:
    sys.exit(f"initialize returned {rc}")
buf = np.zeros(int(sys.argv[1]), dtype=np.uint8)
rc = engine.register_memory(buf.ctypes.data, buf.nbytes)
if rc != 0:
    sys.exit(f"register_memory returned {rc}")
print("READY " + json.dumps({"port": engine.get_rpc_port(), "addr": buf.ctypes.data}), flush=True)
sys.stdin.read()
"""

MOONCAKE_CLIENT = r"""
import json, statistics, sys, time
import numpy as np
from mooncake.engine import TransferEngine
args = json.loads(sys.argv[1])
engine = TransferEngine()
if engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
    sys.exit("initialize failed")
local = np.ones(args["seg_bytes"], dtype=np.uint8)
if engine.register_memory(local.ctypes.data, local.nbytes) != 0:
    sys.exit("register_memory failed")
target, remote = args["target"], args["addr"]
results = []
shapes = [(s, o) for s in args["shapes"] for o in ("read", "write")]
for rnd, ((size, slices), op) in ((r, x) for r in range(args["rounds"]) for x in shapes):
    if slices == 1:
        fn = engine.transfer_sync_read if op == "read" else engine.transfer_sync_write
        call = lambda: fn(target, local.ctypes.data, remote, size)
    else:
        fn = engine.batch_transfer_sync_read if op == "read" else engine.batch_transfer_sync_write
        offsets = [i * size for i in range(slices)]
        locs, rems, lens = [local.ctypes.data + o for o in offsets], [remote + o for o in offsets], [size] * slices
        call = lambda: fn(target, locs, rems, lens)
    for _ in range(3):
        if call() != 0:
            sys.exit(f"{op} of {slices} x {size} bytes failed")
    durations, start = [], time.perf_counter()
    now = start
    while now < start + args["seconds"] or len(durations) < 5:
        t = now
        rc = call()
        now = time.perf_counter()
        if rc != 0:
            sys.exit(f"{op} of {slices} x {size} bytes failed ({rc})")
        durations.append(now - t)
    results.append(dict(op=op, size=size, slices=slices, ops=len(durations), seconds=now - start,
                        p50_us=statistics.median(durations) * 1e6, round=rnd))
print("TRANSFER_BENCH_MOONCAKE " + json.dumps(results), flush=True)
"""


def bench_mooncake(
    path: Path | None, python: str, shapes: list[tuple[int, int]], seg_bytes: int, seconds: float, rounds: int
) -> tuple[list[Cell], str | None]:
    """Run Mooncake's engine (owner and client, each its own process); return its cells or why it could not run.

    The wheel installs a top-level package called ``mooncake``, the name of this
    repository's own package, so it lives in a directory of its own (``path``, put on
    PYTHONPATH) and runs with a working directory outside the repository.
    """
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if path is not None:
        if not path.is_dir():
            return (
                [],
                f"no Mooncake install at {path} (pip install --target {path} "
                "mooncake-transfer-engine-non-cuda==0.3.13.post1)",
            )
        env["PYTHONPATH"] = str(path)
    env.setdefault("GLOG_minloglevel", "2")
    with tempfile.TemporaryDirectory(prefix="transfer-bench-mooncake-") as cwd:
        probe = subprocess.run(
            [python, "-c", "import mooncake.engine as m; m.TransferEngine; print(m.__file__)"],
            cwd=cwd,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        if probe.returncode != 0:
            return [], "mooncake.engine.TransferEngine does not import: " + (
                probe.stderr.strip().splitlines() or ["?"]
            )[-1]
        owner = subprocess.Popen(
            [python, "-c", MOONCAKE_OWNER, str(seg_bytes)],
            cwd=cwd,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            line = owner.stdout.readline()
            if (info := parse_ready(line)) is None:
                owner.kill()
                err = owner.communicate(timeout=10)[1]
                return [], f"Mooncake owner did not start: {line.strip()} {tail(err)}"
            args = {
                "target": f"127.0.0.1:{info['port']}",
                "addr": info["addr"],
                "seg_bytes": seg_bytes,
                "shapes": shapes,
                "seconds": seconds,
                "rounds": rounds,
            }
            timeout = 60 + 4 * rounds * len(shapes) * (seconds + 2)
            try:
                client = subprocess.run(
                    [python, "-c", MOONCAKE_CLIENT, json.dumps(args)],
                    cwd=cwd,
                    env=env,
                    capture_output=True,
                    text=True,
                    timeout=timeout,
                )
            except subprocess.TimeoutExpired:
                return [], f"Mooncake client did not finish within {timeout:.0f} s"
        finally:
            if owner.poll() is None:
                owner.stdin.close()
                try:
                    owner.wait(10)
                except subprocess.TimeoutExpired:
                    owner.kill()
                    owner.wait(5)
    lines = [ln for ln in client.stdout.splitlines() if ln.startswith(MOONCAKE_RESULT_PREFIX)]
    if client.returncode != 0 or not lines:
        return [], f"Mooncake client exited with status {client.returncode}: {tail(client.stderr)}"
    cells = [
        Cell(
            "mooncake-tcp",
            r["op"],
            r["size"],
            r["slices"],
            r["ops"],
            r["seconds"],
            r["p50_us"],
            {"protocol": "tcp", "round": r["round"]},
        )
        for r in json.loads(lines[-1][len(MOONCAKE_RESULT_PREFIX) :])
    ]
    return cells, None


def tail(text: str, lines: int = 5) -> str:
    return " | ".join(ln for ln in (text or "").strip().splitlines()[-lines:] if ln)
