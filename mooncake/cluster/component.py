"""One process of the cluster as the launcher runs it (``Component``): started with its log and CPU priority, waited
on for its READY line, stopped; a component that refuses its configuration at start (exit 2) raises
``ComponentRefused`` with its one-line reason."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import threading
from dataclasses import dataclass, field
from pathlib import Path

from mooncake.localproc import may_raise_priority, nice_session
from mooncake.runtime.process import parse_ready

REFUSED_EXIT = 2  # a component's exit status for a configuration it refuses (it printed "error: ..." and why)


class ComponentRefused(RuntimeError):
    """A component refused its configuration at start (exit status 2): the message is its one-line reason."""


@dataclass(eq=False)
class Component:
    """One process of the cluster."""

    name: str
    argv: list[str]
    log_path: Path
    proc: subprocess.Popen | None = None
    info: dict = field(default_factory=dict)  # its READY line
    restarts: int = 0
    stopping: bool = False
    env: dict[str, str] | None = None  # added to this process's environment
    nice: int = 0  # its CPU priority (os.nice; below 0, above normal: only where allowed), and its threads'

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log_file = open(self.log_path, "ab")
        env = {**os.environ, **self.env} if self.env else None
        # `nice` execs the command (the pid stays the component's);
        # a preexec_fn would fork this threaded process instead
        if self.nice < 0 and not may_raise_priority():
            self.nice = 0  # a normal user cannot raise a priority: it runs as the others do
        argv = ["nice", "-n", str(self.nice), *self.argv] if self.nice and shutil.which("nice") else self.argv
        self.proc = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=log_file, stdin=subprocess.DEVNULL, start_new_session=True, env=env
        )
        log_file.close()
        if self.nice:
            nice_session(self.proc.pid, self.nice)

    def wait_ready(self, timeout_s: float) -> dict:
        """Read stdout until the READY line; raise RuntimeError (with the log's tail) if it dies or takes too long."""
        result: list[str] = []

        def read() -> None:
            for raw in self.proc.stdout:
                if (info := parse_ready(raw)) is not None:
                    result.append(info)
                    return

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        reader.join(timeout_s)
        if not result:
            code = self.proc.poll()
            if code is None and not reader.is_alive():  # its stdout ended: it is exiting, its status a moment away
                with contextlib.suppress(subprocess.TimeoutExpired):
                    code = self.proc.wait(5)
            why = "exited" if code is not None else f"was not ready after {timeout_s:.0f} s"
            self.kill()
            if code == REFUSED_EXIT and (line := last_error(self.log_path)) is not None:
                raise ComponentRefused(f"{self.name}: {line}")
            raise RuntimeError(f"{self.name} {why}; the end of {self.log_path}:\n{tail(self.log_path)}")
        self.info = result[0]
        threading.Thread(target=self._drain_stdout, daemon=True).start()
        return self.info

    def _drain_stdout(self) -> None:
        for _ in self.proc.stdout:
            pass

    def terminate(self) -> None:
        self.stopping = True
        if self.alive:
            self.proc.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        if self.alive:
            self.proc.kill()
        if self.proc is not None:
            self.proc.wait(10)


def tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def last_error(path: Path) -> str | None:
    """The last ``error: ...`` line of a component's log (its refusal), without the prefix; None if there is none."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return None
    return next((ln[len("error: ") :] for ln in reversed(lines) if ln.startswith("error: ")), None)
