"""The local launcher's process handling (``mooncake up``): what a component it starts runs with."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from mooncake.cluster.launcher import Component


def test_a_niced_component_is_niced_in_its_own_session_too(tmp_path):
    base = os.getpriority(os.PRIO_PROCESS, 0)
    if base > 12:
        pytest.skip(f"this test runs at nice {base} already")
    component = Component(
        "sleeper", [sys.executable, "-c", "import time; time.sleep(60)"], tmp_path / "sleeper.log", nice=7
    )
    component.start()
    try:
        pid = component.proc.pid
        assert os.getsid(pid) == pid  # a session of its own (Ctrl-C in the terminal reaches the launcher alone)
        deadline = time.monotonic() + 10
        while os.getpriority(os.PRIO_PROCESS, pid) != base + 7 and time.monotonic() < deadline:
            time.sleep(0.01)  # `nice` sets it, then execs the component
        assert os.getpriority(os.PRIO_PROCESS, pid) == base + 7
        autogroup = Path(f"/proc/{pid}/autogroup")
        if not autogroup.exists():
            pytest.skip("this kernel has no scheduler autogroups")
        # without this, the kernel shares the CPUs between sessions as equals and the process's nice orders nothing
        assert autogroup.read_text().split()[-2:] == ["nice", "7"]
    finally:
        component.kill()
