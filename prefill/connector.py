"""PoolConnector: the prefill worker's KV connector. After each layer, new KV goes to the decode worker.

For every request it serves (a ``PrefillJob``), in every engine step that computes
some of its prompt, after each layer:

    blocks completed by this step (the prompt's last, partial block once the prompt is done)
      layer l of each -> the decode worker: into the blocks of its engine's own cache granted to
                         this prefill (``landing_blocks``): on this host, mapped here
                         (``mapped_cache``: its shared memory, or its GPU memory by CUDA IPC) and
                         written by tensor copies; from another host, through its segment
                         (tcp/rdma); or into its landing slots (stock vLLM decode workers, a
                         cache out of reach)

(one class per mechanism, chosen once per job: prefill/landing.py), so pushing layer l overlaps computing layer
l + 1, and the request's KV is on the decode worker when its prefill ends. The prompt's new full blocks go to this
node's pool **after** the answer (``store_later``): the engine keeps the request's blocks when it finishes
(``request_finished`` returns True), a ``PoolWriter`` thread copies them into the reserved pool slots and hands them
back (``released_blocks``), and the worker commits the reservation then; a failed write loses a cache entry, never a
request. A stage of a pipelined group (``prefill/group.py``) binds the cache of its own layers and pushes them at
their global offsets; its pool writes still go layer by layer through the transfer engine (``PrefillJob.pool_segment``),
since the pool node is another process's memory. Blocks imported from the pool (the reused prefix) are pushed the same
way, from the engine's cache, in the step that imports them. ``wait_for_save`` waits for the step's transfers before
the step ends (the engine may reuse those cache blocks once the request finishes); pushes through host staging (a CUDA
cache) read copies, so they run on across steps and are waited for when the job's last blocks are under way. What the
settled pushes across the network took measures the link (``link``: the worker reports it to the Conductor).

The native engine's cache is in the pool layout, so its blocks are pushed straight from
the cache (``bind``). Another engine's cache (vLLM's) is read through ``export``, which
copies one layer of the completed blocks into a staging tensor in the pool layout; the
pushes read that tensor, kept alive until the step's transfers are done.

A push that fails fast (a connection reset, an error answer, an RDMA work error) is sent once
more before its job fails: the transfer engine's next batch to a peer reconnects (a new tcp
connection, a new queue pair), so a transient fault costs one resend, not the request, and never
the pair (``PUSH_ATTEMPTS``, counted in ``push_retries``). One that failed after half the I/O
timeout (a silent peer) is not: its request is placed again elsewhere.

Runs on the engine's thread; jobs are added and removed from request threads.
"""

from __future__ import annotations

import functools
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from mooncake.engine.blockcopy import as_bytes, copy_blocks
from mooncake.engine.connector import ConnectorStep, KVConnector, StepCancelled
from mooncake.engine.request import TokenLogprob
from mooncake.serving.kvlayout import tensor_bytes
from prefill.landing import Landing, landing_for
from transfer import Segment, Slice, TransferEngine, TransferError
from transfer.linkrate import LinkMeter

log = logging.getLogger(__name__)

# a test's fault: the pool writer waits this long before each write (tests/test_serving_cluster.py's lagging write)
SLOW_WRITE_ENV = "MOONCAKE_FAULT_SLOW_POOL_WRITE_S"
SLOW_WRITE_S = float(os.environ.get(SLOW_WRITE_ENV, "0") or 0)

PUSH_ATTEMPTS = 2  # a failed push is sent again once; a second failure fails its job


@dataclass(eq=False)
class PrefillJob:
    """One request's prefill: its landing, its pool slots, and how far its KV has been pushed."""

    request_id: str
    prompt_len: int
    num_blocks: int  # prompt blocks, the last one possibly partial
    landing_segment: str
    landing_offsets: list[int]  # one per prompt block
    pool_slots: dict[int, int] = field(default_factory=dict)  # block index -> reserved slot in this node's pool
    pool_segment: str | None = None  # the pool's segment, written through the transfer engine (None: the bound tensor)
    pool_token: str = ""  # the reservation of pool_slots (Slice.token: the pool node checks it)
    landing_token: str = ""  # the decode worker's grant of the landing slots (Landing.token)
    landing_spec: Segment | None = None  # the landing segment itself (a pipelined group's stages write it)
    prefix_tokens: list[str] = field(default_factory=list)  # the lease holding each prefix slot (a group's stages read
    # the prefix from the pool's segment under them)
    landing_blocks: list[int] | None = None  # set: the destinations are these blocks of the decode engine's cache
    landing_num_blocks: int = 0  # that cache's blocks (the stride of its layout [L, 2, blocks, bs, Hkv, D])
    mapped_cache: torch.Tensor | None = None  # that cache itself, mapped here (on this GPU by CUDA IPC, or its shared
    # memory on this host): written by tensor copies, a gather and a scatter per layer, not by transfer-engine slices
    store_later: bool = False  # pool slots are written after the first token, from blocks the engine keeps meanwhile
    on_stored: Callable[[bool], None] | None = None  # then called (True: every pool slot written) on the writer thread
    pushed: int = 0  # blocks whose every layer is on the decode worker
    issued: int = 0  # blocks whose every layer's push has started (pushed <= issued)
    started_at: float | None = None  # its first engine step
    compute_s: float = 0.0  # its share of the steps that computed it (each step's time x its tokens / theirs)
    narrow: torch.dtype | None = None  # its landing slots keep the pool's narrower dtype: converted as pushed
    finished_at: float | None = None
    first_token: int | None = None
    first_logprob: TokenLogprob | None = None  # when the sampling asked for logprobs
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # when the sampling asked for prompt_logprobs
    error: BaseException | None = None
    writing: bool = False  # its new blocks are being written to the pool after the first token (``on_stored`` ends it)
    cancelled: threading.Event | None = None  # its caller's: once set for every job of a step, the step stops mid-way
    done: threading.Event = field(default_factory=threading.Event)

    def fail(self, error: BaseException) -> None:
        if self.error is None:
            self.error = error

    @functools.cached_property
    def landing(self) -> Landing:
        """Where its KV lands, by mechanism (prefill/landing.py): chosen once, at its first push."""
        return landing_for(self)

    def landing_at(self, block: int, layer: int, kv: int, half: int) -> int:
        """Byte offset in the landing segment of K (kv=0) or V (kv=1) of one layer of prompt block ``block``; ``half``
        is the size of one (a block's K or V in one layer)."""
        if self.landing_blocks is None:  # a landing slot, in the pool layout
            return self.landing_offsets[block] + (layer * 2 + kv) * half
        return self.cache_at(self.landing_blocks[block], layer, kv, half)

    def cache_at(self, cache_block: int, layer: int, kv: int, half: int) -> int:
        """Byte offset of K or V of one layer of block ``cache_block`` of the decode engine's cache
        [L, 2, blocks, ...]."""
        return ((layer * 2 + kv) * self.landing_num_blocks + cache_block) * half


Export = Callable[[int, torch.Tensor, list[int]], torch.Tensor]  # (layer, its cache, block ids) -> [n, 2, bs, Hkv, D]


@dataclass(eq=False)
class Push:
    """One batch of a job's slices under way, and what it takes to send it again: the bytes it reads (the bound cache,
    or a staged copy kept alive until it settles) and the slices."""

    job: PrefillJob
    batch: object  # the TransferBatch
    local: object  # the buffer the slices read
    slices: list[Slice]
    attempts: int = 1


class PoolConnector(KVConnector):
    def __init__(
        self,
        transfer: TransferEngine,
        pool: torch.Tensor | None,
        block_size: int,
        io_timeout_s: float,
        export: Export | None = None,
    ) -> None:
        self.transfer = transfer
        self.pool = pool  # [slots, L, 2, bs, Hkv, D]: this node's DRAM tier
        self.block_size = block_size
        self.io_timeout_s = io_timeout_s
        self.export = export  # None: push from the bound cache, which is in the pool layout
        self.jobs: dict[str, PrefillJob] = {}
        self._active: list[tuple[PrefillJob, list[int], int, int]] = []  # (job, block table, first block, end)
        self._pushes: list[Push] = []  # under way, not yet waited for
        self._lock = threading.Lock()  # _pushes: the staging thread appends too
        self.push_retries = 0  # pushes sent again after a transfer fault
        self.link = LinkMeter(transfer)  # the network's bandwidth, as this connector's settled pushes measured it
        self._staging: HostStaging | None = None
        self._unsettled: set[PrefillJob] = set()  # jobs with pushes started and not yet waited for
        self._writer: PoolWriter | None = None  # started by the first job that stores later
        self._released: list[int] = []  # blocks the writer is done with (the engine frees them)
        self._step_jobs: list[PrefillJob | None] = []  # this step's requests' jobs (None: a request with no job)
        self._step: tuple[float, int, list] = (0.0, 0, [])  # this step's start, its tokens, (job, its tokens) of each

    def bind(
        self, kv_cache: torch.Tensor, first_layer: int = 0, num_layers: int | None = None, staged: bool | None = None
    ) -> None:
        """The engine's cache, [L, 2, num_blocks, bs, Hkv, D] (contiguous): the source of every push.

        A CPU cache is pushed from in place. A CUDA cache (or, with ``staged``, a CPU one: the same path, tested
        without a GPU) goes through pinned host staging: each layer's blocks are copied out on a side stream, and a
        thread pushes them once the copy is done (``HostStaging``). A pipeline stage's cache holds layers
        [first_layer, first_layer + L) of a ``num_layers``-layer model: its layers land at their global offsets in the
        landing and pool blocks."""
        if not kv_cache.is_contiguous():
            raise ValueError("the prefill connector pushes from a contiguous cache")
        self.kv_cache = kv_cache
        if staged is None:
            staged = kv_cache.device.type != "cpu"
        if staged:
            self._staging = HostStaging(kv_cache.device)
        elif kv_cache.device.type != "cpu":
            raise ValueError("a cache on the GPU is pushed through host staging")
        else:
            self._bytes = tensor_bytes(kv_cache)
            self.transfer.pin(self._bytes)  # every push reads it: registered with an RDMA device once, not per push
        layers, _, num_blocks = kv_cache.shape[:3]
        self.half = kv_cache[0, 0, 0].numel() * kv_cache.element_size()  # K (or V) of one block and layer
        self._num_blocks = num_blocks
        self._layer_bytes = 2 * self.half
        self.first_layer = first_layer
        self._block_bytes = (num_layers or layers) * self._layer_bytes  # a whole block in the pool layout

    def set_pool(self, pool: torch.Tensor) -> None:
        """This node's pool tensor (mapped again after its pool node restarted): where pool slots are written from now
        on, by the steps and by the writer after the answer."""
        self.pool = pool
        if self._writer is not None:
            self._writer.pool = pool

    @property
    def staged(self) -> bool:
        """Pushes go through pinned host staging (a CUDA cache), not straight from the bound cache."""
        return self._staging is not None

    def offset(self, layer: int, kv: int, block: int) -> int:
        return (((layer - self.first_layer) * 2 + kv) * self._num_blocks + block) * self.half

    # -- the engine's hooks ---------------------------------------------------------------

    def start_step(self, step: ConnectorStep) -> None:
        self._active = []
        self._step_jobs = [self.jobs.get(r.request_id) for r in step.requests]
        now = time.perf_counter()
        self._step = (now, sum(r.num_new_tokens for r in step.requests), [])
        for sreq in step.requests:
            job = self.jobs.get(sreq.request_id)
            if job is None:
                continue
            if job.started_at is None:
                job.started_at = now
            self._step[2].append((job, sreq.num_new_tokens))
            done = sreq.num_computed_tokens + sreq.num_new_tokens
            end = job.num_blocks if done >= job.prompt_len else done // self.block_size
            if end > job.issued:
                self._active.append((job, sreq.block_ids, job.issued, end))

    def save_layer(self, layer, k_cache, v_cache, step) -> None:
        self._stop_if_cancelled()
        if self.export is not None:
            self._save_staged(layer, k_cache)
            return
        if self._staging is not None:
            self._save_from_device(layer)
            return
        for job, table, start, end in self._active:
            if job.error is not None:
                continue
            slices = job.landing.from_cache(self, layer, table, start, end)
            if job.error is not None:  # a mapped cache it could not write
                continue
            slices += self._pool_from_cache(job, layer, table, start, end)
            if slices:
                self._push(job, self._bytes, slices)

    def _stop_if_cancelled(self) -> None:
        """Raise StepCancelled when every request of this step is a job whose caller has left (an abort storm: 100
        clients hang up, and a step of their prompts would run on for seconds). What the step pushed so far settles
        first: the engine frees the blocks those pushes read, and the decode workers their destinations."""
        jobs = self._step_jobs
        if not (self.stops_cancelled_steps and jobs and all(j and j.cancelled and j.cancelled.is_set() for j in jobs)):
            return
        self._unsettled.update(job for job, *_ in self._active)
        self._active, self._step_jobs = [], []
        self._settle()
        raise StepCancelled(f"the callers of {', '.join(j.request_id for j in jobs)} left")

    def _pool_from_cache(self, job: PrefillJob, layer: int, table: list[int], start: int, end: int) -> list[Slice]:
        """Layer ``layer`` of the job's blocks start..end into its reserved pool slots now (unless it stores them
        later): copied into the bound pool tensor, or slices through the pool's segment (a pipeline stage's)."""
        if job.store_later:
            return []
        slices = []
        for b in range(start, end):
            slot = job.pool_slots.get(b)
            if slot is None:
                continue
            block = table[b]
            if job.pool_segment is None:
                self.pool[slot, layer].copy_(self.kv_cache[layer - self.first_layer, :, block])
                continue
            at = slot * self._block_bytes + layer * self._layer_bytes
            for kv in (0, 1):
                slices.append(
                    Slice(
                        self.offset(layer, kv, block), job.pool_segment, at + kv * self.half, self.half, job.pool_token
                    )
                )
        return slices

    def _save_staged(self, layer: int, cache: torch.Tensor) -> None:
        """Push layer ``layer`` of each active job's completed blocks from ``export``'s pool-layout copy of them."""
        for job, table, start, end in self._active:
            if job.error is None:
                self._push_staged(job, layer, start, end, self.export(layer, cache, table[start:end]))

    def _save_from_device(self, layer: int) -> None:
        """Layer ``layer`` of each active job's completed blocks, gathered and copied to pinned host memory on the
        staging side stream (after the layer's compute), then pushed by the staging thread: the engine goes on to the
        next layer meanwhile."""
        cache = self.kv_cache[layer - self.first_layer]  # [2, num_blocks, bs, Hkv, D]
        for job, table, start, end in self._active:
            if job.error is not None:
                continue
            if job.landing.from_device(self._staging, cache, layer, table, start, end):  # no host memory
                if not job.store_later and any(b in job.pool_slots for b in range(start, end)):
                    self._staging.submit(
                        cache, table[start:end], functools.partial(self._pool_or_fail, job, layer, start, end)
                    )
                continue
            self._staging.submit(cache, table[start:end], functools.partial(self._push_or_fail, job, layer, start, end))

    def _pool_or_fail(self, job: PrefillJob, layer: int, start: int, end: int, staged: torch.Tensor) -> None:
        try:
            self._push_staged(job, layer, start, end, staged, landing=False)
        except BaseException as e:  # noqa: BLE001 - on the staging thread: the job fails, the engine does not
            job.fail(e)

    def _push_or_fail(self, job: PrefillJob, layer: int, start: int, end: int, staged: torch.Tensor) -> None:
        try:
            self._push_staged(job, layer, start, end, staged)
        except BaseException as e:  # noqa: BLE001 - on the staging thread: the job fails, the engine does not
            job.fail(e)

    def _push_staged(
        self, job: PrefillJob, layer: int, start: int, end: int, staged: torch.Tensor, landing: bool = True
    ) -> None:
        """Write ``staged`` (contiguous, CPU: blocks start..end of one layer; [2, n, bs, Hkv, D] from host staging, or
        [n, 2, bs, Hkv, D] in the pool layout from ``export``) to the landing (unless ``landing`` is False) and the
        job's pool slots (unless the job stores them later). Into a decode engine's cache, a run of blocks consecutive
        there is one slice per K or V."""
        staged, n = staged if job.narrow is None else staged.to(job.narrow), end - start  # narrow: the pool's dtype
        kv_major = self.export is None  # host staging's [2, n, ...]: K of consecutive blocks are contiguous
        half = staged[0, 0].numel() * staged.element_size()
        at = (lambda i, kv: (kv * n + i) * half) if kv_major else (lambda i, kv: (i * 2 + kv) * half)
        slices = job.landing.from_staged(layer, start, end, half, at, kv_major) if landing else []
        to_pool = (
            []
            if job.store_later
            else [(i, job.pool_slots[b]) for i, b in enumerate(range(start, end)) if b in job.pool_slots]
        )
        if to_pool and job.pool_segment is None:  # one copy (the GIL let go while it runs), not one per block
            rows, slots = torch.tensor([i for i, _ in to_pool], dtype=torch.long), [s for _, s in to_pool]
            blocks = staged.index_select(1, rows).transpose(0, 1) if kv_major else staged.index_select(0, rows)
            copy_blocks(self.pool[:, layer], slots, blocks, range(len(slots)))  # (float8 as bytes)
        elif to_pool:
            slices += [
                Slice(
                    at(i, kv),
                    job.pool_segment,
                    slot * self._block_bytes + layer * 2 * half + kv * half,
                    half,
                    job.pool_token,
                )
                for i, slot in to_pool
                for kv in (0, 1)
            ]
        self._push(job, tensor_bytes(staged), slices)

    def wait_for_save(self) -> None:
        """End of step. Pushes from the cache itself (or an export) are waited for now: the engine may write those
        blocks once the step ends. Pushes through host staging read copies the engine never touches, so they go on
        while the next steps compute and are waited for once a job's last blocks are under way (its prefill ends
        with this step), or when a request leaves the engine (``request_finished``): a job's KV is whole on the
        decode worker before its first token is returned."""
        started, tokens, shares = self._step
        # each job's share of the step: its tokens of the step's (prompts batched together share steps). On the CPU the
        # step has run by now; a CUDA step has only been queued (its jobs keep their wall time: unmeasured there)
        if tokens and self._staging is None:
            seconds = time.perf_counter() - started
            for job, n in shares:
                job.compute_s += seconds * n / tokens
        for job, _, _, end in self._active:
            job.issued = end
            self._unsettled.add(job)
        done = any(job.issued >= job.num_blocks for job, _, _, _ in self._active)
        self._active = []
        if self._staging is None or done:
            self._settle()

    def request_finished(self, request_id: str, block_ids: list[int]) -> bool:
        """A request finished or was aborted: its pushes end before its blocks (and its landing slots) are let go.

        A job that stores its new blocks later (``store_later``) and reached its first token keeps its blocks: the pool
        writer copies them into the reserved pool slots after the answer, then hands them back (``released_blocks``)."""
        if any(job.request_id == request_id for job in self._unsettled):
            self._settle()
        job = self.jobs.get(request_id)
        if job is None or not job.store_later or job.error is not None or job.pushed < job.num_blocks:
            return False
        pairs = [(block_ids[b], slot) for b, slot in sorted(job.pool_slots.items()) if b < len(block_ids)]
        if not pairs:
            return False
        if self._writer is None:
            self._writer = PoolWriter(self.kv_cache, self.pool, self.first_layer, self._release)
        job.writing = True
        self._writer.submit(job, pairs, block_ids)
        return True

    def _release(self, block_ids: list[int]) -> None:
        with self._lock:
            self._released.extend(block_ids)

    def released_blocks(self) -> list[int]:
        with self._lock:
            out, self._released = self._released, []
        return out

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every pool write started so far is done (tests, benchmarks, a drain); False on a timeout."""
        return self._writer is None or self._writer.flush(timeout)

    def _push(self, job: PrefillJob, local, slices: list[Slice]) -> None:
        """Start writing ``slices`` from ``local`` (engine or staging thread); one that cannot start is tried once more
        (the next batch to a peer reconnects), then fails its job."""
        for attempt in range(1, PUSH_ATTEMPTS + 1):
            started = time.monotonic()
            try:
                push = Push(job, self.transfer.write(local, slices), local, slices, attempt)
            except TransferError as e:
                if attempt == PUSH_ATTEMPTS or not self._retrying(job, e, time.monotonic() - started):
                    job.fail(e)
                    return
                continue
            with self._lock:
                self._pushes.append(push)
            return

    def _retrying(self, job: PrefillJob, error: TransferError, took_s: float = 0.0) -> bool:
        """A push of ``job`` failed after ``took_s``: True if it is to be sent again. Not when its job failed
        otherwise, nor after a wait of half ``io_timeout_s`` or more: a silent peer (a host cut off) would keep the
        engine waiting as long again, where a reset or an error answer fails at once."""
        if job.error is not None or took_s >= self.io_timeout_s / 2:
            return False
        self.push_retries += 1
        log.warning("a push of %s failed, sending it again: %s", job.request_id, error)
        return True

    def _settle(self) -> None:
        """Wait for every push started so far; a failed one is sent again once, a second failure fails its job."""
        if self._staging is not None:
            self._staging.drain()
        with self._lock:
            pushes, self._pushes = self._pushes, []
        for push in pushes:
            while True:
                try:
                    push.batch.wait(self.io_timeout_s)
                    break
                except TransferError as e:
                    took = (push.batch.finished_at or time.monotonic()) - push.batch.started_at
                    if push.attempts >= PUSH_ATTEMPTS or not self._retrying(push.job, e, took):
                        push.job.fail(e)
                        break
                try:  # wait() returned: no backend touches the buffer any more, so it can be sent again
                    push.batch, push.attempts = self.transfer.write(push.local, push.slices), push.attempts + 1
                except TransferError as again:
                    push.job.fail(again)
                    break
        self.link.settled([(p.batch, p.slices) for p in pushes])
        for job in self._unsettled:
            if job.error is None:
                job.pushed = job.issued
        self._unsettled.clear()


class HostStaging:
    """Copies of cache blocks from a device to pinned host memory off the compute stream, and a thread that hands
    each copy on once it has landed.

        engine thread (per layer):  side stream waits for the layer's compute -> gather blocks -> copy to pinned host
                                    (non-blocking) -> record an event -> queue (event, host tensor, then)
        staging thread:             event.synchronize() -> then(host tensor)   (the transfer-engine writes)

    so layer l's copy and push overlap layer l + 1's compute. On the CPU (tests) the same path runs with plain copies.
    ``drain`` (end of the step) waits until every queued copy was handed on.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        self._queue: queue.Queue = queue.Queue()
        threading.Thread(target=self._run, name="kv-staging", daemon=True).start()

    def submit(self, cache: torch.Tensor, block_ids: list[int], then: Callable[[torch.Tensor], None]) -> None:
        """Copy blocks ``block_ids`` of one layer's cache [2, num_blocks, bs, Hkv, D] to host as [2, n, bs, Hkv, D] (K
        of consecutive blocks contiguous, as in a decode engine's cache); call ``then`` with it (on the staging
        thread) once it is there."""
        if not self.cuda:
            self._queue.put((None, cache.index_select(1, torch.tensor(block_ids, dtype=torch.long)), then))
            return
        ready = torch.cuda.current_stream(self.device).record_event()  # this layer's K/V are written
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(ready)
            # from pinned memory: a copy from pageable memory would first wait for this stream, i.e. for the layer's
            # compute, and the engine thread could no longer queue the next layers ahead of the GPU
            idx = torch.tensor(block_ids, dtype=torch.long).pin_memory().to(self.device, non_blocking=True)
            gathered = cache.index_select(1, idx)  # [2, n, bs, Hkv, D], contiguous
            host = torch.empty(gathered.shape, dtype=gathered.dtype, pin_memory=True)
            host.copy_(gathered, non_blocking=True)
            done = self.stream.record_event()
        self._queue.put((done, host, then))

    def copy_to(self, cache: torch.Tensor, block_ids: list[int], dest: torch.Tensor, dest_ids: list[int]) -> None:
        """Copy blocks ``block_ids`` of one layer's cache [2, num_blocks, bs, Hkv, D] into blocks ``dest_ids`` of
        another cache's same layer (a decode engine's, mapped by CUDA IPC), device to device on the side stream;
        ``drain`` waits for it too."""
        if not self.cuda:  # the same path on the CPU (tests): a plain copy
            copy_blocks(dest.transpose(0, 1), dest_ids, cache.transpose(0, 1), block_ids)
            return
        ready = torch.cuda.current_stream(self.device).record_event()
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(ready)
            src = torch.tensor(block_ids, dtype=torch.long).pin_memory().to(self.device, non_blocking=True)
            dst = torch.tensor(dest_ids, dtype=torch.long).pin_memory().to(dest.device, non_blocking=True)
            as_bytes(dest).index_copy_(1, dst, as_bytes(cache.index_select(1, src)).to(dest.device, non_blocking=True))
            done = self.stream.record_event()
        self._queue.put((done, None, None))

    def drain(self) -> None:
        self._queue.join()

    def _run(self) -> None:
        while True:
            done, host, then = self._queue.get()
            try:
                if done is not None:
                    done.synchronize()
                if then is not None:
                    then(host)  # it fails its own job on an error
            finally:
                self._queue.task_done()


class PoolWriter:
    """Writes finished prefills' new blocks into their reserved pool slots after the first token is out, from the
    engine's cache blocks, which the engine keeps for it meanwhile (``PoolConnector.request_finished``).

        engine thread:  submit(job, [(cache block, pool slot)], the request's blocks)   (a CUDA event marks the KV done)
        writer thread:  CPU: cache -> pool slots (shared memory), a copy per run of consecutive blocks
                        CUDA: one gather on a side stream -> pinned host -> pool slots
                        then hand the blocks back to the engine (release) and tell the job (on_stored)

    A write that fails costs the pool these blocks (``on_stored(False)``: the reservation is aborted), never a request.
    """

    def __init__(
        self, kv_cache: torch.Tensor, pool: torch.Tensor, first_layer: int, release: Callable[[list[int]], None]
    ) -> None:
        self.kv_cache, self.pool, self.release = kv_cache, pool, release
        self.layers = slice(first_layer, first_layer + kv_cache.shape[0])
        self.cuda = kv_cache.device.type == "cuda"
        self.stream = torch.cuda.Stream(kv_cache.device) if self.cuda else None
        self._queue: queue.Queue = queue.Queue()
        threading.Thread(target=self._run, name="kv-pool-writer", daemon=True).start()

    def submit(self, job: PrefillJob, pairs: list[tuple[int, int]], block_ids: list[int]) -> None:
        ready = torch.cuda.current_stream(self.kv_cache.device).record_event() if self.cuda else None
        self._queue.put((job, pairs, block_ids, ready))

    def flush(self, timeout: float | None = None) -> bool:
        q = self._queue
        with q.all_tasks_done:
            return q.all_tasks_done.wait_for(lambda: q.unfinished_tasks == 0, timeout)

    def _run(self) -> None:
        while True:
            job, pairs, block_ids, ready = self._queue.get()
            ok = False
            try:
                if SLOW_WRITE_S:
                    time.sleep(SLOW_WRITE_S)  # a test's fault (SLOW_WRITE_ENV)
                self._write(pairs, ready)
                ok = True
            except Exception:  # noqa: BLE001 - a lost cache entry, never a lost request
                log.exception(
                    "writing %d blocks of %s into the pool failed: they are not stored", len(pairs), job.request_id
                )
            finally:
                self.release(block_ids)
                if job.on_stored is not None:
                    try:
                        job.on_stored(ok)
                    except Exception:  # noqa: BLE001
                        log.exception("finishing the pool write of %s failed", job.request_id)
                self._queue.task_done()

    @torch.inference_mode()
    def _write(self, pairs: list[tuple[int, int]], ready) -> None:
        blocks, slots = [b for b, _ in pairs], [s for _, s in pairs]
        pool = self.pool[:, self.layers]  # [slots, L, 2, bs, Hkv, D]
        if not self.cuda:
            copy_blocks(pool, slots, self.kv_cache.permute(2, 0, 1, 3, 4, 5), blocks)
            return
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(ready)
            src = torch.tensor(blocks, dtype=torch.long, device=self.kv_cache.device)
            gathered = self.kv_cache.index_select(2, src)  # [L, 2, n, bs, Hkv, D]
            host = torch.empty(gathered.shape, dtype=gathered.dtype, pin_memory=True)
            host.copy_(gathered, non_blocking=True)
            done = self.stream.record_event()
        done.synchronize()
        copy_blocks(pool, slots, host.permute(2, 0, 1, 3, 4, 5), range(len(pairs)))
