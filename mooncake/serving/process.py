"""What every component's ``main`` does the same way: print READY, wait for a signal, stop gracefully."""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import logging
import signal
import sys
import threading
import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass
from typing import Any

from mooncake import tls
from mooncake.cliargs import field_arg, to_argv
from transfer import add_transport_args

log = logging.getLogger(__name__)


# Each component: the module ``python -m`` runs, and the module whose ``main()`` and ``parser()`` it calls
COMPONENTS = {
    "conductor": ("conductor", "conductor.__main__"),
    "kvstore": ("kvstore", "kvstore.__main__"),
    "prefill": ("prefill", "prefill.server"),
    "prefill-stage": ("prefill.stage", "prefill.stage"),
    "decode": ("decode", "decode.server"),
    "gateway": ("mooncake.gateway", "mooncake.gateway.__main__"),
}


@functools.cache
def component_parser(name: str) -> argparse.ArgumentParser:
    """Component ``name``'s flags (imported on first use: the workers' modules import the engine)."""
    return importlib.import_module(COMPONENTS[name][1]).parser()


def component_argv(name: str, **values: Any) -> list[str]:
    """The command that starts component ``name`` with ``values`` as its flags (by dest: mooncake.cliargs.to_argv)."""
    return [sys.executable, "-m", COMPONENTS[name][0], *to_argv(component_parser(name), **values)]


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


def worker_parser(
    prog: str, description: str, default_id: str, engine_defaults: dict[str, Any]
) -> argparse.ArgumentParser:
    """The flags prefill and decode workers share (the engine's read off EngineConfig, over the worker's
    ``engine_defaults``); each adds its own."""
    from mooncake.engine.config import EngineConfig  # the engine (torch) only where a worker starts

    p = argparse.ArgumentParser(
        prog=prog, description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--id", default=default_id, help="instance id, unique in the cluster")
    p.add_argument("--model", required=True, help="model directory (mooncake model pull prints it)")
    p.add_argument("--conductor", help="the Conductor's gRPC address (register, heartbeat, report); none: standalone")
    p.add_argument("--host", default="127.0.0.1", help="address the gRPC service binds and advertises to the Conductor")
    p.add_argument("--port", type=int, default=0, help="gRPC port (0: any free port)")
    p.add_argument("--metrics-port", type=int, default=0, help="/metrics and /health port (0: any free port)")
    field_arg(p, EngineConfig, "dtype")
    add_engine_kind_args(p)
    field_arg(p, EngineConfig, "block_size", default=None)  # default_block_size(engine) once the engine is known
    field_arg(p, EngineConfig, "num_kv_blocks", default=engine_defaults["num_kv_blocks"])
    field_arg(p, EngineConfig, "max_num_seqs", default=engine_defaults["max_num_seqs"])
    field_arg(p, EngineConfig, "max_model_len")
    field_arg(p, EngineConfig, "num_threads", "--threads")
    field_arg(p, EngineConfig, "device")
    field_arg(p, EngineConfig, "enforce_eager")
    add_transport_args(p)
    p.add_argument("--log-level", default="INFO")
    return p


def add_engine_kind_args(
    p: argparse.ArgumentParser,
    engine_help: str = "native: our engine; vllm: stock vLLM (v1) hosted in this process, KV through our pool "
    "connector",
    vllm_scope: str = "--engine vllm",
) -> None:
    """``--engine`` and ``--vllm-arg``, as workers and the gateway take them."""
    p.add_argument("--engine", default="native", choices=["native", "vllm"], help=engine_help)
    p.add_argument(
        "--vllm-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help=f"a vLLM EngineArgs keyword for {vllm_scope}, repeatable; values parse as JSON when they can "
        "(tensor_parallel_size=1, gpu_memory_utilization=0.9, enforce_eager=true, kv_cache_dtype=auto)",
    )


def engine_fields(args: argparse.Namespace) -> dict[str, Any]:
    """The EngineConfig keywords :func:`worker_parser`'s flags gave, for a worker config's ``engine_config``."""
    return dict(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        block_size=args.block_size or default_block_size(args.engine),
        num_kv_blocks=args.num_kv_blocks,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        num_threads=args.threads,
        enforce_eager=args.enforce_eager,
    )


def default_block_size(engine: str) -> int:
    """The block size a component uses when none is given: 16 for ours, 32 for vLLM (its CPU attention needs a multiple
    of 32)."""
    return 32 if engine == "vllm" else 16


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


def run_worker(args: argparse.Namespace, worker, spec: WorkerProcess, registry) -> int:
    """Serve ``worker`` until SIGTERM: gRPC, Conductor registration and heartbeats, /metrics and /health, drain.

    ``worker`` has ``link``, ``draining`` and ``close()``. Returns the exit code.
    """
    import grpc

    from mooncake.serving.channels import SERVER_OPTIONS
    from mooncake.serving.conductor_link import ConductorLink
    from mooncake.serving.status_http import start_status_server

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
