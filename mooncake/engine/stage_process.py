"""Chunked pipeline parallelism across processes: each stage a process, a chunk's hidden states through the transfer
engine into the next stage's inbox (shm on one host, tcp across hosts), control messages over pipes.

    driver --plan--> stage 0 --hidden (transfer engine) + "chunk k in slot s" (pipe)--> stage 1 --> ...
                     stage 0 <--"slot s is free" (pipe)----------------------------------- stage 1
    driver <--first token (and, when asked, each stage's KV)-------------------------- every stage

Each stage allocates an inbox segment of ``SLOTS`` chunk-sized slots; a sender writes
chunk k into slot k % SLOTS once the receiver has freed it (the receiver copies a slot
out before it computes), so a stage computes chunk k + 1 while the next one computes
chunk k. Each stage process computes with one thread (``torch.set_num_threads(1)``).

A prefill worker group (``prefill/group.py``) sends each request with a ``StagePush``:
every stage then reads its layers of the reused prefix from the pool node's segment and
pushes its layers' KV, layer by layer as they are computed, to the decode worker's
landing slots and into the pool slots reserved for the new blocks (``PoolConnector``
bound to the stage's cache, at the layers' global offsets). A push that fails (the
decode worker went away) fails that request only: the stages compute the rest of it and
the pipeline serves the next one. A stage that raises or dies fails the pipeline.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import uuid
from dataclasses import dataclass, replace

import torch

from mooncake.engine.pipeline import PipelinePrefill
from mooncake.engine.request import SamplingParams
from transfer.types import Segment

SLOTS = 2  # chunks in flight between two stages


@dataclass(frozen=True, slots=True)
class StageSpec:
    model_dir: str
    layers: range
    num_blocks: int
    block_size: int
    max_model_len: int
    max_chunk: int  # tokens: sizes the inbox slots
    shm_dir: str = "/dev/shm/mooncake"
    dtype: torch.dtype = torch.float32
    device: str = "cpu"  # cuda[:N]: the stage's layers and cache on that GPU (hidden states cross through the host)


@dataclass(frozen=True, slots=True)
class StagePush:
    """Where a prefill's KV goes (and its reused prefix comes from), for every stage to do its layers' part."""

    landing: Segment  # the decode worker's landing segment
    landing_offsets: list[int]  # one per prompt block
    pool: Segment | None = None  # the pool node's DRAM segment
    pool_slots: dict[int, int] | None = None  # block index -> slot reserved in it for a new full block
    prefix_slots: list[int] | None = None  # the reused prefix's blocks, in order: their slots in it
    io_timeout_s: float = 30.0


@dataclass(frozen=True, slots=True)
class StageRequest:
    request_id: str
    prompt: list[int]  # every token to run: a resumed stream's earlier outputs are its last ``num_outputs``
    params: SamplingParams
    chunk: int
    num_outputs: int = 0
    export: bool = False
    prefix_kv: torch.Tensor | None = None  # this stage's layers of the prefix (or every layer, from the caller)
    num_prefix_tokens: int = 0
    push: StagePush | None = None


class PushFailed(RuntimeError):
    """A stage could not push the request's KV (the decode worker or the pool node went away); the pipeline is fine."""


class ProcessPipeline:
    """X stage processes (``specs`` in layer order). One prefill at a time; :meth:`close` ends the processes, and a
    prefill that fails (a stage raised, or died) closes them too, after every stage has answered."""

    def __init__(self, specs: list[StageSpec], start_timeout_s: float = 300.0) -> None:
        ctx = mp.get_context("spawn")
        self._specs = specs
        self._closed = False
        self._procs, self._drivers = [], []
        links = [ctx.Pipe() for _ in range(len(specs) - 1)]  # forward: "chunk k in slot s"
        acks = [ctx.Pipe() for _ in range(len(specs) - 1)]  # backward: "slot s is free"
        for i, spec in enumerate(specs):
            mine, theirs = ctx.Pipe()
            prev_in = links[i - 1][1] if i else None
            next_out = links[i][0] if i + 1 < len(specs) else None
            ack_out = acks[i - 1][0] if i else None
            ack_in = acks[i][1] if i + 1 < len(specs) else None
            proc = ctx.Process(target=_stage_main, args=(i, len(specs), spec, theirs, prev_in, next_out, ack_out, ack_in),
                               name=f"cpp-stage-{i}", daemon=True)  # fmt: skip
            proc.start()
            self._procs.append(proc)
            self._drivers.append(mine)
        segments = []
        for i, conn in enumerate(self._drivers):
            if not conn.poll(start_timeout_s):
                self.close()
                raise RuntimeError(f"pipeline stage {i} did not start within {start_timeout_s} s")
            segments.append(_reply(conn))
        for i, conn in enumerate(self._drivers[:-1]):
            conn.send(("next_inbox", segments[i + 1]))  # where stage i writes its hidden states

    def prefill(self, request: StageRequest, timeout_s: float = 3600.0) -> PipelinePrefill:
        """The request's first token (and its logprobs, when asked) and, with ``export``, its KV in the pool layout.

        ``prefix_kv`` [n, L, 2, bs, Hkv, D] holds the KV of its first ``num_prefix_tokens`` (a reused prefix): each
        stage gets its layers of it (with a ``push``, each reads its layers from the pool's ``prefix_slots``
        instead), and the chunks start after it. Raises PushFailed (the request failed; the pipeline serves the
        next), RuntimeError (a stage failed or died: the pipeline is closed).
        """
        if not 0 <= request.num_prefix_tokens < len(request.prompt):
            raise ValueError(f"num_prefix_tokens must be in [0, {len(request.prompt) - 1}], got {request.num_prefix_tokens}")
        if self.closed:
            raise RuntimeError("the pipeline is closed: a stage failed")
        for spec, conn in zip(self._specs, self._drivers):
            prefix = request.prefix_kv
            if prefix is not None and request.num_prefix_tokens:
                prefix = prefix[:, spec.layers.start : spec.layers.stop]
            try:
                conn.send(("prefill", replace(request, prefix_kv=prefix)))
            except (BrokenPipeError, OSError):
                self.close()
                raise RuntimeError("a pipeline stage died") from None
        replies, errors = [], []
        for i, conn in enumerate(self._drivers):
            if not conn.poll(timeout_s):
                errors.append(f"stage {i} did not answer within {timeout_s} s")
                break
            try:
                replies.append(_reply(conn))
            except RuntimeError as e:
                errors.append(str(e))
        if errors:  # every stage answered (or one hung): the pipeline is closed, a new one serves the next prefill
            self.close()
            raise RuntimeError("; ".join(errors))
        pushes = [f"stage {i}: {r.push_error}" for i, r in enumerate(replies) if r.push_error]
        if pushes:
            raise PushFailed("; ".join(pushes))
        last = replies[-1]
        kv = torch.cat([r.kv for r in replies], dim=1) if request.export else None
        return PipelinePrefill(last.token, kv, last.logprob, last.prompt_logprobs)

    @property
    def closed(self) -> bool:
        return self._closed

    def alive(self) -> list[bool]:
        """Whether each stage's process is running."""
        return [p.is_alive() for p in self._procs]

    def pids(self) -> list[int | None]:
        return [p.pid for p in self._procs]

    def close(self) -> None:
        self._closed = True
        for conn in self._drivers:
            try:
                conn.send(("stop",))
            except (BrokenPipeError, OSError):
                pass
        for proc in self._procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()


class _Aborted(Exception):
    """A neighbouring stage failed this prefill."""


def _reply(conn):
    try:
        kind, *payload = conn.recv()
    except (EOFError, OSError):
        raise RuntimeError("a pipeline stage died") from None
    if kind == "error":
        raise RuntimeError(f"a pipeline stage failed: {payload[0]}")
    return payload[0] if len(payload) == 1 else payload


@dataclass(slots=True)
class _Reply:
    token: int | None = None
    logprob: object = None
    prompt_logprobs: list | None = None
    kv: torch.Tensor | None = None
    push_error: str | None = None


def _stage_main(index, num_stages, spec: StageSpec, driver, prev_in, next_out, ack_out, ack_in) -> None:
    torch.set_num_threads(1)
    from mooncake.engine.stage import PipelineStage
    from prefill.connector import PoolConnector
    from transfer import TransferConfig, TransferEngine

    try:
        tokenizer = None
        if index == num_stages - 1:
            from prefill.worker import _tokenizer

            tokenizer = _tokenizer(spec.model_dir)
        stage = PipelineStage(spec.model_dir, spec.layers, num_blocks=spec.num_blocks, block_size=spec.block_size,
                              max_model_len=spec.max_model_len, tokenizer=tokenizer, device=spec.device, dtype=spec.dtype)  # fmt: skip
        engine = TransferEngine(TransferConfig(node=f"cpp{index}-{os.getpid()}-{uuid.uuid4().hex[:6]}", serve=False,
                                               shm_dir=spec.shm_dir))  # fmt: skip
        connector = PoolConnector(engine, None, spec.block_size, io_timeout_s=30.0)
        connector.bind(stage.kv_cache, first_layer=stage.layers.start, num_layers=stage.model.args.num_layers)
        slot_bytes = spec.max_chunk * stage.model.args.hidden_size * stage.kv_cache.element_size()
        inbox = engine.allocate("inbox", slot_bytes * SLOTS) if index else None
        driver.send(("ready", inbox))
        next_inbox = None
        if next_out is not None:
            _, next_inbox = driver.recv()
            engine.add_segment(next_inbox)
        link = _Link(index, engine, slot_bytes, prev_in, next_out, ack_out, ack_in, next_inbox)
    except BaseException as e:  # noqa: BLE001 - the driver reports it
        driver.send(("error", f"stage {index} could not start: {e!r}"))
        return
    while True:
        msg = driver.recv()
        if msg[0] == "stop":
            engine.close()
            return
        request: StageRequest = msg[1]
        try:
            driver.send(("done", _serve(stage, request, link, connector, index == num_stages - 1)))
        except BaseException as e:  # noqa: BLE001 - the driver reports it
            if not isinstance(e, _Aborted):  # tell the neighbours, so that none waits for this stage forever
                link.abort()
            driver.send(("error", f"stage {index}: {e!r}"))
            return  # a failed pipeline is closed by its driver: its pipes may hold a dead request's messages
        finally:
            connector.jobs.pop(request.request_id, None)
            stage.release(request.request_id)


class _Link:
    """A stage's ends of the pipeline: chunks in from the previous stage's writes into this stage's inbox, chunks
    out into the next stage's inbox (``SLOTS`` of them, each freed by the receiver's ack)."""

    def __init__(self, index, engine, slot_bytes, prev_in, next_out, ack_out, ack_in, next_inbox) -> None:
        self.index, self.engine, self.slot_bytes = index, engine, slot_bytes
        self.prev_in, self.next_out, self.ack_out, self.ack_in = prev_in, next_out, ack_out, ack_in
        self.next_inbox = next_inbox
        self.inbox = engine.buffer("inbox") if index else None
        self.free: list[int] = []

    def start(self) -> None:
        self.free = list(range(SLOTS))

    def receive(self, k: int, n: int, hidden_size: int, dtype: torch.dtype) -> torch.Tensor:
        kind, got_k, slot = self.prev_in.recv()
        if kind != "chunk" or got_k != k:
            if kind == "abort":
                raise _Aborted(f"stage {self.index - 1} failed")
            raise RuntimeError(f"stage {self.index} expected chunk {k}, got {kind} {got_k}")
        raw = torch.frombuffer(self.inbox, dtype=dtype, count=n * hidden_size, offset=slot * self.slot_bytes)
        out = raw.view(n, hidden_size).clone()
        self.ack_out.send(slot)  # copied out: the previous stage may reuse it
        return out

    def send(self, k: int, hidden: torch.Tensor) -> None:
        from transfer import Slice

        while not self.free:
            self.free.append(self._ack())
        slot = self.free.pop(0)
        data = hidden.contiguous().cpu()
        size = data.numel() * data.element_size()
        self.engine.write(memoryview(data.numpy()).cast("B"), [Slice(0, self.next_inbox.name, slot * self.slot_bytes, size)]).wait(timeout=60)
        self.next_out.send(("chunk", k, slot))

    def drain(self) -> None:
        """Wait until the next stage copied out every chunk sent to it."""
        while len(self.free) < SLOTS:
            self.free.append(self._ack())

    def _ack(self) -> int:
        slot = self.ack_in.recv()
        if slot < 0:
            raise _Aborted(f"stage {self.index + 1} failed")
        return slot

    def abort(self) -> None:
        if self.next_out is not None:
            self.next_out.send(("abort", -1, -1))
        if self.ack_out is not None:
            self.ack_out.send(-1)


def _serve(stage, request: StageRequest, link: _Link, connector, is_last: bool) -> _Reply:
    """Run one request's chunks through this stage (see the module docstring)."""
    from mooncake.engine.pipeline import chunk_bounds
    from prefill.connector import PrefillJob

    rid, prompt, push = request.request_id, request.prompt, request.push
    job = None
    if push is not None:
        link.engine.add_segment(push.landing)
        if push.pool is not None:
            link.engine.add_segment(push.pool)
        job = PrefillJob(rid, len(prompt), -(-len(prompt) // stage.block_size), push.landing.name, list(push.landing_offsets),
                         pool_slots=dict(push.pool_slots or {}), pool_segment=push.pool.name if push.pool else None)  # fmt: skip
        connector.io_timeout_s = push.io_timeout_s
        connector.jobs[rid] = job
    if request.num_prefix_tokens:
        prefix = request.prefix_kv
        if push is not None and push.prefix_slots:
            prefix = _read_prefix(stage, link.engine, push)
        stage.import_prefix(rid, prefix, request.num_prefix_tokens)
    hidden_size = stage.model.args.hidden_size
    top = request.params.prompt_logprobs
    prompt_logprobs: list = []
    link.start()
    last = None
    for k, (a, b) in enumerate(chunk_bounds(request.num_prefix_tokens, len(prompt), request.chunk)):
        if link.index == 0:
            out = stage.run_chunk(rid, a, token_ids=prompt[a:b], connector=connector)
        else:
            out = stage.run_chunk(rid, a, hidden=link.receive(k, b - a, hidden_size, stage.kv_cache.dtype), connector=connector)
        if link.next_out is not None:
            link.send(k, out)
        elif top is not None:
            prompt_logprobs.extend(e for _, e in stage.prompt_logprobs(out, a, prompt, top))
        last = out
    if link.next_out is not None:
        link.drain()
    reply = _Reply(push_error=repr(job.error) if job is not None and job.error is not None else None)
    if is_last:
        split = len(prompt) - request.num_outputs
        reply.token, reply.logprob = stage.sample_first(last[-1], request.params, prompt[:split], prompt[split:])
        reply.prompt_logprobs = prompt_logprobs if top is not None else None
    if request.export:
        reply.kv = stage.export(rid)
    return reply


def _read_prefix(stage, engine, push: StagePush) -> torch.Tensor:
    """This stage's layers of the prefix blocks in the pool, [n, local L, 2, bs, Hkv, D] (one read per block: a
    block's layers are contiguous in the pool layout)."""
    from transfer import Slice

    local = stage.kv_cache.shape
    kv = torch.empty(len(push.prefix_slots), local[0], 2, *local[3:], dtype=stage.kv_cache.dtype)
    layer_bytes = kv[0, 0].numel() * kv.element_size()
    block_bytes = stage.model.args.num_layers * layer_bytes
    size = len(stage.layers) * layer_bytes
    slices = [Slice(i * size, push.pool.name, slot * block_bytes + stage.layers.start * layer_bytes, size)
              for i, slot in enumerate(push.prefix_slots)]  # fmt: skip
    engine.read(memoryview(kv.numpy()).cast("B"), slices).wait(timeout=push.io_timeout_s)
    return kv
