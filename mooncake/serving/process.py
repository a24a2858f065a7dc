"""What every component's ``main`` does the same way: print READY, wait for a signal, stop gracefully."""

from __future__ import annotations

import argparse
import json
import signal
import threading


def print_ready(info: dict) -> None:
    """The line ``mooncake up`` (and tests) wait for: ``READY {json}`` on stdout."""
    print("READY " + json.dumps(info), flush=True)


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


def worker_parser(prog: str, description: str, default_id: str, num_kv_blocks: int) -> argparse.ArgumentParser:
    """The flags prefill and decode workers share; each adds its own."""
    p = argparse.ArgumentParser(prog=prog, description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--id", default=default_id, help="instance id, unique in the cluster")
    p.add_argument("--model", required=True, help="model directory (mooncake model pull prints it)")
    p.add_argument("--conductor", help="the Conductor's gRPC address (register, heartbeat, report); none: standalone")
    p.add_argument("--host", default="127.0.0.1", help="address the gRPC service binds and advertises to the Conductor")
    p.add_argument("--port", type=int, default=0, help="gRPC port (0: any free port)")
    p.add_argument("--metrics-port", type=int, default=0, help="/metrics and /health port (0: any free port)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block (the pool's and the Conductor's)")
    p.add_argument("--num-kv-blocks", type=int, default=num_kv_blocks, help="the engine's paged cache, in blocks")
    p.add_argument("--max-model-len", type=int, default=None, help="context limit (default: the model's)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--log-level", default="INFO")
    return p
