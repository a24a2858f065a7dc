"""Chunked pipeline parallelism across processes and hosts: each stage a process, a chunk's hidden states through the
transfer engine into the next stage's inbox (shm on one host, tcp across hosts), control messages over connections.

    driver --request--> stage 0 --hidden (transfer engine) + "chunk k in slot s"--> stage 1 --> ...
                        stage 0 <--"slot s is free"------------------------------- stage 1
    driver <--first token (and, when asked, each stage's KV)-------------------- every stage

Each stage allocates an inbox segment of ``SLOTS`` chunk-sized slots; a sender writes
chunk k into slot k % SLOTS once the receiver has freed it (the receiver copies a slot
out before it computes), so a stage computes chunk k + 1 while the next one computes
chunk k. Each stage process computes with one thread (``torch.set_num_threads(1)``).

Stages are spawned by the driver (``ProcessPipeline(specs)``: processes on this host), or
run as stage servers on their own nodes (``python -m prefill.stage``, one per stage) that
the driver dials (``ProcessPipeline.connect(addresses, authkey)``). Either way a stage
serves a *session*: the driver says hello (the stage's place in the pipeline), each stage
answers with its layers, its inbox and the address its previous stage dials; the driver
tells each stage where the next one is; the stages connect to their neighbours
(``multiprocessing.connection`` over tcp, authenticated by the pipeline's key); then
prefills. A session ends when the driver stops it or a stage fails; a stage server then
waits for the next session (a spawned stage exits).

A prefill worker group (``prefill/group.py``) sends each request with a ``StagePush``:
every stage then reads its layers of the reused prefix from the pool node's segment and
pushes its layers' KV, layer by layer as they are computed, to the decode worker's
landing slots and into the pool slots reserved for the new blocks (``PoolConnector``
bound to the stage's cache, at the layers' global offsets). A push that fails (the
decode worker went away) fails that request only: the stages compute the rest of it and
the pipeline serves the next one. A stage that raises or dies fails the pipeline.
"""

from __future__ import annotations

import hashlib
import hmac
import multiprocessing as mp
import os
import time
import uuid
from dataclasses import dataclass, replace

import torch

from mooncake.blocks import blocks_for
from mooncake.engine.pipeline import PipelinePrefill
from mooncake.engine.request import SamplingParams
from mooncake.serving.kvlayout import tensor_bytes
from transfer.engine import SHM_DIR
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
    shm_dir: str = SHM_DIR
    dtype: torch.dtype = torch.float32
    device: str = "cpu"  # cuda[:N]: the stage's layers and cache on that GPU (hidden states cross through the host)
    host: str = "127.0.0.1"  # the address its transfer server and its link listener bind (and peers dial)


@dataclass(frozen=True, slots=True)
class StagePush:
    """Where a prefill's KV goes (and its reused prefix comes from), for every stage to do its layers' part."""

    landing: Segment  # the decode worker's landing segment
    landing_offsets: list[int]  # one per prompt block
    pool: Segment | None = None  # the pool node's DRAM segment
    pool_slots: dict[int, int] | None = None  # block index -> slot reserved in it for a new full block
    prefix_slots: list[int] | None = None  # the reused prefix's blocks, in order: their slots in it
    io_timeout_s: float = 30.0
    pool_token: str = ""  # the reservation of pool_slots: the pool node's tcp server checks it (BlockStore.authorize)
    prefix_tokens: list[str] | None = None  # the lease (or fetch reservation) holding each of prefix_slots
    landing_token: str = ""  # the decode worker's grant of the landing slots
    landing_blocks: list[int] | None = None  # set: blocks of the decode engine's cache (its segment), not slots
    landing_num_blocks: int = 0  # that cache's blocks


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
    """X stages in layer order, driven one prefill at a time: spawned here (``ProcessPipeline(specs)``) or stage servers
    dialled (:meth:`connect`). :meth:`close` ends the session (and spawned processes); a prefill that fails (a stage
    raised, or died) closes it too, after every stage has answered."""

    def __init__(self, specs: list[StageSpec], start_timeout_s: float = 300.0) -> None:
        ctx = mp.get_context("spawn")
        self._authkey = os.urandom(16)
        self._procs, drivers = [], []
        for i, spec in enumerate(specs):
            mine, theirs = ctx.Pipe()
            proc = ctx.Process(
                target=_spawned_stage,
                args=(i, len(specs), spec, theirs, self._authkey),
                name=f"cpp-stage-{i}",
                daemon=True,
            )
            proc.start()
            self._procs.append(proc)
            drivers.append(mine)
        self._start(drivers, start_timeout_s)

    @classmethod
    def connect(cls, addresses: list[tuple[str, int]], authkey: bytes, timeout_s: float = 60.0) -> "ProcessPipeline":
        """Start a session with the stage servers at ``addresses`` (in layer order). Raises RuntimeError when one
        cannot be reached (or refuses the key) within ``timeout_s``."""
        self = cls.__new__(cls)
        self._authkey, self._procs = authkey, []
        drivers = []
        try:
            for i, address in enumerate(addresses):
                drivers.append(_dial(address, authkey, timeout_s, f"stage {i}"))
        except RuntimeError:
            for conn in drivers:
                conn.close()
            raise
        self._start(drivers, timeout_s)
        return self

    def _start(self, drivers: list, timeout_s: float) -> None:
        self._drivers, self._closed = drivers, False
        n = len(drivers)
        try:
            for i, conn in enumerate(drivers):
                conn.send(("hello", i, n))
            infos = [self._answer(i, conn, timeout_s, "start") for i, conn in enumerate(drivers)]
            self.layers = [info["layers"] for info in infos]
            if self.layers[0].start != 0 or any(a.stop != b.start for a, b in zip(self.layers, self.layers[1:])):
                raise RuntimeError(f"the stages' layers do not tile the model: {self.layers}")
            if self.layers[-1].stop != infos[-1]["num_layers"]:
                raise RuntimeError(f"the last stage ends at layer {self.layers[-1].stop} of {infos[-1]['num_layers']}")
            for i, conn in enumerate(drivers[:-1]):
                conn.send(("next", infos[i + 1]["inbox"], infos[i + 1]["link"]))  # where stage i sends its chunks
            for i, conn in enumerate(drivers):
                self._answer(i, conn, timeout_s, "link up")
        except (RuntimeError, OSError, EOFError) as e:
            self.close()
            raise RuntimeError(f"the pipeline did not start: {e}") from None

    def _answer(self, i: int, conn, timeout_s: float, what: str):
        if not conn.poll(timeout_s):
            raise RuntimeError(f"stage {i} did not {what} within {timeout_s} s")
        return _reply(conn)

    def prefill(self, request: StageRequest, timeout_s: float = 3600.0) -> PipelinePrefill:
        """The request's first token (and its logprobs, when asked) and, with ``export``, its KV in the pool layout.

        ``prefix_kv`` [n, L, 2, bs, Hkv, D] holds the KV of its first ``num_prefix_tokens`` (a reused prefix): each
        stage gets its layers of it (with a ``push``, each reads its layers from the pool's ``prefix_slots``
        instead), and the chunks start after it. Raises PushFailed (the request failed; the pipeline serves the
        next), RuntimeError (a stage failed or died: the pipeline is closed).
        """
        if not 0 <= request.num_prefix_tokens < len(request.prompt):
            raise ValueError(
                f"num_prefix_tokens must be in [0, {len(request.prompt) - 1}], got {request.num_prefix_tokens}"
            )
        if self.closed:
            raise RuntimeError("the pipeline is closed: a stage failed")
        for layers, conn in zip(self.layers, self._drivers):
            prefix = request.prefix_kv
            if prefix is not None and request.num_prefix_tokens:
                prefix = prefix[:, layers.start : layers.stop]
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
        """Whether each stage is there: a spawned stage's process runs; a stage server's session is open."""
        if self._procs:
            return [p.is_alive() for p in self._procs]
        return [not self._closed] * len(self._drivers)

    def idle_ok(self) -> bool:
        """Between prefills (no answer is due): every stage is alive and none hung up (a hung-up connection reads as
        ready, at its end)."""
        if self._closed or not all(self.alive()):
            return False
        try:
            return not any(conn.poll(0) for conn in self._drivers)
        except (OSError, EOFError):
            return False

    def pids(self) -> list[int | None]:
        return [p.pid for p in self._procs] or [None] * len(self._drivers)

    def close(self) -> None:
        self._closed = True
        for conn in self._drivers:
            try:
                conn.send(("stop",))
            except (BrokenPipeError, OSError):
                pass
            if not self._procs:
                conn.close()
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


def _spawned_stage(index: int, num_stages: int, spec: StageSpec, driver, authkey: bytes) -> None:
    """A stage spawned by its driver: one session, then the process ends."""
    try:
        runtime = StageRuntime(spec, authkey)
    except BaseException as e:  # noqa: BLE001 - the driver reports it
        driver.recv()  # the hello
        driver.send(("error", f"stage {index} could not start: {e!r}"))
        return
    runtime.session(driver, (index, num_stages))
    runtime.close()


def _dial(address: tuple[str, int], authkey: bytes, timeout_s: float, who: str):
    """A connection to ``address`` (retried until ``timeout_s``: a stage server may be starting)."""
    from multiprocessing.connection import AuthenticationError, Client

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return Client(tuple(address), authkey=authkey)
        except AuthenticationError:
            raise RuntimeError(f"{who} at {address[0]}:{address[1]} refused the pipeline's key") from None
        except OSError as e:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{who} at {address[0]}:{address[1]} cannot be reached: {e}") from None
            time.sleep(0.2)


class StageRuntime:
    """What a stage keeps across sessions: its layers and cache, its transfer engine and inbox, its connector, and the
    listener its previous stage dials."""

    def __init__(self, spec: StageSpec, authkey: bytes) -> None:
        from multiprocessing.connection import Listener

        from mooncake.engine.loader import load_hf_config
        from mooncake.engine.model_args import ModelArgs
        from mooncake.engine.stage import PipelineStage
        from prefill.connector import PoolConnector
        from transfer import TransferConfig, TransferEngine

        torch.set_num_threads(1)
        self.authkey = authkey
        args = ModelArgs.from_hf_config(load_hf_config(spec.model_dir))
        tokenizer = None
        if spec.layers.stop == args.num_layers:  # the last stage samples: a grammar needs the tokenizer
            from mooncake.engine.tokenizer import tokenizer_or_none

            tokenizer = tokenizer_or_none(spec.model_dir)
        self.stage = PipelineStage(
            spec.model_dir,
            spec.layers,
            num_blocks=spec.num_blocks,
            block_size=spec.block_size,
            max_model_len=spec.max_model_len,
            tokenizer=tokenizer,
            device=spec.device,
            dtype=spec.dtype,
        )
        self.engine = TransferEngine(
            TransferConfig(
                node=f"cpp-{os.getpid()}-{uuid.uuid4().hex[:6]}", shm_dir=spec.shm_dir, listen_host=spec.host
            )
        )
        self.connector = PoolConnector(self.engine, None, spec.block_size, io_timeout_s=30.0)
        self.connector.bind(self.stage.kv_cache, first_layer=self.stage.layers.start, num_layers=args.num_layers)
        self.slot_bytes = spec.max_chunk * args.hidden_size * self.stage.kv_cache.element_size()
        self.inbox = self.engine.allocate("inbox", self.slot_bytes * SLOTS, guard=_inbox_guard(inbox_token(authkey)))
        self.links = Listener((spec.host, 0), authkey=authkey)

    def session(self, driver, expected: tuple[int, int] | None = None) -> None:
        """Serve one driver until it stops the session or a prefill fails here."""
        from multiprocessing.connection import Client

        prev = nxt = None
        try:
            kind, index, num_stages = driver.recv()
            if expected is not None and (index, num_stages) != expected:
                driver.send(
                    ("error", f"this stage serves as stage {expected[0]} of {expected[1]}, not {index} of {num_stages}")
                )
                return
            driver.send(
                (
                    "ready",
                    {
                        "layers": self.stage.layers,
                        "num_layers": self.stage.model.args.num_layers,
                        "inbox": self.inbox,
                        "link": self.links.address,
                    },
                )
            )
            next_inbox = None
            if index + 1 < num_stages:
                _, next_inbox, address = driver.recv()
                self.engine.add_segment(next_inbox)
                nxt = Client(address, authkey=self.authkey)
            if index:
                prev = self.links.accept()
            driver.send(("linked", None))
        except (EOFError, OSError) as e:  # the driver (or a neighbour) went away while starting
            _close_all(prev, nxt)
            try:
                driver.send(("error", f"stage could not link up: {e!r}"))
            except OSError:
                pass
            return
        link = _Link(
            index,
            self.engine,
            self.slot_bytes,
            prev,
            nxt,
            next_inbox,
            self.engine.buffer("inbox"),
            inbox_token(self.authkey),
        )
        try:
            self._serve(driver, link, index == num_stages - 1)
        finally:
            _close_all(prev, nxt)

    def _serve(self, driver, link: "_Link", is_last: bool) -> None:
        while True:
            try:
                msg = driver.recv()
            except (EOFError, OSError):
                return  # the driver went away
            if msg[0] == "stop":
                return
            request: StageRequest = msg[1]
            try:
                driver.send(("done", _serve(self.stage, request, link, self.connector, is_last)))
            except BaseException as e:  # noqa: BLE001 - the driver reports it
                if not isinstance(e, _Aborted):  # tell the neighbours, so that none waits for this stage forever
                    link.abort()
                try:
                    driver.send(("error", f"stage {link.index}: {e!r}"))
                except OSError:
                    pass
                return  # a failed session ends: its connections may hold a dead request's messages
            finally:
                self.connector.request_finished(request.request_id, [])  # its pushes end before its blocks go
                self.connector.jobs.pop(request.request_id, None)
                self.stage.release(request.request_id)

    def close(self) -> None:
        self.links.close()
        self.engine.close()


def _close_all(*conns) -> None:
    for conn in conns:
        if conn is not None:
            conn.close()


def inbox_token(authkey: bytes) -> str:
    """The capability a group's stages write each other's inboxes with: derived from the group's key, which only
    its worker and its stages hold."""
    return hmac.new(authkey, b"mooncake stage inbox", hashlib.sha256).hexdigest()[:32]


def _inbox_guard(expected: str):
    def guard(token: str, write: bool, offset: int, length: int) -> str | None:
        return None if hmac.compare_digest(token.encode(), expected.encode()) else "not a stage of this group"

    return guard


class _Link:
    """A stage's ends of the pipeline: ``prev`` brings chunk notices from the previous stage (whose writes land in this
    stage's inbox) and takes back "slot s is free"; ``next`` takes this stage's chunk notices to the next stage (after
    the hidden states were written into its inbox, ``SLOTS`` slots, each reused once freed)."""

    def __init__(self, index, engine, slot_bytes, prev, next_, next_inbox, inbox, token: str) -> None:
        self.index, self.engine, self.slot_bytes = index, engine, slot_bytes
        self.prev, self.next, self.next_inbox, self.inbox = prev, next_, next_inbox, inbox
        self.token = token  # the group's: the next stage's transfer server takes inbox writes only with it
        self.free: list[int] = []

    def start(self) -> None:
        self.free = list(range(SLOTS))

    def receive(self, k: int, n: int, hidden_size: int, dtype: torch.dtype) -> torch.Tensor:
        kind, got_k, slot = self.prev.recv()
        if kind != "chunk" or got_k != k:
            if kind == "abort":
                raise _Aborted(f"stage {self.index - 1} failed")
            raise RuntimeError(f"stage {self.index} expected chunk {k}, got {kind} {got_k}")
        raw = torch.frombuffer(self.inbox, dtype=dtype, count=n * hidden_size, offset=slot * self.slot_bytes)
        out = raw.view(n, hidden_size).clone()
        self.prev.send(slot)  # copied out: the previous stage may reuse it
        return out

    def send(self, k: int, hidden: torch.Tensor) -> None:
        from transfer import Slice

        while not self.free:
            self.free.append(self._ack())
        slot = self.free.pop(0)
        data = hidden.contiguous().cpu()
        size = data.numel() * data.element_size()
        self.engine.write(
            tensor_bytes(data), [Slice(0, self.next_inbox.name, slot * self.slot_bytes, size, self.token)]
        ).wait(timeout=60)
        self.next.send(("chunk", k, slot))

    def drain(self) -> None:
        """Wait until the next stage copied out every chunk sent to it."""
        while len(self.free) < SLOTS:
            self.free.append(self._ack())

    def _ack(self) -> int:
        slot = self.next.recv()
        if slot < 0:
            raise _Aborted(f"stage {self.index + 1} failed")
        return slot

    def abort(self) -> None:
        for conn, msg in ((self.next, ("abort", -1, -1)), (self.prev, -1)):
            if conn is not None:
                try:
                    conn.send(msg)
                except OSError:
                    pass


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
        job = PrefillJob(
            rid,
            len(prompt),
            blocks_for(len(prompt), stage.block_size),
            push.landing.name,
            list(push.landing_offsets),
            pool_slots=dict(push.pool_slots or {}),
            pool_segment=push.pool.name if push.pool else None,
            pool_token=push.pool_token,
            landing_token=push.landing_token,
            landing_blocks=push.landing_blocks,
            landing_num_blocks=push.landing_num_blocks,
        )
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
            out = stage.run_chunk(
                rid, a, hidden=link.receive(k, b - a, hidden_size, stage.kv_cache.dtype), connector=connector
            )
        if link.next is not None:
            link.send(k, out)
        elif top is not None:
            prompt_logprobs.extend(e for _, e in stage.prompt_logprobs(out, a, prompt, top))
        last = out
    if link.next is not None:
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
    tokens = push.prefix_tokens or [""] * len(push.prefix_slots)
    slices = [
        Slice(i * size, push.pool.name, slot * block_bytes + stage.layers.start * layer_bytes, size, token)
        for i, (slot, token) in enumerate(zip(push.prefix_slots, tokens))
    ]
    engine.read(tensor_bytes(kv), slices).wait(timeout=push.io_timeout_s)
    return kv
