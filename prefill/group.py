"""A pipelined prefill group (CPP, Mooncake §5.1): one prefill worker whose model is cut into X stage processes.

    gRPC Prefill -> PrefillWorker (plan, leases, reservations, as for one engine)
                      -> StageGroup.prefill -> stage 0 [layers 0..a) -> stage 1 [a..b) -> ... -> first token
                                                  |                      |
                                each stage pushes its layers' KV, layer by layer, to the decode worker's
                                landing slots and into the pool slots reserved for the new blocks, and
                                reads its layers of the reused prefix from the pool node's segment

The group registers with the Conductor as one prefill instance with ``pipeline_stages`` X
and ``pipeline_chunk`` (its prefill time is predicted for the pipeline, from its own
samples). Its pool holdings are whole blocks on the group's pool node: each stage writes
its layer range of a block into the same slot, so the index and the plans see one node,
as for a single worker (stages on other hosts write there over tcp).

The stages are processes this worker spawns on its host, or, with ``stage_addresses``,
stage servers on other nodes (``python -m prefill.stage``, one per stage, each on its
own host) that the worker dials with the group's key: hidden states then cross hosts
over tcp, and each stage pushes to the landing slots and the pool node over tcp.

One prefill runs at a time (the stages overlap its chunks, not requests); others wait
their turn. A stage that fails or dies fails the prefill in flight (UNAVAILABLE: the
gateway places it again) and the group starts its stages anew in the background (or,
for stage servers, dials them again until they answer: a supervisor restarts a dead
one), refusing prefills (UNAVAILABLE) until they are up.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import torch

from mooncake.engine.interface import EngineKind, engine_fingerprint
from mooncake.engine.loader import load_hf_config
from mooncake.engine.model_args import ModelArgs
from mooncake.engine.pipeline import PipelinePrefill
from mooncake.engine.stage import split_layers
from prefill.stage_process import ProcessPipeline, StageRequest, StageSpec

log = logging.getLogger(__name__)


class StageGroup:
    """X stage processes of one model, driven one prefill at a time; what PrefillWorker needs of an engine."""

    def __init__(
        self,
        model: str,
        num_stages: int,
        *,
        dtype: torch.dtype,
        block_size: int,
        num_kv_blocks: int,
        max_model_len: int | None,
        chunk: int,
        device: str = "cpu",
        start_timeout_s: float = 600.0,
        stage_addresses: list[tuple[str, int]] | None = None,
        authkey: bytes | None = None,
    ) -> None:
        if stage_addresses and (len(stage_addresses) != num_stages or not authkey):
            raise ValueError(f"a group of {num_stages} stage servers needs {num_stages} addresses and the group's key")
        args = ModelArgs.from_hf_config(load_hf_config(model))
        self.num_stages = num_stages
        self.layers = split_layers(args.num_layers, num_stages)
        self.block_size = block_size
        self.block_shape = (args.num_layers, 2, block_size, args.num_kv_heads, args.head_dim)
        self.block_bytes = args.num_layers * 2 * block_size * args.num_kv_heads * args.head_dim * dtype.itemsize
        self.fingerprint = engine_fingerprint(EngineKind.NATIVE, model, dtype)
        self.max_model_len = min(max_model_len or args.max_position_embeddings, args.max_position_embeddings)
        self.chunk = chunk
        self.num_kv_blocks = num_kv_blocks
        self._specs = [
            StageSpec(
                model,
                layers,
                num_blocks=num_kv_blocks,
                block_size=block_size,
                max_model_len=self.max_model_len,
                max_chunk=chunk,
                dtype=dtype,
                device=stage_device(device, i),
            )
            for i, layers in enumerate(self.layers)
        ]
        self._start_timeout_s = start_timeout_s
        self._addresses, self._authkey = stage_addresses, authkey
        self._turn = threading.Lock()  # one prefill at a time
        self._state = threading.Condition()
        self._closed = False
        self._restarts = 0
        self.pipeline: ProcessPipeline | None = self._new_pipeline()
        threading.Thread(target=self._watch, name="cpp-watch", daemon=True).start()

    def prefill(
        self,
        request: StageRequest,
        cancelled: threading.Event,
        timeout_s: float,
        on_start: Callable[[], None] | None = None,
    ) -> PipelinePrefill:
        """Run ``request`` through the stages when its turn comes. Raises ValueError (bad request), RuntimeError
        (a stage failed: the group restarts), PushFailed (the KV could not be pushed), TimeoutError."""
        if len(request.prompt) > self.max_model_len:
            raise ValueError(f"{len(request.prompt)} tokens exceed max_model_len {self.max_model_len}")
        if -(-len(request.prompt) // self.block_size) > self.num_kv_blocks:
            raise ValueError(
                f"{len(request.prompt)} tokens need more than the {self.num_kv_blocks} KV blocks of each stage"
            )
        while not self._turn.acquire(timeout=0.05):
            if cancelled.is_set():
                raise InterruptedError("cancelled while waiting for the pipeline")
        try:
            pipeline = self.pipeline
            if pipeline is None or pipeline.closed:
                raise RuntimeError(f"the pipeline's stages are restarting (restart {self._restarts})")
            if not pipeline.idle_ok():
                error = RuntimeError(f"a pipeline stage died (stages alive: {pipeline.alive()})")
                pipeline.close()
                self._restart(pipeline, error)
                raise error
            if on_start is not None:
                on_start()
            try:
                return pipeline.prefill(request, timeout_s=timeout_s)
            except RuntimeError as e:
                if pipeline.closed:  # a stage failed or died: start them anew for the next prefill
                    self._restart(pipeline, e)
                raise
        finally:
            self._turn.release()

    def _watch(self, every_s: float = 1.0) -> None:
        """Between prefills, a stage that died is noticed within ``every_s`` and the stages start anew (so the next
        prefill does not fail on it, and /health says so meanwhile)."""
        while not self._closed:
            time.sleep(every_s)
            pipeline = self.pipeline
            if pipeline is None or pipeline.closed or not self._turn.acquire(blocking=False):
                continue
            try:
                if self.pipeline is pipeline and not pipeline.idle_ok():
                    error = RuntimeError(f"a pipeline stage died while idle (stages alive: {pipeline.alive()})")
                    pipeline.close()
                    self._restart(pipeline, error)
            finally:
                self._turn.release()

    def _restart(self, failed: ProcessPipeline, error: BaseException) -> None:
        with self._state:
            if self.pipeline is not failed or self._closed:
                return
            self.pipeline = None
            self._restarts += 1
        log.warning("pipeline stage failed (%s): starting the %d stages anew", error, self.num_stages)
        threading.Thread(target=self._start, name="cpp-restart", daemon=True).start()

    def _new_pipeline(self) -> ProcessPipeline:
        if self._addresses:
            return ProcessPipeline.connect(self._addresses, self._authkey, self._start_timeout_s)
        return ProcessPipeline(self._specs, self._start_timeout_s)

    def _start(self) -> None:
        t0 = time.perf_counter()
        while True:
            try:
                pipeline = self._new_pipeline()
                break
            except RuntimeError as e:
                if self._closed:
                    return
                log.error("the pipeline's stages did not start again (%s): trying again", e)
                time.sleep(1.0)
        with self._state:
            if self._closed:
                pipeline.close()
                return
            self.pipeline = pipeline
        log.info("the pipeline's %d stages are up again (%.1f s)", self.num_stages, time.perf_counter() - t0)

    @property
    def ready(self) -> bool:
        return self.pipeline is not None and not self.pipeline.closed

    def stages(self) -> list[dict]:
        """Each stage's layers and whether its process runs (``mooncake status``, the READY line)."""
        pipeline = self.pipeline
        alive = pipeline.alive() if pipeline is not None else [False] * self.num_stages
        pids = pipeline.pids() if pipeline is not None else [None] * self.num_stages
        where = [f"{h}:{p}" for h, p in self._addresses] if self._addresses else ["spawned"] * self.num_stages
        return [
            {"stage": i, "layers": [r.start, r.stop], "alive": a, "pid": pid, "at": at}
            for i, (r, a, pid, at) in enumerate(zip(self.layers, alive, pids, where))
        ]

    @property
    def num_free_blocks(self) -> int:
        return self.num_kv_blocks  # the stages' caches hold one prefill's blocks, freed when it ends

    def close(self) -> None:
        with self._state:
            self._closed = True
            pipeline, self.pipeline = self.pipeline, None
        if pipeline is not None:
            pipeline.close()


def stage_device(device: str, stage: int) -> str:
    """Stage ``stage``'s device: ``cuda`` spreads the stages over this machine's GPUs (stage i on GPU i modulo their
    number); ``cpu`` and ``cuda:N`` put every stage there."""
    if device != "cuda":
        return device
    return f"cuda:{stage % max(1, torch.cuda.device_count())}"
