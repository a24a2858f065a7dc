"""The prefill worker (DESIGN §3): load the reusable prefix, compute the rest layer by layer, stream the KV out.

    Prefill(request, plan, landing)
      1. lease the plan's local prefix blocks on this node's pool (they are read in place:
         the node's DRAM tier is shared memory on this host)
      2. pull the plan's fetch blocks from the node it names, one layer at a time, straight
         into slots reserved in this node's pool (kept there when the plan says so: hot
         blocks replicate)
      3. reserve pool slots for the prompt's other full blocks
      4. run the engine: the prefix is imported layer by layer just before each layer runs
         (waiting for that layer of the pull); after each layer the connector pushes the
         new KV into the decode engine's cache (mapped here on one host: tensor copies;
         through its segment from another; or its landing slots). On one host the local
         prefix goes from the pool slots straight into that cache, beside the import
      5. answer with the first token; the prompt's new full blocks go into the reserved pool
         slots after the answer (our engine; a pipelined group or vLLM writes them with each
         layer in step 4), and the reservations are committed once they are there (the
         blocks become visible, the Conductor's index hears of them); release the leases

Failure is a designed path: blocks evicted since the plan was made, a fetch node that no
longer has them, or a full pool shrink the plan (more is computed); a decode worker that
went away fails the request (UNAVAILABLE) but the KV computed for the pool is kept. Every
lease and reservation is made under the worker's id, so a worker killed mid-prefill and
restarted under that id hands back, as it starts, what its last run held on its pool node.
"""

from __future__ import annotations

import functools
import itertools
import logging
import math
import threading
import time
from concurrent import futures

import torch

from kvstore.client import KVStoreClient
from kvstore.wire import segment_from_pb
from mooncake.blocks import block_keys
from mooncake.engine.blockcopy import copy_blocks
from mooncake.engine.engine import RequestOutput
from mooncake.engine.interface import EngineKind
from mooncake.engine.request import PromptKV, RequestOptions, SamplingParams
from mooncake.engine.tokenizer import tokenizer_or_none
from mooncake.runtime.channels import ByAddress
from mooncake.runtime.conductor_link import ConductorLink
from mooncake.serving import reports
from mooncake.serving.build import build_engine
from mooncake.serving.cuda_ipc import CudaCaches
from mooncake.serving.engine_loop import EngineLoop
from mooncake.serving.kvlayout import SlotKV
from mooncake.serving.model_support import check_native
from mooncake.serving.sampling import logprob_to_pb, params_from_pb
from mooncake.serving.status import Cancelled, Unreachable
from prefill.config import PrefillConfig
from prefill.connector import PoolConnector, PrefillJob
from prefill.group import GroupEngine, StageGroup
from prefill.leases import Held, PoolLeases
from protos import worker_pb2 as wpb
from transfer import Segment, TransferConfig, TransferEngine, TransferError
from transfer.types import host_id

log = logging.getLogger(__name__)

GROUP_STAGE_BLOCKS = 1024  # each stage's cache where no count is given (it holds the prompt being prefilled)


class PrefillWorker:
    """Owns the engine, the connector, the pool clients and the pool's leases (``leases``). ``prefill`` is called from
    gRPC threads."""

    def __init__(self, config: PrefillConfig, link: ConductorLink | None = None) -> None:
        self.config = config
        self.kv = KVStoreClient(config.kvstore, owner=config.id)
        # A previous run under this id, killed mid-prefill, may have left leases and reservations
        # on this node, held until their TTLs (reservation_ttl_s: minutes). Its process is dead, so
        # they end now. Leases on the nodes it fetched from are not known here: they expire by TTL.
        leases, reservations = self.kv.release_owner()
        if leases or reservations:
            log.info(
                "a previous run of %s left %d leases and %d reservations on %s: released",
                config.id,
                leases,
                reservations,
                config.kvstore,
            )
        stats = self.kv.stats()
        self.node = stats.node
        self.transfer = TransferEngine(
            TransferConfig(node=f"{config.id}-xfer", serve=False, **config.transport.model_dump())
        )
        engine_config = config.engine_config
        if stats.block_bytes == 0:
            raise ValueError(f"pool node {config.kvstore} reports no block size")
        if not stats.segment.shm_path:
            raise ValueError(f"pool node {self.node} is not on this host (its DRAM tier has no shared-memory file)")
        self.connector = PoolConnector(self.transfer, None, config.engine_config.block_size, config.io_timeout_s)
        self.group: StageGroup | None = None  # its stages (health, status)
        # what its own engine does that a pipelined group's stages or vLLM do not: write the pool after the first token,
        # write a decode engine's cache mapped here, time calibration prompts
        self._single_native = config.engine is EngineKind.NATIVE and config.pipeline_stages == 1
        if config.pipeline_stages > 1:
            if config.engine is not EngineKind.NATIVE:
                raise ValueError("a pipelined prefill group runs the native engine only")
            if engine_config.tensor_parallel_size > 1:
                raise ValueError("a pipelined prefill group's stages are not split into tensor-parallel ranks yet")
            if engine_config.kv_cache_dtype != "auto" or engine_config.pool_kv_dtype != "auto":
                raise ValueError("a pipelined prefill group's stages keep KV in the model's dtype (no fp8 cache yet)")
            check_native(config.engine_config.model)  # an architecture ours lacks: one line naming the model
            self.group = StageGroup(
                config.engine_config.model,
                config.pipeline_stages,
                dtype=engine_config.torch_dtype,
                block_size=config.engine_config.block_size,
                num_kv_blocks=config.engine_config.num_kv_blocks or GROUP_STAGE_BLOCKS,
                max_model_len=config.engine_config.max_model_len,
                chunk=config.engine_config.max_num_batched_tokens,
                device=config.engine_config.device,
                stage_addresses=config.stage_addresses or None,
                authkey=config.stage_key,
            )
            self.engine = GroupEngine(
                self.group,
                self.connector.jobs,
                segment_from_pb(stats.segment),
                config.io_timeout_s,
                config.prefill_timeout_s,
            )
        else:
            self.engine = build_engine(
                config.engine,
                engine_config,
                vllm_args=config.vllm_args,
                connector=self.connector,
                tokenizer=tokenizer_or_none(config.engine_config.model),
            )
        if self.engine.pool_block_bytes != stats.block_bytes:
            raise ValueError(
                f"pool node {self.node} stores {stats.block_bytes}-byte blocks; this model's blocks "
                f"are {self.engine.pool_block_bytes} bytes in the pool (block size {engine_config.block_size}, "
                f"dtype {engine_config.dtype}, kept in {engine_config.pool_dtype})"
            )
        self.block_shape = self.engine.block_shape
        self.block_bytes = stats.block_bytes
        self._cuda_caches = CudaCaches()  # decode engines' CUDA caches on this host, mapped once each
        self._prefix_copier = futures.ThreadPoolExecutor(1, thread_name_prefix="kv-prefix-copy")  # pool -> decode cache
        self._remote = ByAddress(
            lambda address: KVStoreClient(address, engine=self.transfer, owner=config.id)
        )  # pool nodes
        self.leases = PoolLeases(
            self.kv,
            self.node,
            self._remote,
            self.transfer,
            stats.segment,
            self.block_shape,
            self.block_bytes,
            engine_config.pool_torch_dtype,
            reservation_ttl_s=config.reservation_ttl_s,
            store_new_blocks=config.store_new_blocks,
            io_timeout_s=config.io_timeout_s,
            on_map=self._pool_mapped,
        )  # the pool node's memory mapped here, and what each prefill holds on it
        self.loop = EngineLoop(self.engine, name="prefill-engine")
        self._inflight: dict[str, tuple[int, int]] = {}  # call id -> (prompt tokens, cached tokens)
        # each call's id in the engine, the connector's jobs and the queue: its request id and a number of its own, so
        # a request placed here again (a retry after its decode worker was cut off) never shares them with the call
        # still ending for it (its abort would take the retry's place in the engine, its end the retry's job)
        self._calls = itertools.count()
        self.received = 0  # Prefill calls since it started
        self._link: ConductorLink | None = None
        self.calibration: list[reports.PrefillSample] = []  # ``calibrate``'s prefills
        self.link = link  # measurements go to the Conductor through it (set by the server)
        self.draining = False

    @property
    def link(self) -> ConductorLink | None:
        return self._link

    @link.setter
    def link(self, link: ConductorLink | None) -> None:
        """The calibration's samples go with the first report through a new link."""
        self._link = link
        for sample in self.calibration if link is not None else ():
            link.prefill_sample(sample.prompt_tokens, sample.cached_tokens, sample.seconds)

    def calibrate(self) -> list[reports.PrefillSample]:
        """Time prefills of made-up prompts (``reports.calibration_lengths``: shares of the step budget, after one
        untimed, which pays the first run's costs); they go to the Conductor as samples of served prompts do (with the
        link's first report), so its predictors start from this machine's speed. Without them the first requests were
        predicted from the default rate (a GPU's): on this CPU at 4% of their TTFT, until enough prompts had been
        served. Our engine on a single worker only (a pipelined group or vLLM starts from the default)."""
        if not self._single_native:
            return []
        vocab = self.engine.vocab_size
        # the config's max_model_len may be None: the model's context
        lengths = reports.calibration_lengths(
            self.config.engine_config.max_num_batched_tokens, self.engine.max_model_len - 1
        )
        for i, n in enumerate([16, *lengths]):
            prompt = [(7 + 31 * (i + t)) % vocab for t in range(n)]
            done = threading.Event()

            def sink(out: RequestOutput | BaseException, done=done) -> None:
                if isinstance(out, BaseException) or out.finished:
                    done.set()

            t0 = time.perf_counter()
            self.loop.submit_nowait(
                sink,
                prompt_token_ids=prompt,
                sampling_params=SamplingParams(max_tokens=1, temperature=0.0),
                request_id=f"calibrate-{i}",
            ).result()
            if not done.wait(self.config.prefill_timeout_s):
                raise RuntimeError(f"the calibration prefill of {n} tokens took over {self.config.prefill_timeout_s} s")
            if i:
                self.calibration.append(reports.prefill_sample(n, 0, time.perf_counter() - t0))
        log.info(
            "calibrated: %s",
            ", ".join(f"{c.prompt_tokens} tokens in {c.seconds * 1000:.0f} ms" for c in self.calibration),
        )
        return self.calibration

    # -- the RPC -------------------------------------------------------------------------------

    def prefill(self, req: wpb.PrefillRequest, cancelled: threading.Event) -> wpb.PrefillResponse:
        """Prefill ``req`` into its landing slots; return the first token. See the module docstring.

        Raises ValueError (bad request), Cancelled, KVStoreUnavailable or TransferError
        (a node or the decode worker is gone), RuntimeError (draining).
        """
        if self.draining:
            raise RuntimeError(f"prefill worker {self.config.id} is draining")
        if cancelled.is_set():  # its caller left while it waited for a thread: nothing leased, nothing computed
            raise Cancelled(f"prefill of {req.request_id} cancelled by the caller before it began")
        t0 = time.perf_counter()
        prompt = list(req.prompt_token_ids)
        bs = self.config.engine_config.block_size
        if not prompt:
            raise ValueError("the prompt is empty")
        num_blocks = -(-len(prompt) // bs)
        salt = req.cache_salt if req.HasField("cache_salt") else None
        keys = block_keys(prompt, bs, self.engine.fingerprint, salt)
        rid = f"{req.request_id}#{next(self._calls)}"
        job = self._job(req, num_blocks, rid)
        job.cancelled = cancelled  # set for every job of a step, the step stops after the layer it is in
        held = Held(keep_fetched=req.plan.keep_fetched, io_timeout_s=self.config.io_timeout_s)
        use_pool = self.leases.enter(held)  # False for a while after the pool node restarted
        prefix = None
        self.received += 1  # the Conductor counts what it placed beyond this as on its way (Instance.in_transit)
        # queued from its arrival (the heartbeat reports it), as the plan says until the pool says what it holds
        self._inflight[rid] = (
            len(prompt),
            reports.cached_tokens(req.plan.local_blocks + req.plan.fetch_blocks, bs, len(prompt)),
        )
        try:
            # prompt logprobs need every prompt token computed: nothing is loaded
            logprobs = req.sampling.HasField("prompt_logprobs") and not req.num_output_tokens
            plan = type(req.plan)() if logprobs or not use_pool else req.plan
            # a resumed stream: its decode worker wrote its blocks just before it died, maybe after the plan was made
            resumed = use_pool and not logprobs and req.num_output_tokens > 0
            local, ssd_hits, fetched = self.leases.load_plan(plan, keys, held, extend=resumed)
            cached_blocks = len(local) + len(fetched)
            cached = reports.cached_tokens(cached_blocks, bs, len(prompt))
            job.pool_slots = self.leases.reserve_new(keys, cached_blocks, held) if use_pool else {}
            if job.pool_slots and self._single_native:
                job.store_later, job.on_stored = True, functools.partial(self._stored, held)
            external = None
            if cached > 0:
                external = SlotKV(
                    self.leases.pool, local + fetched, wait_layer=held.wait_layer if held.fetch_batches else None
                )
            prefix = self._copy_prefix(job, local, cached)
            self._inflight[rid] = (len(prompt), cached)
            job.pool_token = held.new_reservation or ""
            job.prefix_tokens = [held.local_lease or ""] * len(local) + [held.fetch_reservation or ""] * len(fetched)
            self.connector.jobs[rid] = job
            self._run(req, rid, prompt, salt, external, cached, job, cancelled)
            if prefix is not None and prefix.exception() is not None:
                job.fail(
                    TransferError(f"copying the prefix into the decode engine's cache failed: {prefix.exception()}")
                )
            if job.error is not None:
                raise job.error
            if not job.writing:  # else the pool write after the answer commits and releases ``held`` (_stored)
                self.leases.commit(held)
        finally:
            if (
                prefix is not None
            ):  # before the leases go and the grant ends: it reads pool slots, writes granted blocks
                futures.wait([prefix])
            self.connector.jobs.pop(rid, None)
            self._inflight.pop(rid, None)
            if not job.writing:  # a job cancelled after its last step is still written: _stored releases ``held``
                self.leases.release(held)
        compute_s = (job.finished_at or time.perf_counter()) - (job.started_at or t0)
        if self.link is not None:  # the Conductor's predictors learn what a prompt costs alone
            sample = reports.prefill_sample(len(prompt), cached, compute_s, job.compute_s)
            self.link.prefill_sample(sample.prompt_tokens, sample.cached_tokens, sample.seconds)
            self.link.beat_soon()  # its queue is shorter now: the Conductor hears it at once
            if held.fetch_seconds:
                self.link.transfer_sample(len(fetched) * self.block_bytes, held.fetch_seconds)
            pushed = self.connector.link.take()  # the hand-offs' pushes across the network measure it too
            if pushed is not None:
                self.link.transfer_sample(*pushed)
        return wpb.PrefillResponse(
            first_token=job.first_token,
            cached_tokens=cached,
            local_tokens=min(len(local) * bs, cached),
            ssd_tokens=ssd_hits * bs,
            fetched_tokens=max(0, cached - len(local) * bs),
            computed_tokens=len(prompt) - cached,
            queue_s=(job.started_at or t0) - t0,
            prefill_s=compute_s,
            first_logprob=logprob_to_pb(job.first_logprob) if job.first_logprob is not None else None,
            prompt_logprobs=[logprob_to_pb(lp) for lp in job.prompt_logprobs],
        )

    def _job(self, req: wpb.PrefillRequest, num_blocks: int, rid: str) -> PrefillJob:
        """The request's PrefillJob: where its KV lands (landing slots, or the decode engine's cache in place: through
        its segment, or on this GPU by CUDA IPC). Raises ValueError for a landing that does not fit the prompt and
        ``Unreachable`` for a CUDA cache this process cannot map."""
        landing = req.landing
        direct = len(landing.cache_blocks) > 0
        have = len(landing.cache_blocks) if direct else len(landing.offsets)
        if have != num_blocks:
            raise ValueError(
                f"{have} landing blocks for a {len(req.prompt_token_ids)}-token prompt of {num_blocks} blocks"
            )
        # the decode engine's blocks (the cache's dtype), or narrow landing slots (the pool's: a narrow hand-off)
        narrow = landing.block_bytes != self.engine.block_bytes and landing.block_bytes == self.engine.pool_block_bytes
        if landing.block_bytes != self.engine.block_bytes and not (narrow and not direct and not landing.cuda_ipc):
            raise ValueError(
                f"landing blocks of {landing.block_bytes} bytes; this model's blocks are {self.engine.block_bytes}"
                f" ({self.engine.pool_block_bytes} in the pool)"
            )
        job = PrefillJob(
            rid,
            len(req.prompt_token_ids),
            num_blocks,
            landing.segment.name,
            list(landing.offsets),
            landing_token=landing.token,
        )
        job.landing_spec = segment_from_pb(landing.segment)
        job.narrow = self.config.engine_config.pool_torch_dtype if narrow else None
        if direct:
            if landing.cache_num_blocks <= max(landing.cache_blocks):
                raise ValueError(
                    f"landing block {max(landing.cache_blocks)} outside a cache of {landing.cache_num_blocks} blocks"
                )
            job.landing_blocks, job.landing_num_blocks = list(landing.cache_blocks), landing.cache_num_blocks
        if landing.cuda_ipc:
            job.mapped_cache = self._device_cache(landing)
        else:
            self.transfer.add_segment(job.landing_spec)
            if direct:
                job.mapped_cache = self._host_cache(job.landing_spec, landing.cache_num_blocks)
        return job

    def _host_cache(self, segment: Segment, num_blocks: int) -> torch.Tensor | None:
        """The decode engine's CPU cache [L, 2, blocks, bs, Hkv, D], mapped here from its shared memory when this worker
        pushes from a CPU cache and reaches that segment by shared memory; None: it is written through the transfer
        engine (another host, or a staged push). Each layer's blocks are then two tensor operations, not a slice per
        block and layer (at 4,096 tokens of SmolLM2, 15,360 slices)."""
        if self.connector.staged or not self._single_native:
            return None
        try:
            view = self.transfer.mapped(segment)
        except TransferError:
            return None  # its owner is gone: the push through the transfer engine fails the job the usual way
        if view is None:
            return None
        dtype, shape = self.connector.kv_cache.dtype, self._cache_shape(num_blocks)
        count = math.prod(shape)
        if len(view) < count * dtype.itemsize:
            raise ValueError(
                f"a cache of {num_blocks} blocks needs {count * dtype.itemsize} bytes; the segment "
                f"{segment.name!r} holds {len(view)}"
            )
        return torch.frombuffer(view, dtype=dtype, count=count).view(shape)

    def _cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        """A decode engine's cache of ``num_blocks`` blocks of this model: [L, 2, blocks, bs, Hkv, D]."""
        return (self.block_shape[0], 2, num_blocks, *self.block_shape[2:])

    def _copy_prefix(self, job: PrefillJob, local: list[int], cached: int) -> futures.Future | None:
        """Start copying the prompt's leading blocks found in this node's pool straight into the decode engine's cache
        (mapped here, on the CPU), beside the engine's own import of them: the engine then pushes only the blocks it
        computes, and the copy leaves the engine's thread for a core of its own. The blocks the engine writes (the
        last prompt token's is always computed) stay the engine's to push. None: nothing copied this way."""
        n = min(len(local), cached // self.config.engine_config.block_size)
        if not n or job.mapped_cache is None or job.mapped_cache.device.type != "cpu":
            return None
        job.issued = n  # the engine's pushes start after these
        dst = job.mapped_cache.permute(2, 0, 1, 3, 4, 5)  # [blocks, L, 2, bs, Hkv, D]: the pool's layout
        return self._prefix_copier.submit(copy_blocks, dst, job.landing_blocks[:n], self.leases.pool, local[:n])

    def _device_cache(self, landing: wpb.Landing):
        """The decode engine's CUDA cache, mapped here once per decode worker."""
        if not self.config.engine_config.device.startswith("cuda") or not self._single_native:
            raise Unreachable(
                f"prefill worker {self.config.id} writes no CUDA cache by IPC "
                f"(device {self.config.engine_config.device}, "
                f"engine {self.config.engine.value}, {self.config.pipeline_stages} stage(s))"
            )
        if landing.host != host_id():
            raise Unreachable(f"the decode worker's CUDA cache is on another host ({landing.host})")
        try:
            cache = self._cuda_caches.open(landing.cuda_ipc)
        except (ValueError, RuntimeError) as e:
            raise Unreachable(f"the decode worker's CUDA cache cannot be mapped here: {e}") from None
        want = self._cache_shape(landing.cache_num_blocks)
        if tuple(cache.shape) != want or cache.dtype != self.connector.kv_cache.dtype:
            raise ValueError(
                f"the decode worker's cache is {tuple(cache.shape)} {cache.dtype}; this model's would be {want} "
                f"{self.connector.kv_cache.dtype}"
            )
        return cache

    def _pool_mapped(self, pool: torch.Tensor, segment: Segment) -> None:
        """The pool node's memory was mapped (``leases``: as it starts, and again after the node restarted, while no
        prefill uses the pool): the connector writes new blocks into ``pool``; a pipelined group's stages write
        ``segment`` through the transfer engine."""
        self.connector.set_pool(pool)
        if self.group is not None:
            self.engine.pool = segment

    def _stored(self, held: "Held", ok: bool) -> None:
        """The pool write of a finished prefill ended (on the connector's writer thread): commit what it wrote (or
        abort it when it failed: the pool lacks these blocks, nobody's request fails), release the leases."""
        if ok:
            self.leases.commit(held)
        self.leases.release(held)

    def flush_pool_writes(self, timeout: float | None = 30.0) -> bool:
        """Wait until the pool writes of every prefill answered so far are committed (tests, benchmarks, a drain)."""
        return self.connector.flush(timeout)

    def _run(self, req, rid: str, prompt, salt, external, cached, job: PrefillJob, cancelled: threading.Event) -> None:
        """Run the request through the engine until its first token (or a failure, or the caller leaves)."""
        if cancelled.is_set():  # the caller left while the pool was asked: the engine is not given the prompt
            raise Cancelled(f"prefill of {req.request_id} cancelled by the caller before it was computed")
        num_outputs, params = _prefill_params(req, prompt)
        split = len(prompt) - num_outputs

        def sink(out: RequestOutput | BaseException) -> None:
            if isinstance(out, BaseException):
                job.fail(out)
            elif out.finished:
                job.first_token = out.output_token_ids[-1] if out.output_token_ids else None
                job.first_logprob = out.new_logprobs[-1] if out.new_logprobs else None
                job.prompt_logprobs = out.prompt_logprobs or []
                job.finished_at = time.perf_counter()
            if isinstance(out, BaseException) or out.finished:
                job.done.set()

        future = self.loop.submit_nowait(
            sink,
            prompt_token_ids=prompt[:split],
            sampling_params=params,
            request_id=rid,
            kv=PromptKV(cached, external) if external else None,
            options=RequestOptions(cache_salt=salt, outputs=tuple(prompt[split:]), ahead=req.ahead),
        )
        future.result()  # ValueError for a request the engine refuses
        while not job.done.wait(0.05):
            if cancelled.is_set():
                self.loop.abort(rid)
                # the abort runs between steps: once this no-op has run too, no step touches the job's slots (a
                # group's step is a whole prefill). No deadline: this call's end tells its caller that its writes are
                # over (its Abort answers so), and a step stalled for longer must not say it early
                self.loop.call(lambda engine: None).result()
                raise Cancelled(f"prefill of {req.request_id} cancelled by the caller")
        if job.first_token is None and job.error is None:
            job.fail(RuntimeError(f"the engine ended {req.request_id} without a token"))

    # -- load ------------------------------------------------------------------------------------

    def in_flight(self) -> list[reports.InFlight]:
        """Every prompt in flight, queued or running, with what it has computed so far (the blocks whose KV its
        engine has started to push; a pipelined group's count none until it ends): each heartbeat reports them, and
        the Conductor prices what is left with its own predictor."""
        bs, out = self.config.engine_config.block_size, []
        for rid, (prompt, cached) in list(self._inflight.items()):
            job = self.connector.jobs.get(rid)
            issued = job.issued if job is not None else 0
            out.append(reports.InFlight(prompt, reports.computed_tokens(prompt, cached, issued, bs)))
        return out

    @property
    def num_inflight(self) -> int:
        return len(self._inflight)

    @property
    def num_running(self) -> int:
        return self.loop.num_running

    def close(self) -> None:
        self.loop.close()
        self.engine.close()
        self._prefix_copier.shutdown(wait=True)
        self._remote.close()
        self.kv.close()
        self.transfer.close()
        self.leases.close()


def _prefill_params(req: wpb.PrefillRequest, prompt: list[int]):
    """(num_outputs, SamplingParams) of a prefill: a resumed stream's tokens so far are outputs (they count as sampled:
    a seeded generator skips their draws, so the next token is the one an undisturbed run samples); the request's
    sampling (penalties, biases, min_tokens: its first token is sampled here) for one more token (a resumed stream's
    client has its prompt logprobs already)."""
    s = req.sampling
    num_outputs = min(req.num_output_tokens, len(prompt) - 1)
    params = params_from_pb(
        s,
        max_tokens=num_outputs + 1,
        stop=(),
        include_stop_str_in_output=False,
        min_tokens=min(s.min_tokens, num_outputs + 1),
        **({"prompt_logprobs": None} if num_outputs else {}),
    )
    return num_outputs, params
