"""A tensor-parallel engine as one process per rank: rank 0 leads, the others follow its calls.

    engine = LLMEngine(config, tp=tp)     # every rank: its shard of the model, its KV heads' cache
    rank 0:   engine = Leader(engine)     # the engine a worker hosts (mooncake.engine.interface.WorkerEngine): each
                                          # call that changes the engine, or that every rank must join (a step, an
                                          # export of KV), goes to the followers first, one broadcast a call
    rank r:   follow(engine)              # make rank 0's calls, in its order, until it closes

    engine = start_ranks(config, tokenizer)   # all of it: this process rank 0, the others started here; close() ends
                                              # them (EngineConfig.tensor_parallel_size; mooncake.serving.build)

Every rank holds the same scheduler and is given the same calls in the same order, so each step schedules alike on
every rank and their collectives meet; a follower's results are dropped. vLLM's multiprocessing executor broadcasts
the scheduler's output each step instead; here a step is one word, and a request is sent to every rank once, when it
is added. The scheduler decides by its own state only (no clock, no randomness), which is what keeps the ranks alike:
anything that would make one rank decide apart from the others must be a call made through the leader.

A call that raises on rank 0 raises on the followers too (the same state, the same arguments): they log it and go on.
``close`` ends the followers' loop. The ranks go down together: a follower dies with its leader's process
(PR_SET_PDEATHSIG), and a leader whose follower died (its next broadcast or collective fails) exits at once
(``rank_lost``, status ``RANK_LOST_EXIT``) rather than serve on with part of the model gone.
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
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

# what the followers make too: every call that changes an engine's state or that runs a collective
FOLLOWED = ("add_request", "abort_request", "land", "step", "set_max_num_seqs", "export_kv")
CLOSE = "close"
RANK_LOST_EXIT = 75  # rank 0's exit status when another rank died (EX_TEMPFAIL: a restart serves again)
START_TIMEOUT_S = 600.0  # the ranks' rendezvous and their models' loading, at most (the start-up group's timeout)
# a follower waits for rank 0's next call as long as the engine is idle: the group never times out on its own, and a
# follower dies with its leader's process instead (PR_SET_PDEATHSIG)
IDLE_TIMEOUT = timedelta(days=3650)


def _broadcast(tp, call: list | None) -> list:
    box = [call]
    dist.broadcast_object_list(box, src=0, group=tp.calls if tp.calls is not None else tp.group)
    return box[0]


class Leader:
    """Rank 0's engine: ``FOLLOWED`` calls are broadcast to the other ranks, then made here; everything else (what the
    engine holds, its counts) is read from this rank's engine."""

    def __init__(self, engine: Any, followers: list | None = None, rendezvous: Path | None = None) -> None:
        self.engine = engine
        self.tp = engine.model.tp
        self._followers = followers or []  # the processes start_ranks started (joined at close)
        self._rendezvous = rendezvous
        self._closed = False

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.engine, name)
        if name not in FOLLOWED:
            return attr

        def followed(*args, **kwargs):
            try:
                _broadcast(self.tp, [name, args, kwargs])
            except RuntimeError as e:  # a follower is gone (gloo: its connection closed; NCCL: its communicator)
                rank_lost(e)
            try:
                return attr(*args, **kwargs)
            except dist.DistError as e:  # a collective inside the call failed: a follower died during it
                rank_lost(e)

        return followed

    def close(self) -> None:
        """End the followers' loops and wait for the processes start_ranks started (once)."""
        if self._closed:
            return
        self._closed = True
        try:
            _broadcast(self.tp, [CLOSE, (), {}])
        except RuntimeError as e:  # a follower already gone
            log.warning("tensor-parallel ranks could not be told to stop: %s", e)
        for p in self._followers:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
        self.engine.close()
        if self._rendezvous is not None:
            shutil.rmtree(self._rendezvous, ignore_errors=True)


def rank_lost(error: BaseException) -> None:
    """A rank of this engine is gone: its shard of the model with it. This process goes down whole (its supervisor
    restarts it, as for any worker death; the cluster places its requests again or resumes them); it never serves
    on with a part of the model missing."""
    log.critical("a tensor-parallel rank is gone (%s): this process stops", error)
    logging.shutdown()
    os._exit(RANK_LOST_EXIT)


def follow(engine: Any) -> int:
    """Make rank 0's calls on this rank's ``engine`` until it closes; returns how many were made."""
    tp, made = engine.model.tp, 0
    while True:
        name, args, kwargs = _broadcast(tp, None)
        if name == CLOSE:
            return made
        try:
            getattr(engine, name)(*args, **kwargs)
        except Exception as e:  # rank 0 raised the same: its caller hears of it
            log.debug("rank %d: %s raised %s", tp.rank, name, e)
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
