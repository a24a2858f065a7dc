"""One request on a decode worker: its state (``DecodeState``), what it holds in each (``Decoding``: landing slots or
cache blocks while its prefill runs, a place in the engine's batch while it decodes; ``close`` frees whichever, in one
place, and tells the Conductor it finished), the first token its prefill answered, and the status a stream ends with.
"""

from __future__ import annotations

import enum
import functools
import logging
import queue
import threading
from dataclasses import dataclass
from typing import Any

import grpc
import torch

from mooncake.engine.request import SamplingParams

log = logging.getLogger(__name__)


class Failed(Exception):
    """A status to end the stream with: ``code``, a message, and the instance that failed when it was not this one
    (the prefill worker: the gateway's retry reports it to the Conductor)."""

    def __init__(self, code: grpc.StatusCode, message: str, failed_instance: str = "") -> None:
        super().__init__(message)
        self.code = code
        self.failed_instance = failed_instance


class DecodeState(enum.Enum):
    """Where one request stands on this worker; ``Decoding.close`` frees what each state holds."""

    PREFILLING = "prefilling"  # holds landing slots; the prefill worker writes them
    DECODING = "decoding"  # in the engine's batch (the slots were copied into its cache and freed)
    DONE = "done"  # finished (the engine dropped it, or it never joined)


class _Once:
    """``fn`` called at most once, from whichever thread comes first."""

    def __init__(self, fn) -> None:
        self._fn, self._lock = fn, threading.Lock()

    def __call__(self) -> None:
        with self._lock:
            fn, self._fn = self._fn, None
        if fn is not None:
            fn()


class Decoding:
    """One request's resources on this worker, by state: who frees what, in one place.

    While PREFILLING it holds either landing slots (``slots``) or blocks of the engine's own cache (``blocks``,
    written in place by the prefill). Blocks of a prefill that did not answer (cancelled, timed out, its worker
    unreachable) may still see a straggling write: they go back to the engine only ``write_grace_s`` later."""

    def __init__(self, worker, request_id: str, slots: list[int], blocks: list[int]) -> None:
        self.worker, self.request_id, self.slots, self.blocks = worker, request_id, slots, blocks
        self.state = DecodeState.PREFILLING
        self.answered = False  # the prefill worker answered (its writes are over, whatever the answer)
        self.confirm = None  # unanswered: asks the prefill worker whether its writes are over (True: yes, now)
        self.ttft_s = 0.0  # from the request's arrival here to its first token (0: it never got one)
        self.handoff_s = 0.0  # of it, all but the prefill worker's own queue and prefill (0: not measured, or reported)
        self.parts = (0.0, 0.0)  # and those two: the prefill worker's own queue and prefill (the Conductor's errors)
        self.written = None  # its write-behind (decode.writeback.Written), once it has one
        self.output_tokens = 0  # generated so far (the Conductor's planner learns output lengths from the last count)
        self._left = False  # counted out of the worker's requests in prefill
        with worker._count_lock:
            worker._in_prefill += 1

    def join(
        self,
        sink: queue.Queue,
        prompt: list[int],
        params: SamplingParams,
        outputs: list[int],
        num_landed: int,
        cache_salt: str | None,
    ) -> None:
        """PREFILLING -> DECODING: add the request to the batch, its prompt's KV already in its blocks (or copied out of
        the landing slots, which are freed)."""
        w = self.worker
        kv: dict[str, Any] = (
            {"kv_block_ids": self.blocks}
            if self.blocks
            else {"external_kv": w.landing.index_select(0, torch.tensor(self.slots, dtype=torch.long))}
        )  # [n, L, 2, bs, Hkv, D]
        self._free_slots()
        future = w.loop.submit_nowait(
            sink.put,
            prompt_token_ids=prompt,
            sampling_params=params,
            request_id=self.request_id,
            num_external_tokens=num_landed,
            initial_output_token_ids=outputs,
            cache_salt=cache_salt,
            **kv,
        )
        try:
            future.result()
        except ValueError:
            self.state = DecodeState.DONE  # the engine did not take the blocks: close() returns them
            raise
        self.blocks = []  # the request's now: the engine frees them with it
        self._leave_prefill()
        self.state = DecodeState.DECODING

    def _leave_prefill(self) -> None:
        if not self._left:
            self._left = True
            with self.worker._count_lock:
                self.worker._in_prefill -= 1

    def _free_slots(self) -> None:
        if self.slots:
            self.worker.slots.free(self.slots)
        self.slots = []

    def free_blocks(self, now: bool = False) -> None:
        """Give the cache blocks back: at once when the prefill answered (or ``now``: it answered without writing
        them), else ``write_grace_s`` later, or as soon as ``confirm`` (off this thread) has the prefill worker say its
        writes are over: a call that failed to connect (a storm of 100 hang-ups saw that) wrote nothing."""
        blocks, self.blocks = self.blocks, []
        if not blocks:
            return
        release = _Once(functools.partial(self.worker.release_blocks, blocks))
        if now or self.answered:
            release()
            return
        grace = self.worker.config.write_grace_s
        log.info(
            "%d cache blocks of %s go back within %.1f s: its prefill has not answered",
            len(blocks),
            self.request_id,
            grace,
        )
        timer = threading.Timer(grace, release)
        timer.daemon = True
        timer.start()
        if self.confirm is not None:
            confirm = self.confirm
            threading.Thread(target=lambda: confirm() and release(), name="confirm-writes", daemon=True).start()

    def close(self) -> None:
        """However the request ended (finished, failed, the client gone): release what its state holds."""
        self._free_slots()
        self.free_blocks()
        self._leave_prefill()
        if self.state is DecodeState.DECODING:
            self.worker.loop.abort(self.request_id)  # a no-op once it finished
        if self.worker.link is not None:
            self.worker.link.finished(
                self.request_id, self.ttft_s, self.handoff_s, *self.parts, output_tokens=self.output_tokens
            )  # out of the Conductor's decode forecast
        self.state = DecodeState.DONE


@dataclass(slots=True)
class FirstToken:
    token: int
    cached_tokens: int
    by_tier: dict[str, int]
    logprobs: list  # [wpb.TokenLogprob] of the token, when the sampling asked
    prompt_logprobs: list  # [wpb.TokenLogprob] of prompt tokens 1.., when the sampling asked
    queue_s: float = 0.0  # the prefill worker's own queue
    prefill_s: float = 0.0  # and its own prefill

    @property
    def worker_s(self) -> float:
        return self.queue_s + self.prefill_s
