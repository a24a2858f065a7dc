"""Real processes for the tests: redis-server, kvstore nodes and the Conductor on loopback."""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path

from mooncake.localproc import RedisServer, free_port  # noqa: F401  (the tests' fixtures use both)
from mooncake.runtime.process import parse_ready

REPO = Path(__file__).resolve().parent.parent


@dataclass
class Node:
    """A service process (``python -m kvstore`` or ``conductor``) and what its READY line said."""

    proc: subprocess.Popen
    info: dict
    args: list[str]
    log: Path | None = None

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
    args = [
        sys.executable,
        "-m",
        "kvstore",
        "--node",
        node,
        "--block-bytes",
        str(block_bytes),
        "--dram-blocks",
        str(dram_blocks),
        "--shm-dir",
        shm_dir,
        "--log-level",
        "WARNING",
        *extra,
    ]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    line = proc.stdout.readline()
    if (info := parse_ready(line)) is None:
        proc.kill()
        _, err = proc.communicate(timeout=10)
        raise RuntimeError(f"kvstore node {node} did not start: {line}{err}")
    return Node(proc, info, args)


def start_conductor(*extra: str) -> Node:
    """Start ``python -m conductor`` and wait for its READY line; its log goes to a temporary file (``node.log``)."""
    import tempfile

    log = tempfile.NamedTemporaryFile(prefix="conductor-", suffix=".log", delete=False)
    # the TBT SLO these tests were written against (the default was 0.1 s before it became DEFAULT_SLO's)
    args = [sys.executable, "-m", "conductor", "--log-level", "INFO", "--tbt-slo", "0.1", *extra]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=log, text=True, cwd=REPO)
    line = proc.stdout.readline()
    if (info := parse_ready(line)) is None:
        proc.kill()
        proc.wait(10)
        raise RuntimeError(f"the conductor did not start: {line}{Path(log.name).read_text()[-4000:]}")
    return Node(proc, info, args, Path(log.name))


def wait_for(condition, timeout_s: float = 5.0) -> None:
    """Poll ``condition`` until it holds; fail the test if it does not within ``timeout_s``."""
    import time

    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


@functools.cache
def rdma_unavailable() -> str | None:
    """Why this machine cannot run the rdma backend (no pyverbs, no device, no active port), or None when it can."""
    from transfer.rdma import RdmaUnavailable, probe

    try:
        probe()
    except RdmaUnavailable as e:
        return str(e)
    return None
