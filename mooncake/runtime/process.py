"""What every component's ``main`` does the same way: print READY, wait for a signal, serve a worker's gRPC, register
with the Conductor and heartbeat, stop gracefully."""

from __future__ import annotations

import argparse
import atexit
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass
from typing import NoReturn

from mooncake import tls
from transfer.types import host_id, pid_alive

log = logging.getLogger(__name__)


READY = "READY "  # a component's first line on stdout once it serves: READY and a JSON object (its addresses, ...)


def print_ready(info: dict) -> None:
    """The line ``mooncake up`` (and tests) wait for: ``READY {json}`` on stdout."""
    print(READY + json.dumps(info), flush=True)


def parse_ready(line: str | bytes) -> dict | None:
    """What a READY line (``print_ready``) says; None for any other line."""
    if isinstance(line, bytes):
        line = line.decode(errors="replace")
    if not line.startswith(READY):
        return None
    return json.loads(line[len(READY) :])


def exit_process(code: int) -> NoReturn:
    """End a component's process with ``code`` once its ``main`` has stopped and closed everything: the atexit
    handlers run (thread pools join, finalizers, logging's flush) and stdio is flushed, and the interpreter's own
    teardown, which frees every module and object one by one, is skipped: a second or two of each worker's stop
    on a CPU (torch's modules), with nothing left to lose by then. As at a normal exit, threads that are not
    daemons are waited for first."""
    threading._shutdown()  # what the interpreter's exit does first: thread pools told to end, non-daemons joined
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing to say there
            pass
    os._exit(code)


def wait_for_signal() -> str:
    """Block until SIGTERM or SIGINT; return the signal's name."""
    done = threading.Event()
    got: list[str] = []

    def handler(signum, _frame) -> None:
        got.append(signal.Signals(signum).name)
        done.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, handler)
    done.wait()
    return got[0] if got else "SIGTERM"


@dataclass
class WorkerProcess:
    """What differs between the prefill and the decode worker's process; ``run_worker`` does the rest."""

    name: str  # "prefill" or "decode": log prefix and thread names
    add_servicer: Callable[[object], None]  # adds the gRPC servicer to the server
    registration: object  # the conductor_pb2.RegisterRequest, address left empty (filled once bound)
    load: Callable[[], object]  # a conductor_pb2.Load for each heartbeat
    ready: dict  # extra READY fields
    health: Callable[[], tuple[bool, dict]]
    busy: Callable[[], int]  # requests still in the worker (drained on SIGTERM)
    drain_timeout_s: float
    max_rpc_threads: int = 32
    register_wait_s: float = 10.0  # how long to wait for the Conductor's answer before printing READY
    on_heartbeat: Callable[[object], None] | None = None  # the Conductor's answer to each heartbeat (ConductorLink)
    busy_beat_s: float | None = None  # while ``busy``, heartbeat at least this often (ConductorLink's busy_interval_s)


def when_gone(context, fn: Callable[[], object]) -> None:
    """Call ``fn`` once the caller of this RPC is gone (cancelled, timed out, disconnected): at once if it already is
    (``add_callback`` then returns False and never calls it: a caller that left between the handler's start and this
    call would go unnoticed, and its work run whole for nobody)."""
    if not context.add_callback(fn):
        fn()


def run_worker(args: argparse.Namespace, worker, spec: WorkerProcess, registry) -> int:
    """Serve ``worker`` until SIGTERM: gRPC, Conductor registration and heartbeats, /metrics and /health, drain.

    ``worker`` has ``link``, ``draining`` and ``close()``. Returns the exit code.
    """
    import grpc

    from mooncake.runtime.channels import SERVER_OPTIONS
    from mooncake.runtime.conductor_link import ConductorLink
    from mooncake.runtime.status_http import start_status_server

    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=spec.max_rpc_threads, thread_name_prefix=f"{spec.name}-rpc"),
        options=SERVER_OPTIONS,
    )
    spec.add_servicer(server)
    port = tls.grpc_add_port(server, f"{args.host}:{args.port}")
    if port == 0:
        print(f"error: cannot bind {args.host}:{args.port}", file=sys.stderr)
        worker.close()
        return 2
    server.start()
    address = f"{args.host}:{port}"
    link = None
    if args.conductor:
        spec.registration.address = address
        link = ConductorLink(
            args.conductor,
            spec.registration,
            spec.load,
            on_heartbeat=spec.on_heartbeat,
            busy=spec.busy,
            busy_interval_s=spec.busy_beat_s,
        )
        worker.link = link
        link.start()
        link.settled.wait(spec.register_wait_s)  # a Conductor that is away: serve anyway, the link keeps trying
        if link.refused is not None:
            print(f"error: the Conductor refused this worker: {link.refused}", file=sys.stderr)
            server.stop(grace=0)
            worker.close()
            return 2
    status = start_status_server(args.host, args.metrics_port, registry, spec.health)
    print_ready({"id": args.id, "grpc": address, "metrics": f"{args.host}:{status.server_port}", **spec.ready})
    wait_for_signal()
    log.info("stopping: draining %d requests", spec.busy())
    worker.draining = True
    if link is not None:
        link.close()  # deregister first: nothing new is sent here
    deadline = time.monotonic() + spec.drain_timeout_s
    while spec.busy() and time.monotonic() < deadline:
        time.sleep(0.05)
    server.stop(grace=1).wait()
    status.shutdown()
    worker.close()
    return 0


WRITER_METADATA = "mooncake-writer"  # a Prefill call's first metadata: the process that writes (process_identity)


def _start_time(pid: int) -> str:
    """When process ``pid`` started (clock ticks since boot, /proc/PID/stat field 22), or "" when unreadable."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return ""


def process_identity() -> str:
    """This process, as another process can check it is gone: ``host/pid/start``. A pid is reused; with the start time
    and the host (hostname and boot id) it names one process for ever."""
    return f"{host_id()}/{os.getpid()}/{_start_time(os.getpid())}"


def process_gone(identity: str) -> bool:
    """Is the process ``identity`` (``process_identity``) proven gone? Only on its own host; False elsewhere (there
    is no telling), and for an identity that does not parse."""
    parts = identity.rsplit("/", 2)
    if len(parts) != 3 or not parts[1].isdigit() or parts[0] != host_id():
        return False
    pid, start = int(parts[1]), parts[2]
    return not pid_alive(pid) or _start_time(pid) != start
