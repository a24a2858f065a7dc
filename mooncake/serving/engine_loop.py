"""EngineLoop: one engine (native or vLLM) on its own thread, fed and drained from any thread or event loop.

    loop = EngineLoop(engine)                       # starts the thread
    rid = await loop.submit(sink, prompt_token_ids=ids, sampling_params=sp, request_id="r1")
    ...sink(output) is called on the engine thread for every RequestOutput of r1...
    loop.abort("r1")                                # from anywhere; the sink hears nothing more
    loop.close()

The engine is synchronous and not thread-safe, so only the loop thread touches it:
``submit`` and ``abort`` queue commands that the thread runs between steps (``submit``'s
future carries add_request's ValueError back to the caller). Every step's wall time is
kept with its batch size and context tokens: decode workers report them to the
Conductor, which fits its TBT predictor on them.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

from mooncake.engine.engine import RequestOutput
from mooncake.engine.interface import WorkerEngine

log = logging.getLogger(__name__)

Sink = Callable[[RequestOutput | BaseException], None]


@dataclass(frozen=True, slots=True)
class StepSample:
    """One engine step: how many requests ran, over how much context, and how long it took."""

    batch: int
    context_tokens: int
    seconds: float
    new_tokens: int  # tokens computed (prompt chunks count every token)


class EngineLoop:
    """Owns ``engine`` and the thread that steps it. See the module docstring."""

    def __init__(self, engine: WorkerEngine, name: str = "engine", history: int = 256) -> None:
        self.engine = engine
        self._commands: deque[Callable[[], None]] = deque()
        self._sinks: dict[str, Sink] = {}
        self._wake = threading.Event()
        self._closed = False
        self.steps: deque[StepSample] = deque(maxlen=history)
        self.num_running = 0  # requests in the engine (running or waiting), as of the last step
        self.context_tokens = 0  # their tokens so far
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # -- from any thread ---------------------------------------------------------------

    def submit_nowait(self, sink: Sink, then: Callable | None = None, **add_request_kwargs) -> Future:
        """Queue ``engine.add_request(**kwargs)``; the future holds the request id (or ``then(engine, id)``, run right
        after on the loop thread) or add_request's error."""
        done: Future = Future()

        def add() -> None:
            if not done.set_running_or_notify_cancel():
                return  # the caller gave up (its client went away) before the request reached the engine
            try:
                rid = self.engine.add_request(**add_request_kwargs)
            except Exception as e:  # noqa: BLE001 - handed to the caller
                done.set_exception(e)
                return
            self._sinks[rid] = sink
            done.set_result(then(self.engine, rid) if then is not None else rid)

        self._queue(add, done)
        return done

    async def submit(self, sink: Sink, **add_request_kwargs) -> str:
        return await asyncio.wrap_future(self.submit_nowait(sink, **add_request_kwargs))

    def abort(self, request_id: str) -> None:
        """Abort ``request_id`` if it is still in the engine; its sink hears nothing more."""

        def abort() -> None:
            self._sinks.pop(request_id, None)
            self.engine.abort_request(request_id)

        self._queue(abort)

    def land(self, request_id: str, token: int, kv=None) -> Future:
        """``engine.land``: a request's KV landed (in its blocks, or ``kv``) with its prefill's token; the token's
        output goes to the request's sink as every output does. The future holds whether the request was still there
        (not aborted)."""

        def land(engine: WorkerEngine) -> bool:
            out = engine.land(request_id, token, kv)
            if out is not None:
                self._deliver([out])
            return out is not None

        return self.call(land)

    def call(self, fn: Callable[[WorkerEngine], object]) -> Future:
        """Run ``fn(engine)`` on the loop thread between steps (for reads such as export_kv)."""
        done: Future = Future()

        def run() -> None:
            if not done.set_running_or_notify_cancel():
                return
            try:
                done.set_result(fn(self.engine))
            except Exception as e:  # noqa: BLE001 - handed to the caller
                done.set_exception(e)

        self._queue(run, done)
        return done

    def close(self) -> None:
        self._closed = True
        self._wake.set()
        self._thread.join(timeout=30)

    def _queue(self, command: Callable[[], None], done: Future | None = None) -> None:
        if self._closed:
            if done is not None:
                done.set_exception(RuntimeError("the engine loop is closed"))
            return
        self._commands.append(command)
        self._wake.set()

    # -- the loop thread ----------------------------------------------------------------

    def _deliver(self, outputs) -> None:
        for out in outputs:
            sink = self._sinks.get(out.request_id)
            if out.finished:
                self._sinks.pop(out.request_id, None)
            if sink is not None:
                try:
                    sink(out)
                except Exception:  # noqa: BLE001 - a consumer's bug must not stop the engine
                    log.exception("output sink of %s failed", out.request_id)

    def _run(self) -> None:
        engine = self.engine
        while not self._closed:
            added = bool(self._commands)
            while self._commands:
                self._commands.popleft()()
            if not engine.has_unfinished():
                self.num_running = self.context_tokens = 0
                self._wake.wait(timeout=1.0)
                self._wake.clear()
                continue
            if added:  # what just came in counts while the step runs (a group's step is a whole prefill)
                self.num_running, self.context_tokens = engine.load()
            start = time.perf_counter()
            try:
                outputs = engine.step()
            except Exception as e:  # a bug in the engine: fail what is in it, keep serving
                log.exception("engine step failed; failing its %d requests", len(self._sinks))
                for rid, sink in list(self._sinks.items()):
                    engine.abort_request(rid)
                    sink(e)
                self._sinks.clear()
                continue
            seconds = time.perf_counter() - start
            self.num_running, self.context_tokens = engine.load()
            if outputs:
                # tokens it computed: more than one a request when a prompt's chunk rode on it
                self.steps.append(StepSample(len(outputs), self.context_tokens, seconds, engine.last_step_tokens))
            self._deliver(outputs)
        for rid, sink in list(self._sinks.items()):
            sink(RuntimeError("the engine loop closed"))
        self._sinks.clear()
