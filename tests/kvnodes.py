"""Real processes for the pool tests: redis-server and kvstore nodes on loopback."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """A throwaway redis-server on a free loopback port (no persistence)."""

    def __init__(self, workdir: Path) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError("redis-server is not installed: run `make redis` (apt-get install -y redis-server)")
        self.port = free_port()
        self.proc = subprocess.Popen(
            [exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(workdir)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        self.url = f"redis://127.0.0.1:{self.port}/0"
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                break
            except OSError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise RuntimeError("redis-server did not start") from None
                time.sleep(0.05)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


@dataclass
class Node:
    """A ``python -m kvstore`` process and what its READY line said."""

    proc: subprocess.Popen
    info: dict
    args: list[str]

    @property
    def grpc(self) -> str:
        return self.info["grpc"]

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, sig)
        if sig in (signal.SIGKILL, signal.SIGTERM):
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def start_node(node: str, block_bytes: int, dram_blocks: int, *extra: str, shm_dir: str | None = None) -> Node:
    """Start a kvstore node and wait for its READY line (raises with its stderr if it dies first)."""
    shm_dir = shm_dir or f"/dev/shm/mooncake-test-{uuid.uuid4().hex[:8]}"
    args = [sys.executable, "-m", "kvstore", "--node", node, "--block-bytes", str(block_bytes),
            "--dram-blocks", str(dram_blocks), "--shm-dir", shm_dir, "--log-level", "WARNING", *extra]  # fmt: skip
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    line = proc.stdout.readline()
    if not line.startswith("READY "):
        proc.kill()
        _, err = proc.communicate(timeout=10)
        raise RuntimeError(f"kvstore node {node} did not start: {line}{err}")
    return Node(proc, json.loads(line.split(" ", 1)[1]), args)
