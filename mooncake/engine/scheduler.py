"""Continuous-batching scheduler with chunked prefill and preemption by recompute.

Pure (no torch, no I/O): state in, decisions out; the engine drives it once per step:

    out = scheduler.schedule()                 which requests run, with how many tokens
    sampled = runner.execute(out)              the model (not here)
    finished = scheduler.update_from_output(out, sampled)

There is no prefill phase: every request has ``num_computed_tokens`` chasing
``num_tokens`` and each step hands out a token budget (``max_num_batched_tokens``).
Running requests are served first, in arrival order (a decode takes one token, a
half-done prompt takes the next chunk), then waiting requests are admitted with what
is left. When the block pool runs dry the newest running request is preempted: its
blocks are freed (they stay in the prefix cache until evicted) and it goes back to the
front of the queue, to be recomputed.

A request whose prompt's KV a prefill elsewhere computes (a decode worker's) enters with
``add_landing``: it is given its blocks at once and waits for its KV (vLLM's
WAITING_FOR_REMOTE_KVS) until ``land`` hands it the prefill's token, which is checked for
a stop as every sampled token is; then it queues for a place in the batch.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from mooncake.blocks import blocks_for
from mooncake.engine.block_pool import BlockPool
from mooncake.engine.request import FinishReason, Request, RequestStatus, SamplingParams


@dataclass(slots=True)
class ScheduledRequest:
    request: Request
    num_computed_tokens: int  # KV already in the cache before this step
    num_new_tokens: int  # tokens to compute this step

    @property
    def samples(self) -> bool:
        """True when this step reaches the end of the sequence, so a token is sampled."""
        return self.num_computed_tokens + self.num_new_tokens == self.request.num_tokens


@dataclass(slots=True)
class KVImport:
    """Copy a request's external KV into blocks it was just given (before the forward)."""

    request: Request
    first_block: int  # index into the request's block table (and into its external KV)
    block_ids: list[int]  # destination blocks for external blocks first_block, first_block+1, ...


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    imports: list[KVImport] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class NoRoom(Exception):
    """Too few free blocks for a landing request's KV now (its worker answers busy; the Conductor places elsewhere)."""


class Scheduler:
    """Owns the waiting queue, the running batch and every request's block table."""

    def __init__(
        self,
        pool: BlockPool,
        block_size: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        on_finish: Callable[[Request], bool] | None = None,
    ):
        self.pool = pool
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        # A sequence stops growing when it would no longer fit the whole pool even alone:
        # past that point it could only preempt itself forever.
        self.max_seq_len = min(max_model_len, pool.num_blocks * block_size)
        self.on_finish = on_finish  # sees a finished request before its blocks are freed; True: it keeps them
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.landing: dict[str, Request] = {}  # WAITING_FOR_REMOTE_KV: blocks held, KV on its way
        self.num_landing_blocks = 0  # their blocks (a count: other threads read it as a snapshot)
        self.num_preemptions = 0
        self._num_named: dict[str, int] = {}  # blocks already offered to the prefix cache

    # -- queue management ------------------------------------------------------------

    def add_request(self, request: Request, ahead: bool = False) -> None:
        """Queue ``request`` behind those waiting, or (``ahead``) before them: behind those that came ahead before it
        and those preempted, which wait at the front already."""
        self._check_new(request)
        self.requests[request.request_id] = request
        if ahead:
            request.ahead = True
            at = 0
            while at < len(self.waiting) and (
                self.waiting[at].ahead or self.waiting[at].status == RequestStatus.PREEMPTED
            ):
                at += 1
            self.waiting.insert(at, request)
        else:
            self.waiting.append(request)

    def _check_new(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        blocks_needed = blocks_for(min(request.num_prompt_tokens + 1, self.max_model_len), self.block_size)
        if blocks_needed > self.pool.num_blocks:
            raise ValueError(
                f"prompt of {request.num_prompt_tokens} tokens needs {blocks_needed} KV blocks; "
                f"the cache has {self.pool.num_blocks}"
            )

    def add_landing(self, request: Request) -> None:
        """Give ``request`` blocks for its first ``num_landed_tokens`` tokens now and hold it there while a prefill
        elsewhere writes their KV (``block_ids``: where). Raises NoRoom (too few free blocks) or ValueError."""
        self._check_new(request)
        need = blocks_for(request.num_landed_tokens, self.block_size)
        if need > self.pool.num_free_blocks:
            raise NoRoom(
                f"{need} free KV blocks wanted for {request.num_landed_tokens} tokens; {self.pool.num_free_blocks} free"
            )
        request.block_ids = [b.block_id for b in self.pool.allocate(need)]
        request.status = RequestStatus.WAITING_FOR_REMOTE_KV
        self.requests[request.request_id] = request
        self.landing[request.request_id] = request
        self.num_landing_blocks += need

    def land(self, request_id: str, token: int) -> Request:
        """The KV of a landing request is in its blocks and its prefill sampled ``token``: the token counts as
        generated and is checked as any sampled token (a stop finishes the request here); else the request queues for
        a place in the batch. Raises KeyError for a request not landing (aborted meanwhile)."""
        req = self.landing.pop(request_id)
        self.num_landing_blocks -= len(req.block_ids)
        req.status = RequestStatus.WAITING
        req.append_output_token(token)
        self.waiting.append(req)
        self._stopped(req, token)
        return req

    def abort(self, request_id: str) -> Request | None:
        """Stop a request wherever it is and free its blocks; None if unknown or done."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status == RequestStatus.WAITING_FOR_REMOTE_KV:
            del self.landing[request_id]
            self.num_landing_blocks -= len(request.block_ids)
        else:
            self.waiting.remove(request)
        self._finish(request, RequestStatus.FINISHED_ABORTED, FinishReason.ABORT)
        return request

    def finish(self, request: Request, reason: FinishReason, stop_reason: int | str | None = None) -> None:
        """End a running or queued request (e.g. the engine matched a stop string)."""
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            self.waiting.remove(request)
        request.stop_reason = stop_reason
        status = RequestStatus.FINISHED_LENGTH if reason == FinishReason.LENGTH else RequestStatus.FINISHED_STOPPED
        self._finish(request, status, reason)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # -- the step -------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Decide this step's batch. Allocates blocks; may preempt running requests."""
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget, req.chunk_tokens or budget)
            while not self._allocate(req, req.num_computed_tokens + n):
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted.append(victim.request_id)
                if victim is req:
                    break
            else:
                out.scheduled.append(ScheduledRequest(req, req.num_computed_tokens, n))
                budget -= n
                i += 1
                continue
            break  # req itself was preempted: everyone after it already is too

        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not out.preempted:
            req = self.waiting[0]
            hits, num_queried = self._prefix_hits(req)
            num_ext = req.num_external_tokens if req.external_kv is not None else 0
            num_computed = max(len(hits) * self.block_size, num_ext, req.num_landed_tokens)
            n = min(req.num_tokens - num_computed, budget, req.chunk_tokens or budget)
            if not self._allocate(req, num_computed + n, hits):
                break
            self.pool.record_lookup(num_queried, len(hits))
            self.waiting.popleft()
            if req.status == RequestStatus.WAITING:
                req.num_cached_tokens = len(hits) * self.block_size
            if num_ext > len(hits) * self.block_size:
                first = len(hits)
                last = blocks_for(num_ext, self.block_size)
                out.imports.append(KVImport(req, first, req.block_ids[first:last]))
                req.num_imported_tokens = num_ext - first * self.block_size
            req.num_computed_tokens = num_computed
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.scheduled.append(ScheduledRequest(req, num_computed, n))
            budget -= n
        return out

    def update_from_output(self, out: SchedulerOutput, sampled: dict[str, int]) -> list[Request]:
        """Advance every scheduled request; append sampled tokens; return the finished ones.

        ``sampled`` holds one token per request whose ``ScheduledRequest.samples`` is true.
        Stop tokens, ``max_tokens`` and ``max_model_len`` end a request here; stop
        strings are the engine's (they need the tokenizer).
        """
        finished = []
        for s in out.scheduled:
            req = s.request
            if req.status != RequestStatus.RUNNING:
                continue  # aborted between schedule and update
            req.num_computed_tokens += s.num_new_tokens
            self._name_blocks(req)
            if not s.samples:
                continue
            token = sampled[req.request_id]
            req.append_output_token(token)
            if self._stopped(req, token):
                finished.append(req)
        return finished

    def _stopped(self, req: Request, token: int) -> bool:
        """Did ``token``, just appended, end ``req``? (finished here when it did)."""
        end = token_finish(
            token, req.sampling_params, req.eos_token_ids, req.num_output_tokens, req.num_tokens, self.max_seq_len
        )
        if end is not None:
            self.finish(req, *end)
        return end is not None

    # -- internals ------------------------------------------------------------------

    def _prefix_hits(self, req: Request) -> tuple[list, int]:
        """Cached leading blocks of ``req`` and how many blocks were looked up."""
        if (
            not self.pool.enable_prefix_caching
            or req.sampling_params.prompt_logprobs is not None
            or req.num_landed_tokens
        ):
            return [], 0  # prompt logprobs need the whole prompt computed; landed KV is in the request's blocks already
        # Leave at least one token to compute: its logits give the next token.
        keys = req.block_keys()[: (req.num_tokens - 1) // self.block_size]
        return self.pool.lookup(keys), len(keys)

    def _allocate(self, req: Request, num_tokens: int, hits: Iterable = ()) -> bool:
        """Give ``req`` blocks for ``num_tokens`` tokens (taking ``hits`` first); False if short."""
        hits = list(hits)
        have = len(req.block_ids) + len(hits)
        need = max(0, blocks_for(num_tokens, self.block_size) - have)
        revived = sum(1 for b in hits if b.ref_cnt == 0)  # cached blocks now in the free queue
        if need + revived > self.pool.num_free_blocks:
            return False
        self.pool.touch(hits)
        req.block_ids.extend(b.block_id for b in hits)
        req.block_ids.extend(b.block_id for b in self.pool.allocate(need))
        self._num_named[req.request_id] = max(self._num_named.get(req.request_id, 0), len(hits))
        return True

    def _name_blocks(self, req: Request) -> None:
        """Offer newly completed blocks to the prefix cache under their chain keys."""
        if not self.pool.enable_prefix_caching:
            return
        done = req.num_computed_tokens // self.block_size
        start = self._num_named.get(req.request_id, 0)
        if done <= start:
            return
        keys = req.block_keys()
        for idx in range(start, done):
            self.pool.cache(req.block_ids[idx], keys[idx])
        self._num_named[req.request_id] = done

    def _preempt(self, req: Request) -> None:
        self.pool.free(req.block_ids)
        req.block_ids = []
        req.num_computed_tokens = 0
        req.num_landed_tokens = 0  # its landed KV went with its blocks: it is recomputed
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        self._num_named.pop(req.request_id, None)
        self.waiting.appendleft(req)

    def _finish(self, req: Request, status: RequestStatus, reason: FinishReason) -> None:
        req.status = status
        req.finish_reason = reason
        kept = self.on_finish(req) if self.on_finish is not None else False
        if not kept:
            self.pool.free(req.block_ids)
        req.block_ids = []
        req.external_kv = None
        self._num_named.pop(req.request_id, None)
        self.requests.pop(req.request_id, None)


def token_finish(
    token: int,
    params: SamplingParams,
    eos_token_ids: frozenset[int],
    num_output_tokens: int,
    num_tokens: int,
    max_seq_len: int,
) -> tuple[FinishReason, int | None] | None:
    """Does ``token``, a request's newest output (its ``num_output_tokens``-th, the sequence then ``num_tokens`` long),
    end it? (reason, stop reason) or None: a stop or EOS token, ``max_tokens``, or the longest sequence. The one rule
    for every sampled token, a prefill's first included; stop strings, matched on text, are the engine's."""
    if token in params.stop_token_ids or (not params.ignore_eos and token in eos_token_ids):
        return FinishReason.STOP, token
    if num_output_tokens >= params.max_tokens or num_tokens >= max_seq_len:
        return FinishReason.LENGTH, None
    return None
