"""The write fence (decode/fence.py): a block a prefill may still write is never handed to another request.

The engine asks the fence before it frees a finished or aborted request's blocks; the fence holds them while that
request's prefill may still write, and lets them go on proof only: the writer says its writes are over (its Abort
answers ``stopped``, from the process that writes), or that process is gone. ``ask`` here stands in for the Abort
call (a prefill worker that answers one way or the other on demand cannot be had from a real one); the dead writer is
a real process that exits. The whole path, with a real prefill worker stalled inside a step, is
tests/test_write_fence_cluster.py.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time

from decode.fence import Fence
from mooncake.runtime.process import process_identity

GRACE_S = 0.05


class Asked:
    """The Abort call's answers, set by the test: (stopped, the answering process)."""

    def __init__(self, stopped: bool = False, by: str = "") -> None:
        self.stopped, self.by, self.calls = stopped, by, 0

    def __call__(self, writer) -> tuple[bool, str]:
        self.calls += 1
        return self.stopped, self.by


def fence_with(asked: Asked) -> tuple[Fence, threading.Event]:
    woken = threading.Event()
    return Fence(GRACE_S, asked, woken.set), woken


def wait_for(condition, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_the_blocks_of_a_prefill_that_answered_are_freed_by_the_engine_at_once():
    fence, _ = fence_with(Asked())
    writer = fence.open("r", "127.0.0.1:1", "t")
    assert fence.request_finished("r", [1, 2])  # still writing: held
    fence.answered(writer)
    assert sorted(fence.released_blocks()) == [1, 2] and fence.quarantined_blocks == 0
    fence.open("s", "127.0.0.1:1", "u")
    fence.answered(fence._writers["s"][0])
    assert not fence.request_finished("s", [3])  # answered before the request ended: the engine frees them
    assert not fence.request_finished("no-writer", [4])  # a prompt computed here: none ever writes it


def test_a_silent_writer_keeps_its_blocks_however_long_it_stays_silent_and_the_word_releases_them_once():
    asked = Asked(stopped=False)
    fence, woken = fence_with(asked)
    writer = fence.open("r", "127.0.0.1:1", "t")
    assert fence.request_finished("r", [5, 6, 7])
    fence.give_up(writer, identity="")
    assert wait_for(lambda: asked.calls >= 20)  # twenty graces and more
    assert fence.released_blocks() == [] and fence.quarantined_blocks == 3
    asked.stopped = True
    assert wait_for(woken.is_set)
    assert sorted(fence.released_blocks()) == [5, 6, 7] and fence.quarantined_blocks == 0
    time.sleep(5 * GRACE_S)
    assert fence.released_blocks() == []  # once
    fence.close()


def test_a_stop_said_by_another_process_at_that_address_is_no_proof():
    """A restarted worker at the same address (gRPC servers share a port) knows nothing of the old one's call."""
    me = process_identity()
    asked = Asked(stopped=True, by=me.rsplit("/", 1)[0] + "/other-start")
    fence, woken = fence_with(asked)
    writer = fence.open("r", "127.0.0.1:1", "t")
    fence.request_finished("r", [1])
    fence.give_up(writer, identity=me)  # this process is the writer, alive
    assert wait_for(lambda: asked.calls >= 5)
    assert fence.quarantined_blocks == 1 and not woken.is_set()
    asked.by = me
    assert wait_for(woken.is_set) and fence.released_blocks() == [1]
    fence.close()


def test_a_writer_whose_process_is_gone_writes_nothing_more():
    child = subprocess.run(
        [sys.executable, "-c", "from mooncake.runtime.process import process_identity; print(process_identity())"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    dead = child.stdout.strip()
    asked = Asked(stopped=False)  # and its address answers nothing
    fence, woken = fence_with(asked)
    writer = fence.open("r", "127.0.0.1:1", "t")
    fence.request_finished("r", [8, 9])
    fence.give_up(writer, identity=dead)
    assert wait_for(woken.is_set) and sorted(fence.released_blocks()) == [8, 9]
    assert asked.calls == 0  # its death was proof enough


def test_landing_slots_wait_for_the_writer_too_and_go_back_once():
    asked = Asked(stopped=False)
    fence, _ = fence_with(asked)
    freed = []
    fence.after_writes("nobody-writes", lambda: freed.append("now"))
    assert freed == ["now"]
    writer = fence.open("r", "127.0.0.1:1", "t")
    fence.after_writes("r", lambda: freed.append("slots"))
    fence.give_up(writer, identity="")
    assert wait_for(lambda: asked.calls >= 3) and freed == ["now"]
    asked.stopped = True
    assert wait_for(lambda: freed == ["now", "slots"])
    time.sleep(5 * GRACE_S)
    assert freed == ["now", "slots"]
    fence.close()


def test_a_request_id_sent_again_keeps_the_last_attempts_blocks_with_that_attempts_writer():
    asked = Asked(stopped=False)
    fence, _ = fence_with(asked)
    first = fence.open("r", "127.0.0.1:1", "t1")
    fence.request_finished("r", [1, 2])
    fence.give_up(first, identity="")
    second = fence.open("r", "127.0.0.1:2", "t2")  # the gateway's retry, here again
    fence.answered(second)
    assert fence.released_blocks() == []  # the first attempt's writer is still silent
    assert fence.quarantined_blocks == 2
    fence.close()
