"""The cache blocks of a prefill that did not answer (decode/run.py ``Decoding.free_blocks``): held for the write grace,
unless the prefill worker says first that the call writes nothing more (a storm of 100 hang-ups had calls fail to
connect, and their blocks held 3 s). Each released exactly once, whichever comes first.

The worker here is a stand-in holding what ``Decoding`` reads of a DecodeWorker: a prefill worker that answers an
Abort while the call itself failed cannot be caused on demand in a real cluster.
"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

from decode.run import Decoding


class Worker:
    def __init__(self, grace_s: float) -> None:
        self.config = SimpleNamespace(write_grace_s=grace_s)
        self._count_lock, self._in_prefill = threading.Lock(), 0
        self.released: list[list[int]] = []

    def release_blocks(self, blocks: list[int]) -> None:
        self.released.append(list(blocks))


def held(worker: Worker, confirm) -> Decoding:
    run = Decoding(worker, "r", [], [3, 4, 5])
    run.confirm = confirm
    run.free_blocks()
    return run


def wait_released(worker: Worker, timeout_s: float) -> float:
    start = time.monotonic()
    while not worker.released and time.monotonic() - start < timeout_s:
        time.sleep(0.01)
    return time.monotonic() - start


def test_blocks_go_back_as_soon_as_the_prefill_worker_says_its_writes_are_over():
    worker = Worker(grace_s=60)
    held(worker, lambda: True)
    assert wait_released(worker, 5) < 5
    assert worker.released == [[3, 4, 5]]


def test_without_that_word_they_wait_for_the_grace_and_go_back_once():
    worker = Worker(grace_s=0.5)
    start = time.monotonic()
    held(worker, lambda: False)
    assert wait_released(worker, 5) >= 0.45 and worker.released == [[3, 4, 5]]
    late = Worker(grace_s=0.1)  # the word comes after the grace: nothing is given back twice
    held(late, lambda: time.sleep(0.4) or True)
    time.sleep(0.8)
    assert late.released == [[3, 4, 5]] and time.monotonic() - start > 0.5
