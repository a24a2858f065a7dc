"""What every component's ``main`` does the same way: print READY, wait for a signal, stop gracefully."""

from __future__ import annotations

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
