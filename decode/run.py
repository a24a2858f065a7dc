"""One request on a decode worker: where it stands (``DecodeState``), what it holds (``Decoding``), and the one place
that lets it all go (``Decoding.close``: the engine drops the request, its blocks pass the write fence, its landing
slots go back once their writer is done, and the Conductor hears it finished).
"""

from __future__ import annotations

import enum
import queue
import threading
import time
from collections.abc import Callable, Iterator

from decode.handoff import Handoff, Landed
from mooncake.runtime.conductor_link import ConductorLink
from mooncake.serving.engine_loop import EngineLoop
from mooncake.serving.sampling import logprob_to_pb
from mooncake.serving.text import OutputText
from protos import worker_pb2 as wpb


class DecodeState(enum.Enum):
    """Where one request stands on this worker."""

    PREFILLING = "prefilling"  # in the engine waiting for its KV (its blocks held there), maybe with landing slots
    DECODING = "decoding"  # its KV landed: in the engine's batch
    DONE = "done"  # finished, or never joined


class Counts:
    """How many requests are between admission and their first token (``in_prefill``: the heartbeat's queue), and
    which stream (a first output out on their stream, not yet ended: ``streaming`` counts them for the health endpoint,
    ``longest_gap`` measures their waits for their next token)."""

    def __init__(self) -> None:
        self._lock, self.in_prefill = threading.Lock(), 0
        self._streams: set[Decoding] = set()

    def add(self, in_prefill: int) -> None:
        with self._lock:
            self.in_prefill += in_prefill

    def streams(self, run: Decoding, on: bool) -> None:
        with self._lock:
            (self._streams.add if on else self._streams.discard)(run)

    @property
    def streaming(self) -> int:
        return len(self._streams)

    def stream_tokens(self) -> dict[str, int]:
        """Each stream's request id and the output tokens it has generated so far (what /health lists)."""
        with self._lock:
            return {run.request_id: run.output_tokens for run in sorted(self._streams, key=lambda r: r.request_id)}

    def longest_gap(self, now: float) -> float:
        """How long the stream that has waited longest for its next token has waited by ``now`` (0: none streams)."""
        with self._lock:
            return max((now - run.last_at for run in self._streams), default=0.0)


class Decoding:
    """One request's resources on this worker, and the one place that frees them (``close``)."""

    def __init__(
        self, request_id: str, loop: EngineLoop, handoff: Handoff, counts: Counts, link: ConductorLink | None
    ) -> None:
        self.request_id, self.loop, self.handoff, self.link = request_id, loop, handoff, link
        self.counts = counts
        self.state = DecodeState.PREFILLING
        self.landed: Landed | None = None  # where its KV lands (Handoff.admit)
        self.ttft_s = 0.0  # from the request's arrival here to its first token (0: it never got one)
        self.handoff_s = 0.0  # of it, all but the prefill worker's own queue and prefill (0: not measured, or reported)
        self.parts = (0.0, 0.0)  # and those two: the prefill worker's own queue and prefill (the Conductor's errors)
        self.written = None  # its write-behind (decode.writeback.Written), once it has one
        self.held = False  # its engine request keeps its blocks past its end for the write-behind: released at close
        self.output_tokens = 0  # generated so far (the Conductor's planner learns output lengths from the last count)
        self.first_at = self.last_at = 0.0  # monotonic: when its first output and its latest reached its stream
        self.tokens_at_first = 0  # output tokens it had by its first output here (a resumed stream's earlier ones)
        self._left = False  # counted out of the requests in prefill
        counts.add(1)

    def decoding(self) -> None:
        """Its first token is out: it decodes in the batch."""
        self.leave_prefill()
        self.state = DecodeState.DECODING

    def first_out(self) -> None:
        """Its first output reached its stream (at ``last_at``): it counts as streaming until it is closed."""
        self.first_at, self.tokens_at_first = self.last_at, self.output_tokens
        self.counts.streams(self, True)

    def leave_prefill(self) -> None:
        if not self._left:
            self._left = True
            self.counts.add(-1)

    @property
    def tbt_s(self) -> float:
        """The mean time between its tokens here (0: fewer than two reached its stream): what the Conductor's TBT
        quote is held against."""
        gaps = self.output_tokens - self.tokens_at_first
        return (self.last_at - self.first_at) / gaps if gaps > 0 and self.last_at > self.first_at else 0.0

    def close(self) -> None:
        """However the request ended (finished, failed, the client gone): the engine drops it (a no-op once it
        finished; blocks a prefill may still write stay with the write fence), landing slots go back once their
        writer is done, and the Conductor hears it (out of its decode forecast)."""
        if self.landed is not None:
            self.handoff.release(self.landed)
        self.leave_prefill()
        self.counts.streams(self, False)  # (a no-op for one that never streamed)
        if self.state is not DecodeState.DONE:
            self.loop.abort(self.request_id)
        if self.held:  # after the write-behind's reads, queued before this on the engine's thread
            self.loop.call(lambda engine: engine.release_held(self.request_id))
            self.held = False
        if self.link is not None:
            self.link.finished(
                self.request_id,
                self.ttft_s,
                self.handoff_s,
                *self.parts,
                output_tokens=self.output_tokens,
                tbt_s=self.tbt_s,
            )
        self.state = DecodeState.DONE


def stream(
    run: Decoding,
    outputs: queue.Queue,
    text: OutputText,
    usage: dict,
    context,
    first: Callable[[object], dict] | None = None,
    progress: Callable[[int], None] | None = None,
) -> Iterator[wpb.GenerateChunk]:
    """The engine's outputs for ``run`` (its sink's queue), as chunks, until it finishes or the client leaves.
    ``first(out)``, when given, is called with the first output and may add fields to its chunk (a dict);
    ``progress(n)`` hears how many tokens of the sequence have their KV computed (write-behind)."""
    while True:
        try:
            out = outputs.get(timeout=0.1)
        except queue.Empty:
            if not context.is_active():
                return
            continue
        if isinstance(out, BaseException):
            raise RuntimeError(f"the decode engine failed: {out}")
        piece = text.add(out)  # the one detokenizer: text, and a stop string, which ends the request here
        run.output_tokens = len(out.output_token_ids) - len(out.new_token_ids) + piece.num_tokens
        run.last_at = time.monotonic()
        if not run.first_at:
            run.first_out()
        fields = dict(
            usage,
            token_ids=list(out.new_token_ids[: piece.num_tokens]),
            text=piece.text,
            finish_reason=piece.finish.value if piece.finish is not None else "",
            completion_tokens=run.output_tokens,
            logprobs=[logprob_to_pb(lp) for lp in (out.new_logprobs or ())[: piece.num_tokens]],
        )
        if first is not None:
            fields.update(first(out))
            first = None
        yield wpb.GenerateChunk(**fields)
        if progress is not None:  # the newest token's KV is computed by the next step (an ended request's blocks are
            progress(out.num_prompt_tokens + len(out.output_token_ids) - 1)  # held for this: RequestOptions.hold)
        if piece.finish is not None:
            if piece.stop is not None and not out.finished:
                run.loop.abort(run.request_id)  # its engine still runs it
            run.state = DecodeState.DONE
            return
