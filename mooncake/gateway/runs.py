"""A request's backend streams: one ``Run`` per choice, and the ``Fanout`` that starts and merges them.

A request with several choices (``n``, ``best_of``, a batch of prompts) is one backend
generation per choice. The first choice of each prompt starts at once; its siblings
start once it has its first chunk, when the prompt's KV is cached (in the engine's prefix
cache, or in the pool beside the prefill worker that computed it: a sibling ``follows`` its
leader, and the Conductor places it there, its prefill waiting out the pool write that
follows the leader's first token). So a prompt is prefilled once and each sibling
computes only the prompt's last, partial block (our engines cache whole blocks). A sibling
turned away (429) while others of its request stream waits for one of them to finish and
goes again, so ``n`` may exceed what the cluster decodes at once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncGenerator

from mooncake.gateway.metrics import GatewayMetrics
from mooncake.gateway.protocol import PromptTokensDetails, Usage
from mooncake.serving.types import (
    BackendError,
    GenerationBackend,
    GenerationChunk,
    GenerationRequest,
    Quote,
    Rejected,
)


class Run:
    """One choice's stream from the backend, and the metrics it feeds.

    ``status`` is what it came to: None while it runs, 200 once finished, an error's
    status once it failed. :meth:`close` must be called exactly as ``finally``.
    ``counts_prompt``: this run's prompt tokens count in the metrics (one run per prompt).
    """

    def __init__(
        self,
        backend: GenerationBackend,
        metrics: GatewayMetrics,
        generation: GenerationRequest,
        arrival: float,
        counts_prompt: bool = True,
    ) -> None:
        self._metrics = metrics
        self._arrival = arrival
        self.counts_prompt = counts_prompt
        self.num_prompt_tokens = len(generation.prompt_token_ids)
        self.num_completion_tokens = 0
        self.last: GenerationChunk | None = None
        self.status: int | None = None
        self._last_token_at: float | None = None
        self._closed = False
        self._chunks: AsyncGenerator[GenerationChunk, None] = backend.generate(generation)  # type: ignore[assignment]
        metrics.running.inc()

    async def next(self) -> GenerationChunk | None:
        """The next chunk, or None when the backend's stream ended. Raises the backend's BackendError."""
        try:
            chunk = await anext(self._chunks)
        except StopAsyncIteration:
            return None
        except BackendError as e:
            self.status = e.status
            if self.last is None and e.status != 400:
                self._metrics.rejections.labels(e.code or e.error_type).inc()
            raise
        now = time.monotonic()
        if chunk.token_ids:
            if self._last_token_at is None:
                self._metrics.ttft.observe(now - self._arrival)
            else:
                self._metrics.tbt.observe(now - self._last_token_at)
            self._last_token_at = now
            self.num_completion_tokens += len(chunk.token_ids)
        if chunk.finish_reason is not None:
            self.status = 200
            self._metrics.e2e.observe(now - self._arrival)
        self.last = chunk
        return chunk

    @property
    def cached_tokens(self) -> int:
        return self.last.cached_tokens if self.last is not None else 0

    async def close(self) -> None:
        """Close the backend's stream (cancelling the request if it has not finished) and count its tokens."""
        if self._closed:
            return
        self._closed = True
        try:
            await self._chunks.aclose()
        finally:
            m = self._metrics
            m.running.dec()
            if self.last is not None and self.counts_prompt:  # the backend took it: its prompt was (being) prefilled
                m.prompt_tokens.inc(self.num_prompt_tokens)
                for tier, count in self.last.cached_tokens_by_tier.items():
                    m.cached_prompt_tokens.labels(tier).inc(count)
            m.completion_tokens.inc(self.num_completion_tokens)


class Fanout:
    """The runs of one request's choices (``generations[i]`` is choice ``i``; ``per_prompt`` choices per prompt).

    :meth:`next` yields ``(choice, chunk)`` as they come; a choice's stream ends with a
    chunk carrying ``finish_reason``. :meth:`close` must be called exactly as ``finally``:
    it cancels whatever still runs.
    """

    def __init__(
        self,
        backend: GenerationBackend,
        metrics: GatewayMetrics,
        generations: list[GenerationRequest],
        per_prompt: int,
        arrival: float,
    ) -> None:
        self._backend, self._metrics, self._arrival = backend, metrics, arrival
        # a sibling names its leader: the Conductor places it where the leader's prefill writes the prompt's KV
        self._generations = [
            g if i % per_prompt == 0 else dataclasses.replace(g, follows=generations[i - i % per_prompt].request_id)
            for i, g in enumerate(generations)
        ]
        self.per_prompt = per_prompt
        self.runs = [self._run(i) for i in range(len(generations))]
        self._a_choice_finished = asyncio.Event()  # replaced each time one finishes
        self._active = 0  # choices in the backend now
        self.failed_status: int | None = None
        self._queue: asyncio.Queue[tuple[int, GenerationChunk | BaseException | None]] = asyncio.Queue()
        self._first = [
            asyncio.Event() for _ in range(0, len(generations), per_prompt)
        ]  # each prompt's leader has a chunk
        self._tasks: list[asyncio.Task] = []
        self._open = len(generations)
        self.quote: Quote | None = None  # the first the backend gave (the Conductor's, for the first choice placed)

    async def next(self) -> tuple[int, GenerationChunk] | None:
        """The next chunk of any choice, or None once every choice finished. Raises the first BackendError."""
        if not self._tasks:
            self._tasks = [asyncio.create_task(self._pump(i)) for i in range(len(self.runs))]
        while self._open:
            index, item = await self._queue.get()
            if isinstance(item, BaseException):
                raise item
            if item is None:
                self._open -= 1
                continue
            return index, item
        return None

    def _run(self, index: int) -> Run:
        return Run(
            self._backend,
            self._metrics,
            self._generations[index],
            self._arrival,
            counts_prompt=index % self.per_prompt == 0,
        )

    async def _pump(self, index: int) -> None:
        prompt, leader = divmod(index, self.per_prompt)
        try:
            if leader:
                await self._first[prompt].wait()
            while not await self._stream(index, prompt):  # turned away while its siblings stream: wait, go again
                finished = self._a_choice_finished
                await finished.wait()
                await self.runs[index].close()
                self.runs[index] = self._run(index)
            self._queue.put_nowait((index, None))
            self._a_choice_finished.set()
            self._a_choice_finished = asyncio.Event()
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # the consumer raises it (a BackendError, or a bug it reports)
            self._first[prompt].set()  # siblings go ahead (and most likely fail the same way)
            self._queue.put_nowait((index, e))

    async def _stream(self, index: int, prompt: int) -> bool:
        """Pump choice ``index``'s chunks to the queue; False when the backend turned it away (a 429 before its first
        chunk) while another choice of the request streams, which frees capacity when it ends: a request's ``n`` may
        be more than the cluster decodes at once."""
        run = self.runs[index]
        self._active += 1
        try:
            while (chunk := await run.next()) is not None:
                self._first[prompt].set()
                self.quote = self.quote or chunk.quote
                self._queue.put_nowait((index, chunk))
                if chunk.finish_reason is not None:
                    await run.close()  # the backend lets go of what it held for it now, not when the request ends
                    return True
        except Rejected:
            if run.last is None and self._active > 1:  # another choice is in the backend: room comes when it ends
                return False
            raise
        finally:
            self._active -= 1
        raise RuntimeError(f"the backend ended choice {index} without a finish_reason")

    def usage(self) -> Usage:
        """Prompt tokens once per prompt, completion tokens of every choice."""
        leaders = [r for r in self.runs if r.counts_prompt]
        prompt = sum(r.num_prompt_tokens for r in leaders)
        completion = sum(r.num_completion_tokens for r in self.runs)
        return Usage(
            prompt_tokens=prompt,
            completion_tokens=completion,
            total_tokens=prompt + completion,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=sum(r.cached_tokens for r in leaders)),
        )

    @property
    def status(self) -> int | None:
        """None while a choice runs, 200 when all finished, else the first error's status (``failed_status``: one the
        gateway answered with on its own, a mid-stream error that is no backend's)."""
        if self.failed_status is not None:
            return self.failed_status
        statuses = [r.status for r in self.runs]
        errors = [s for s in statuses if s not in (None, 200)]
        if errors:
            return errors[0]
        return 200 if all(s == 200 for s in statuses) else None

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        errors = []
        for run in self.runs:
            try:
                await run.close()
            except Exception as e:  # close every run, then report
                errors.append(e)
        if errors:
            raise errors[0]
