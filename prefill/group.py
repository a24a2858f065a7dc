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

The worker drives a group as it drives an engine: ``GroupEngine`` is a ``WorkerEngine``
whose step is one request's pipelined prefill. One prefill runs at a time (the stages
overlap its chunks, not requests); others wait their turn in its queue. A stage that
fails or dies fails the prefill in flight (UNAVAILABLE: the gateway places it again)
and the group starts its stages anew in the background (or, for stage servers, dials
them again until they answer: a supervisor restarts a dead one), refusing prefills
(UNAVAILABLE) until they are up.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable

import torch

from mooncake.blocks import blocks_for
from mooncake.engine.engine import RequestOutput
from mooncake.engine.interface import EngineKind, engine_fingerprint
from mooncake.engine.loader import load_hf_config
from mooncake.engine.model_args import ModelArgs
from mooncake.engine.pipeline import PipelinePrefill
from mooncake.engine.request import FinishReason, PromptKV, RequestOptions, SamplingParams
from mooncake.engine.stage import split_layers
from mooncake.serving.kvlayout import SlotKV
from prefill.connector import PrefillJob
from prefill.stage_process import ProcessPipeline, StagePush, StageRequest, StageSpec
from transfer import Segment

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
        self.num_stages, self.vocab_size = num_stages, args.vocab_size
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
        self.check(request.prompt)
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

    def check(self, prompt: list[int]) -> None:
        """Raises ValueError for a prompt the stages cannot hold."""
        if len(prompt) > self.max_model_len:
            raise ValueError(f"{len(prompt)} tokens exceed max_model_len {self.max_model_len}")
        if blocks_for(len(prompt), self.block_size) > self.num_kv_blocks:
            raise ValueError(f"{len(prompt)} tokens need more than the {self.num_kv_blocks} KV blocks of each stage")

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


class GroupEngine:
    """A group as the prefill worker's ``WorkerEngine``: ``add_request`` queues a prompt, each ``step`` runs the next
    one through the stages (its whole prefill: the stages push its KV themselves, to where its ``PrefillJob`` in
    ``jobs`` says) and returns its first token. A request aborted before its turn never runs."""

    eos_token_ids: frozenset[int] = frozenset()  # a prefill samples one token: stop tokens do not matter
    num_landing_blocks = 0
    kv_cache = None  # the stages' own, in their processes

    def __init__(
        self, group: StageGroup, jobs: dict[str, PrefillJob], pool: Segment, io_timeout_s: float, timeout_s: float
    ) -> None:
        self.group, self.jobs, self.pool = group, jobs, pool
        self.io_timeout_s, self.timeout_s = io_timeout_s, timeout_s
        self.block_size, self.block_bytes = group.block_size, group.block_bytes
        self.pool_block_bytes = self.block_bytes  # (a group's pool blocks are its stages' cache's: no pool_kv_dtype)
        self.fingerprint, self.max_model_len = group.fingerprint, group.max_model_len
        self.step_tokens, self.vocab_size = group.chunk, group.vocab_size
        self.last_step_tokens = 0
        # (request id, prompt, params, outputs, prefix slots, cached tokens, queued ahead)
        self._queue: deque[tuple[str, list[int], SamplingParams, int, SlotKV | None, int, bool]] = deque()

    @property
    def block_shape(self) -> tuple[int, ...]:
        return self.group.block_shape

    @property
    def num_free_blocks(self) -> int:
        return self.group.num_free_blocks

    def add_request(
        self,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        kv: PromptKV | None = None,
        options: RequestOptions | None = None,
    ) -> str:
        """Queue a prefill (``ahead``: before those queued); raises ValueError for a prompt the stages cannot hold.
        ``kv``: the prefix's pool slots (a SlotKV: the stages read them from the pool's segment)."""
        opts = options or RequestOptions()
        if (kv is not None and kv.remote) or opts.chunk_tokens:
            raise ValueError("a group computes its prompts whole, in its stages' own caches")
        if request_id is None or request_id not in self.jobs:
            raise ValueError("a group prefills only requests with a PrefillJob (where the stages push the KV)")
        outputs = list(opts.outputs)
        prompt = [*prompt_token_ids, *outputs]
        self.group.check(prompt)
        params = sampling_params or SamplingParams()
        prefix, cached = (kv.kv, kv.num_tokens) if kv is not None else (None, 0)
        entry = (request_id, prompt, params, len(outputs), prefix, cached, opts.ahead)
        if opts.ahead:  # behind those that came ahead before it
            self._queue.insert(next((i for i, q in enumerate(self._queue) if not q[-1]), len(self._queue)), entry)
        else:
            self._queue.append(entry)
        return request_id

    def step(self) -> list[RequestOutput]:
        """The next queued prefill, whole; a failure fails its job (the worker raises the job's error)."""
        rid, prompt, params, num_outputs, prefix, cached, _ = self._queue.popleft()
        job = self.jobs[rid]
        self.last_step_tokens = len(prompt) - cached
        try:
            out = self.group.prefill(
                StageRequest(
                    rid,
                    prompt,
                    params,
                    self.group.chunk,
                    num_outputs=num_outputs,
                    num_prefix_tokens=cached,
                    push=self._push(job, prefix, cached),
                ),
                threading.Event(),
                self.timeout_s,
                on_start=lambda: setattr(job, "started_at", time.perf_counter()),
            )
        except Exception as e:  # noqa: BLE001 - the request's failure, raised by the worker from its job
            job.fail(e)
            tokens, logprobs, prompt_logprobs, reason = [], None, None, FinishReason.ABORT
        else:
            tokens = [*prompt[len(prompt) - num_outputs :], out.first_token]
            logprobs = [out.logprob] if out.logprob is not None else None
            prompt_logprobs, reason = out.prompt_logprobs, FinishReason.LENGTH
        return [
            RequestOutput(
                rid,
                tokens,
                tokens[-1:],
                True,
                reason,
                len(prompt) - num_outputs,
                cached,
                new_logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
            )
        ]

    def _push(self, job: PrefillJob, prefix: SlotKV | None, cached: int) -> StagePush:
        """Where the stages push the KV and read the prefix (its pulled blocks landed first)."""
        for layer in range(self.block_shape[0] if prefix is not None else 0):
            prefix.wait(layer)
        n = blocks_for(cached, self.block_size)
        return StagePush(
            job.landing_spec,
            job.landing_offsets,
            self.pool,
            job.pool_slots,
            prefix.indices[:n] if prefix is not None else None,
            self.io_timeout_s,
            pool_token=job.pool_token,
            prefix_tokens=job.prefix_tokens[:n] if prefix is not None else None,
            landing_token=job.landing_token,
            landing_blocks=job.landing_blocks,
            landing_num_blocks=job.landing_num_blocks,
        )

    def abort_request(self, request_id: str) -> bool:
        before = len(self._queue)
        self._queue = deque(q for q in self._queue if q[0] != request_id)
        return len(self._queue) < before

    def has_unfinished(self) -> bool:
        return bool(self._queue)

    def load(self) -> tuple[int, int]:
        return min(1, len(self._queue)), 0  # one prefill at a time: the rest wait their turn

    def set_max_num_seqs(self, n: int) -> None:
        pass  # one at a time already

    def request_block_ids(self, request_id: str) -> list[int]:
        return []  # a prefill's KV is its own: none comes from outside

    def land(self, request_id: str, token: int, kv=None) -> None:
        raise ValueError("a group computes its prompts whole: no KV lands in it")

    def reclaim(self) -> None:
        pass

    def computed_blocks(self, request_id: str, first_block: int):
        raise NotImplementedError("a group keeps no blocks after a prefill (a decode worker's write-behind)")

    def close(self) -> None:
        self.group.close()


def stage_device(device: str, stage: int) -> str:
    """Stage ``stage``'s device: ``cuda`` spreads the stages over this machine's GPUs (stage i on GPU i modulo their
    number); ``cpu`` and ``cuda:N`` put every stage there."""
    if device != "cuda":
        return device
    return f"cuda:{stage % max(1, torch.cuda.device_count())}"
