"""A tensor-parallel engine as one process per rank: rank 0 schedules, the others run its steps' plans.

    engine = LLMEngine(config, tp=tp)     # every rank: its shard of the model, its KV heads' cache
    rank 0:   engine = Leader(engine)     # the engine a worker hosts (mooncake.engine.interface.WorkerEngine): its
                                          # scheduler alone decides; each step's plan and each export of KV go to the
                                          # other ranks first, one broadcast a call (ModelRunner.followers)
    rank r:   follow(engine)              # run rank 0's plans on this rank's shard until it closes

    engine = start_ranks(config, tokenizer)   # all of it: this process rank 0, the others started here; close() ends
                                              # them (EngineConfig.tensor_parallel_size; mooncake.serving.build)

This is vLLM's multiprocessing executor's shape: one scheduler, and what it scheduled broadcast each step. A plan
says, per scheduled request, its new tokens, its block table and whether it samples; the followers keep no requests.
Everything that decides (the scheduler, the prefix cache, a worker's connector holding blocks past an abort, a
decode worker's fence) is rank 0's alone, so nothing from outside can make the ranks decide apart. KV imported into
the cache (a prefix from the pool, a prompt's KV landed from a prefill) is read by rank 0 and sent out by heads
(``TensorParallel.scatter_kv_heads``); an export gathers every rank's heads. Rank 0 of a prefill worker keeps every
KV head of its cache besides, in host memory (``Mirror``: each layer's new KV gathered from the ranks), for its pool
connector, whose pushes then read the pool layout as at one rank: the ranks' KV leaves through rank 0. Every rank's
cache has the same blocks (the least any rank has room for).

The ranks go down together: a follower dies with its leader's process (PR_SET_PDEATHSIG), and a leader whose
follower died (a broadcast or collective fails), or whose step failed once its plan was out (the ranks may no longer
agree), exits at once (``rank_lost``, status ``RANK_LOST_EXIT``) rather than serve on with part of the model gone.
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing as mp
import os
import shutil
import signal
import tempfile
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from mooncake.blocks import blocks_for
from mooncake.engine.connector import ConnectorStep, KVConnector
from mooncake.engine.scheduler import KVImport, ScheduledRequest, SchedulerOutput

log = logging.getLogger(__name__)

STEP, EXPORT, CLOSE = "step", "export", "close"  # what rank 0 sends
COLLECTIVE = ("step", "generate", "export_kv", "computed_blocks")  # rank 0's calls that the other ranks join
RANK_LOST_EXIT = 75  # rank 0's exit status when another rank died (EX_TEMPFAIL: a restart serves again)
START_TIMEOUT_S = 600.0  # the ranks' rendezvous and their models' loading, at most (the start-up group's timeout)
# a follower waits for rank 0's next call as long as the engine is idle: the group never times out on its own, and a
# follower dies with its leader's process instead (PR_SET_PDEATHSIG)
IDLE_TIMEOUT = timedelta(days=3650)
WATCH_S = 0.2  # how often rank 0 looks for a follower's death


def _broadcast(tp, call: list | None) -> list:
    box = [call]
    dist.broadcast_object_list(box, src=0, group=tp.calls if tp.calls is not None else tp.group)
    return box[0]


@dataclass(slots=True)
class _Params:
    prompt_logprobs: int | None


class _Tokens:
    """The tokens of a sequence that one step reads, at their positions in it (``all_token_ids[p]``, a slice)."""

    __slots__ = ("start", "tokens")

    def __init__(self, start: int, tokens: list[int]) -> None:
        self.start, self.tokens = start, tokens

    def __getitem__(self, i):
        if isinstance(i, slice):
            return self.tokens[i.start - self.start : i.stop - self.start]
        return self.tokens[i - self.start]


@dataclass(slots=True)
class _Planned:
    """A scheduled request as a follower's runner reads it: what this step needs of it, nothing kept after."""

    request_id: str
    all_token_ids: _Tokens
    block_ids: list[int]
    num_tokens: int
    num_prompt_tokens: int
    sampling_params: _Params
    external_kv: Any = None  # a follower's imports come from rank 0 (ModelRunner.import_layer)


def plan(out: SchedulerOutput, block_size: int) -> tuple:
    """What the other ranks need of a step rank 0 scheduled (sent as one object)."""
    scheduled = []
    for s in out.scheduled:
        r, c, n = s.request, s.num_computed_tokens, s.num_new_tokens
        scheduled.append(
            (
                r.request_id,
                c,
                n,
                list(r.all_token_ids[c : c + n]),
                list(r.block_ids[: blocks_for(c + n, block_size)]),
                r.num_tokens,
                r.num_prompt_tokens,
                r.sampling_params.prompt_logprobs,
            )
        )
    return scheduled, [imp.block_ids for imp in out.imports]


def planned(step: tuple) -> SchedulerOutput:
    """A follower's SchedulerOutput of rank 0's ``plan``."""
    scheduled, imports = step
    out = SchedulerOutput()
    for rid, c, n, tokens, blocks, total, prompt, prompt_logprobs in scheduled:
        request = _Planned(rid, _Tokens(c, tokens), blocks, total, prompt, _Params(prompt_logprobs))
        out.scheduled.append(ScheduledRequest(request, c, n))
    for blocks in imports:
        out.imports.append(KVImport(_Planned("", _Tokens(0, []), [], 0, 0, _Params(None)), 0, blocks))
    return out


class Followers:
    """Rank 0's side of the other ranks (``ModelRunner.followers``): a step's plan, or an export, goes to them before
    rank 0 runs its own part of it. ``sent`` counts the calls."""

    def __init__(self, tp: Any, block_size: int) -> None:
        self.tp, self.block_size, self.sent = tp, block_size, 0

    def step(self, out: SchedulerOutput, mirrored: bool) -> None:
        self._send([STEP, plan(out, self.block_size), mirrored])

    def export(self, block_ids: list[int]) -> None:
        self._send([EXPORT, list(block_ids), False])

    def _send(self, call: list) -> None:
        try:
            _broadcast(self.tp, call)
        except RuntimeError as e:  # a follower is gone (gloo: its connection closed; NCCL: its communicator)
            rank_lost(e)
        self.sent += 1


class Leader:
    """Rank 0's engine: its own, whose runner sends the followers each step's plan; ``COLLECTIVE`` calls that fail
    once the followers were sent something take the process down (``rank_lost``)."""

    def __init__(self, engine: Any, followers: list | None = None, rendezvous: Path | None = None) -> None:
        self.engine = engine
        self.ranks = Followers(engine.model.tp, engine.block_size)
        engine.runner.followers = self.ranks
        self._followers = followers or []  # the processes start_ranks started (joined at close)
        self._rendezvous = rendezvous
        self._closed = False
        if self._followers:  # an idle engine sends nothing that would fail: a rank that dies is seen here at once
            threading.Thread(target=self._watch, name="tp-watch", daemon=True).start()

    def _watch(self) -> None:
        while not self._closed:
            gone = [p for p in self._followers if not p.is_alive()]
            if gone and not self._closed:
                rank_lost(RuntimeError(f"{gone[0].name} exited with {gone[0].exitcode}"))
            time.sleep(WATCH_S)

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.engine, name)
        if name not in COLLECTIVE:
            return attr

        def joined(*args, **kwargs):
            sent = self.ranks.sent
            try:
                return attr(*args, **kwargs)
            except dist.DistError as e:  # a collective failed: a follower died during it
                rank_lost(e)
            except Exception as e:
                if self.ranks.sent != sent:  # the followers ran part of it: the ranks may no longer agree
                    rank_lost(e)
                raise

        return joined

    @property
    def kv_cache(self) -> torch.Tensor | None:
        """Every KV head of the cache where rank 0 keeps them (a prefill worker's: ``attach(mirror=True)``); None
        otherwise (nothing outside writes a tensor-parallel cache in place)."""
        return self.engine.runner.mirror

    def attach(self, connector: KVConnector) -> None:
        """Plug a worker's connector in (rank 0's only: the followers' steps carry none). One that reads the cache
        (it has a ``bind``: a prefill's pushes) is bound to rank 0's copy with every KV head (``Mirror``)."""
        connector.stops_cancelled_steps = False  # a step runs on every rank to its end: cancelled requests abort after
        if type(connector).bind is not KVConnector.bind:
            runner = self.engine.runner
            layers, two, blocks, bs, _, d = runner.kv_cache.shape
            shape = (layers, two, blocks, bs, runner.pool_block_shape[3], d)
            # in host memory whatever the device: the pushes read it there (no staging), and a GPU keeps its memory
            # for the ranks' caches
            cuda = runner.kv_cache.device.type == "cuda"
            runner.mirror = torch.zeros(shape, dtype=runner.kv_cache.dtype, pin_memory=cuda)
            connector.bind(runner.mirror)
            connector = Mirror(connector, runner)
        self.engine.connector = connector

    def close(self) -> None:
        """End the followers' loops and wait for the processes start_ranks started (once)."""
        if self._closed:
            return
        self._closed = True
        try:
            _broadcast(self.ranks.tp, [CLOSE, None, False])
        except RuntimeError as e:  # a follower already gone
            log.warning("tensor-parallel ranks could not be told to stop: %s", e)
        for p in self._followers:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
        self.engine.close()
        if self._rendezvous is not None:
            shutil.rmtree(self._rendezvous, ignore_errors=True)


def _gather_new_kv(runner: Any, k: torch.Tensor, v: torch.Tensor, step: ConnectorStep) -> tuple[torch.Tensor, Any]:
    """Every KV head of the K and V one layer of ``step`` wrote, from every rank ([2, tokens, Hkv, D], on rank 0; None
    on the others, which send theirs), and the slots it went to (a collective)."""
    slots = torch.cat([r.slots for r in step.requests]) if step.requests else torch.empty(0, dtype=torch.long)
    slots = slots.to(k.device)
    heads, d = k.shape[-2:]
    own = torch.stack([k.reshape(-1, heads, d)[slots], v.reshape(-1, heads, d)[slots]])
    return runner.tp.gather_kv_heads(own, runner.pool_block_shape[3]), slots


class Mirror(KVConnector):
    """Rank 0's connector of a prefill worker's ranks: after each layer, the KV it wrote is gathered from every rank
    into rank 0's copy of the cache with every head (``ModelRunner.mirror``), and the worker's connector sees that
    copy, in the pool layout, as it would a one-rank cache. The followers' steps join the gather (``follow``)."""

    def __init__(self, inner: KVConnector, runner: Any) -> None:
        self.inner, self.runner = inner, runner

    def start_step(self, step: ConnectorStep) -> None:
        self.inner.start_step(step)

    def wait_for_layer_load(self, layer: int) -> None:
        self.inner.wait_for_layer_load(layer)

    def save_layer(self, layer: int, k_cache: torch.Tensor, v_cache: torch.Tensor, step: ConnectorStep) -> None:
        kv, slots = _gather_new_kv(self.runner, k_cache, v_cache, step)
        kv, slots = kv.cpu(), slots.cpu()
        mirror = self.runner.mirror[layer]  # [2, blocks, bs, Hkv, D]
        for i in range(2):
            mirror[i].view(-1, *mirror.shape[-2:])[slots] = kv[i]
        self.inner.save_layer(layer, mirror[0], mirror[1], step)

    def wait_for_save(self) -> None:
        self.inner.wait_for_save()

    def request_finished(self, request_id: str, block_ids: list[int]) -> bool:
        return self.inner.request_finished(request_id, block_ids)

    def released_blocks(self) -> list[int]:
        return self.inner.released_blocks()


class _Joins(KVConnector):
    """A follower's connector where rank 0's is a ``Mirror``: it sends this rank's heads of each layer's new KV."""

    def __init__(self, runner: Any) -> None:
        self.runner = runner

    def save_layer(self, layer: int, k_cache: torch.Tensor, v_cache: torch.Tensor, step: ConnectorStep) -> None:
        _gather_new_kv(self.runner, k_cache, v_cache, step)


def rank_lost(error: BaseException) -> None:
    """A rank of this engine is gone: its shard of the model with it. This process goes down whole (its supervisor
    restarts it, as for any worker death; the cluster places its requests again or resumes them); it never serves
    on with a part of the model missing."""
    log.critical("a tensor-parallel rank is gone (%s): this process stops", error)
    logging.shutdown()
    os._exit(RANK_LOST_EXIT)


def follow(engine: Any) -> int:
    """Run rank 0's plans (and join its exports) on this rank's ``engine`` until it closes; returns how many calls
    were made. A call that fails here failed on rank 0 too, or left the ranks apart: rank 0 then goes down (and this
    process with it)."""
    runner = engine.runner
    runner.samples = False
    plain, joins = KVConnector(), _Joins(runner)
    made = 0
    while True:
        name, arg, mirrored = _broadcast(runner.tp, None)
        if name == CLOSE:
            return made
        try:
            if name == STEP:
                runner.execute(planned(arg), joins if mirrored else plain)
            else:
                runner.export_blocks(arg)
        except Exception:
            log.exception("rank %d: %s failed", runner.tp.rank, name)
        made += 1


def rank_config(config: Any, rank: int) -> Any:
    """Rank ``rank``'s EngineConfig: on CUDA, the device ``rank`` places after the configured one (cuda:0 -> cuda:r)."""
    if not config.device.startswith("cuda"):
        return config
    base = torch.device(config.device).index or 0
    return config.model_copy(update={"device": f"cuda:{base + rank}"})


def start_ranks(config: Any, tokenizer: Any = None) -> Leader:
    """A ``config.tensor_parallel_size``-rank engine: the other ranks started as processes here (each loading its
    shard and following this one), this process rank 0; returns its ``Leader`` once every rank has loaded. Raises
    ValueError when the model does not split that way, RuntimeError when another rank fails to start (its error in
    the message) or the ranks do not meet within ``START_TIMEOUT_S``."""
    size = config.tensor_parallel_size
    if config.device == "cpu" and config.num_threads is None:  # the cores shared among the ranks, not each all of them
        config = config.model_copy(update={"num_threads": max(1, (os.cpu_count() or 1) // size)})
    rendezvous = Path(tempfile.mkdtemp(prefix="mooncake-tp-"))
    init = f"file://{rendezvous / 'group'}"
    ctx = mp.get_context("spawn")
    errors = ctx.Queue()
    followers = [
        ctx.Process(
            target=_follower, args=(r, size, init, config, tokenizer is not None, errors), daemon=True, name=f"tp-{r}"
        )
        for r in range(1, size)
    ]
    for p in followers:
        p.start()
    started: dict[str, Any] = {}

    def start() -> None:  # on a thread: a rank that dies before the rendezvous would leave it waiting
        try:
            started["engine"] = _load(0, size, init, config, tokenizer)
        except BaseException as e:
            started["error"] = e

    thread = threading.Thread(target=start, name="tp-start", daemon=True)
    thread.start()
    deadline = time.monotonic() + START_TIMEOUT_S
    while thread.is_alive():
        thread.join(0.2)
        gone = [p for p in followers if not p.is_alive()]
        if gone or time.monotonic() > deadline:
            why = errors.get(timeout=1.0) if gone and _waiting(errors) else None
            _stop(followers, rendezvous)
            if why is None:
                why = (
                    f"{gone[0].name} exited with {gone[0].exitcode}" if gone else f"not met in {START_TIMEOUT_S:.0f} s"
                )
            raise RuntimeError(f"a tensor-parallel rank failed to start: {why}")
    if "error" in started:
        _stop(followers, rendezvous)
        raise started["error"]
    return Leader(started["engine"], followers, rendezvous)


def _waiting(queue: Any) -> bool:
    try:
        return not queue.empty()
    except (OSError, ValueError):
        return False


def _stop(followers: list, rendezvous: Path) -> None:
    for p in followers:
        p.kill()
    shutil.rmtree(rendezvous, ignore_errors=True)


def _load(rank: int, size: int, init: str, config: Any, tokenizer: Any) -> Any:
    """Join the ranks, load this rank's shard, and wait until every rank has (a rank that fails to load ends the
    start-up for all: the others' wait fails at once, its peer gone)."""
    from mooncake.engine.engine import LLMEngine
    from mooncake.engine.parallel import TensorParallel

    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    config = rank_config(config, rank)
    cuda = config.device.startswith("cuda")
    if cuda:  # NCCL's communicator is this rank's device's
        torch.cuda.set_device(torch.device(config.device))
    backend = "nccl" if cuda else "gloo"  # the device's, not whether this machine has CUDA
    TensorParallel.init(rank, size, init, backend=backend, timeout=timedelta(seconds=START_TIMEOUT_S))
    ranks = list(range(size))
    group = dist.new_group(ranks, timeout=IDLE_TIMEOUT, backend=backend)
    calls = dist.new_group(ranks, timeout=IDLE_TIMEOUT, backend="gloo") if cuda else None
    engine = LLMEngine(config, tokenizer=tokenizer, tp=TensorParallel(rank, size, group, calls))
    dist.barrier()  # the start-up group: START_TIMEOUT_S
    return engine


def _follower(rank: int, size: int, init: str, config: Any, with_tokenizer: bool, errors: Any) -> None:
    """A follower rank's process: dies with its leader's, loads its shard (and the tokenizer, where rank 0's engine
    has one: constrained decoding reads it), follows until closed."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass
    from mooncake.engine.tokenizer import Tokenizer

    try:
        tokenizer = Tokenizer.from_dir(config.model) if with_tokenizer else None
        engine = _load(rank, size, init, config, tokenizer)
    except BaseException as e:
        errors.put(f"rank {rank}: {type(e).__name__}: {e}")
        raise
    follow(engine)
