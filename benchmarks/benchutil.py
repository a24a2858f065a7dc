"""Helpers the benchmarks share: sizes, timing loops, percentiles, the machine's description, a cleanup Ctrl-C cannot
cut short."""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Literal

import numpy as np
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

REPO = Path(__file__).resolve().parent.parent  # the checkout


def make_progress(console: Console, disable: bool = False) -> Progress:
    """The benchmarks' progress display: a spinner, the task, a bar, done of total, time so far; gone when it ends."""
    return Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=True,
        disable=disable,
    )


def resolve_model(args, workdir: Path) -> tuple[Path, str]:
    """A benchmark's model: (its directory, its name). ``--quick`` without ``--model``: a tiny random llama made in
    ``workdir``; otherwise ``--model`` (a directory, or a registry name, pulled into the cache if missing;
    default smollm2-135m)."""
    if args.model is None and args.quick:
        from mooncake.engine.tiny import make_tiny

        return make_tiny(workdir / "tiny-llama", "llama"), "tiny-llama (random weights)"
    name = args.model or "smollm2-135m"
    if Path(name).is_dir():
        return Path(name).absolute(), name
    from mooncake.engine import registry

    return registry.pull(name, cache_dir=registry.default_cache_dir(), progress=False), name


def parse_size(text: str) -> int:
    """``64KiB``, ``1MiB``, ``2M``, ``4096`` -> bytes."""
    m = re.fullmatch(r"\s*(\d+)\s*([KMG]?)(i?B)?\s*", text, flags=re.IGNORECASE)
    if m is None:
        raise argparse.ArgumentTypeError(f"bad size {text!r}; use e.g. 64KiB, 1MiB, 16MiB")
    return int(m.group(1)) << {"": 0, "K": 10, "M": 20, "G": 30}[m.group(2).upper()]


def size_list(text: str) -> list[int]:
    return [parse_size(s) for s in text.split(",") if s.strip()]


def human(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} B"


def timed_loop(op, seconds: float, min_ops: int = 5) -> tuple[list[float], float]:
    """Call ``op()`` back to back for ``seconds`` (at least ``min_ops`` times); return each call's time and the
    total."""
    durations = []
    start = now = time.perf_counter()
    while now < start + seconds or len(durations) < min_ops:
        t = now
        op()
        now = time.perf_counter()
        durations.append(now - t)
    return durations, now - start


def p50_us(durations: list[float]) -> float:
    return statistics.median(durations) * 1e6 if durations else 0.0


def percentile(
    values: Sequence[float] | np.ndarray,
    q: float,
    method: Literal["linear", "rank"] = "linear",
    empty: float | None = None,
) -> float | None:
    """The ``q``-th percentile (0 to 100) of ``values``, or ``empty`` when there are none; called once a figure.

    ``method``: ``"linear"``, numpy's default, interpolates between the two closest ranks (replay.py, the simulator,
    chaos.py); ``"rank"`` takes the sorted values' element at index ``floor(q / 100 * n)``, no interpolation
    (overload_bench.py, conductor_bench.py). The two give different numbers on the same values, so each benchmark
    keeps the one its recorded results were computed with.
    """
    if not len(values):
        return empty
    if method == "linear":
        return float(np.percentile(values, q))
    if method == "rank":
        ordered = sorted(values)
        return float(ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))])
    raise ValueError(f"unknown percentile method {method!r}; use linear or rank")


def describe_machine(**versions: str) -> dict[str, object]:
    """CPU model, cores, Python, platform and load average, plus the given package versions."""
    cpu = platform.processor() or "unknown"
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        cpu = next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")), cpu)
    except OSError:
        pass
    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {
        "cpu_model": cpu,
        "logical_cores": os.cpu_count(),
        "python": platform.python_version(),
        **versions,
        "platform": platform.platform(),
        "load_average": os.getloadavg(),
        "gpu": gpu,
        "torch": torch.__version__,
    }


@contextlib.contextmanager
def shielded():
    """Run a cleanup to its end: Ctrl-C or SIGTERM during it is held, then raised as KeyboardInterrupt (main thread
    only)."""
    held: list[int] = []
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    for sig in previous:
        signal.signal(sig, lambda signum, frame: held.append(signum))
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if held:
            raise KeyboardInterrupt


@contextlib.contextmanager
def scratch_dir(prefix: str, keep: bool, console, what: str = "logs") -> Iterator[Path]:
    """A temporary directory for one run: removed at its end however it ends, or with ``keep`` kept and named."""
    workdir = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        yield workdir
    finally:
        with shielded():
            if keep:
                console.print(f"{what} kept in {workdir}")
            else:
                shutil.rmtree(workdir, ignore_errors=True)


def run_interruptible(run, console) -> object | None:
    """``run()`` with SIGTERM handled as Ctrl-C is, so the ``finally`` blocks stop every process it started.

    Returns run's result, or None when interrupted (after saying so on ``console``).
    """

    def on_sigterm(signum, frame):  # noqa: ARG001
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_sigterm)
    try:
        return run()
    except KeyboardInterrupt:
        console.print("[red]interrupted[/]: every process this benchmark started has been stopped")
        return None


def git_state() -> str:
    """The commit checked out, with " + changes" when tracked files differ from it ("unknown" outside a git
    checkout)."""
    try:
        head = subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        )
        dirty = subprocess.run(
            ["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            check=True,
        )
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head.stdout.strip() + (" + changes" if dirty.stdout.strip() else "")


def code_mtimes() -> dict[str, float]:
    """Modification times of the code the cluster's processes import (a restarted component imports it again)."""
    out = {}
    for top in ("mooncake", "conductor", "decode", "prefill", "kvstore", "transfer", "protos"):
        for f in (REPO / top).rglob("*.py"):
            out[str(f.relative_to(REPO))] = f.stat().st_mtime
    return out


def log_console(level: str) -> Console:
    """A console for a benchmark's tables (170 columns when not a terminal) that also shows its log records."""
    import logging

    from rich.logging import RichHandler

    console = Console(width=None if sys.stdout.isatty() else 170, log_path=False)
    logging.basicConfig(
        level=level.upper(), format="%(name)s: %(message)s", handlers=[RichHandler(console=console, show_path=False)]
    )
    return console
