"""Local helper processes: a free loopback port, a throwaway redis-server, the cores this process may use, CPU
priority for the processes it starts.

Used by the tests and benchmarks (real Redis, never a fake), and by anything that
starts a cluster on one machine.
"""

from __future__ import annotations

import os
import random
import shutil
import socket
import subprocess
import time
from pathlib import Path

_HANDED_OUT: set[int] = set()


def usable_cpus() -> list[int]:
    """The CPU ids this process may run on (every core, where affinity is unknown)."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now, below the kernel's ephemeral range, and not handed out before by
    this process (another process may still take it).

    A port picked to be bound later (``mooncake up`` picks its components' ports first) used
    to come from the ephemeral range, where any socket bound to port 0 meanwhile (a metrics
    server, a transfer server, a client) could get it: CI saw a decode worker's Prefill
    calls answered UNIMPLEMENTED by whatever shared the prefill worker's port. Below the
    range, only another explicit pick can collide, and this process never picks one twice.
    """
    low = _ephemeral_low()
    for _ in range(500):
        port = random.randrange(max(1024, low // 2), low)
        if port in _HANDED_OUT:
            continue
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port
    with socket.socket() as s:  # the range below is all taken: any free port
        s.bind((host, 0))
        return s.getsockname()[1]


def _ephemeral_low() -> int:
    """The lowest port the kernel hands to a socket bound to port 0 (Linux's default: 32768)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


class RedisServer:
    """A redis-server child on a free loopback port, without persistence; :meth:`stop` ends it."""

    def __init__(self, workdir: str | Path, start_timeout_s: float = 10.0) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError("redis-server is not installed: run `make redis` (apt-get install -y redis-server)")
        self.port = free_port()
        self.proc = subprocess.Popen(
            [
                exe,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(workdir),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self.url = f"redis://127.0.0.1:{self.port}/0"
        deadline = time.monotonic() + start_timeout_s
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                break
            except OSError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    self.stop()
                    raise RuntimeError("redis-server did not start") from None
                time.sleep(0.05)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def may_raise_priority() -> bool:
    """Whether this process may start others above normal CPU priority (a negative nice): root, or CAP_SYS_NICE."""
    if os.geteuid() == 0:
        return True
    try:
        status = Path("/proc/self/status").read_text()
    except OSError:
        return False
    effective = next((line.split()[1] for line in status.splitlines() if line.startswith("CapEff:")), "0")
    return bool(int(effective, 16) & (1 << 23))  # CAP_SYS_NICE


def nice_session(pid: int, nice: int) -> bool:
    """Give the session ``pid`` leads the CPU priority ``nice``; False where the kernel has no autogroups.

    With autogroups (Linux's default on desktops and most VMs: kernel.sched_autogroup_enabled)
    the scheduler shares the CPUs fairly between sessions first, and a process's own nice
    orders it only against the other processes of its session. A component alone in its
    session would compete with the Conductor and the gateway as an equal, whatever its nice:
    measured with ``benchmarks/overload_bench.py``, the gateway's event loop then sat
    runnable but off the CPU for 20 to 95 ms at a time while both workers computed, and
    that was the whole tail of the 429 latency.
    """
    try:
        Path(f"/proc/{pid}/autogroup").write_text(str(nice))
    except OSError:
        return False
    return True
