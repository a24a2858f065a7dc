"""VllmEngine: a stock vLLM (v1) engine, in this process, behind the worker engine interface.

The worker engine interface is ``mooncake.engine.interface.WorkerEngine``. vLLM runs
in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: its EngineCore and, with TP = 1, its
model runner share this process), stepped by ``EngineLoop`` on one thread like our own
engine. KV moves through ``MooncakePoolConnector`` (connector.py), which vLLM builds from
the ``kv_transfer_config`` set here and which finds this engine's ``Bridge`` by its id.

How the worker's requests become vLLM requests:

    prefill:  prompt P, external prefix of c tokens (pool slots)  -> vLLM prompt P, c tokens loaded,
              max_tokens 1                                           the rest computed; pushes per layer
    decode:   prompt P, external KV of all |P| tokens (landing),  -> vLLM prompt P + [t1], |P| tokens
              first token t1 already sampled by the prefill          loaded, t1 computed; max_tokens - 1

so the decode computes one token's KV, never the prompt. The workers turn vLLM's own prefix
cache off (the pool is the prefix cache: blocks are reused across workers, not just inside
one); an engine serving alone (``gateway --local``) keeps it.

Stop strings are the serving layer's one detokenizer's (mooncake.serving.text), as for our
engine: this engine emits token ids. vLLM applies EOS, stop token ids and max_tokens itself (a
prefill's first token: ``land``, by our scheduler's rule).
"""

from __future__ import annotations

import logging
import os
import threading
import uuid
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from mooncake.blocks import block_keys, blocks_for
from mooncake.engine.config import EngineConfig
from mooncake.engine.connector import ConnectorStep
from mooncake.engine.cpu import keep_freed_memory
from mooncake.engine.engine import RequestOutput
from mooncake.engine.grammar import GrammarBook
from mooncake.engine.interface import EngineKind, engine_fingerprint, refuse
from mooncake.engine.loader import generation_eos_ids
from mooncake.engine.request import (
    FinishReason,
    PromptKV,
    RequestOptions,
    SamplingParams,
    TokenLogprob,
    checked_prompt,
)
from mooncake.engine.scheduler import token_finish
from mooncake.engine.weights import load_hf_config
from mooncake.vllm_engine.connector import CONNECTOR_NAME, Bridge, Load, register_bridge, unregister_bridge
from mooncake.vllm_engine.kv_spec import layout_of_kv_cache, layout_of_model_config, vllm_reason
from mooncake.vllm_engine.shared_kv import bind_cpu_ranks

log = logging.getLogger(__name__)

_set_num_threads = torch.set_num_threads  # vLLM's CPU worker turns torch.set_num_threads into a no-op once it starts


@dataclass(eq=False)
class _Tracked:
    """One request as the worker sees it (vLLM sees the prompt plus the initial outputs)."""

    internal_id: str
    params: SamplingParams
    num_prompt_tokens: int
    num_cached_tokens: int
    initial: list[int]
    outputs: list[int] = field(default_factory=list)  # initial + vLLM's tokens
    prompt: list[int] = field(default_factory=list)
    cache_salt: str | None = None
    prompt_logprobs_sent: bool = False


class VllmEngine:
    """See the module docstring. Built once per worker process (vLLM keeps process-wide state)."""

    def __init__(self, config: EngineConfig, vllm_args: dict[str, Any], tokenizer=None, pusher=None) -> None:
        if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "0") != "0":
            log.warning(
                "VLLM_ENABLE_V1_MULTIPROCESSING=%s ignored: the worker runs vLLM in its own process",
                os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"],
            )
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        multiple = 16 if torch.cuda.is_available() else 32  # FLASH_ATTN's kernel blocks; CPU_ATTN's
        if config.block_size % multiple:
            raise ValueError(
                f"vLLM's attention on this machine needs a block size that is a multiple of {multiple}; the "
                f"cluster's is {config.block_size} (start every component with --block-size 32)"
            )
        try:
            import vllm  # noqa: F401
        except ImportError as e:
            raise ValueError(f"--engine vllm needs vLLM installed (pip install 'mooncake-serve[vllm]'): {e}") from None
        from vllm import EngineArgs
        from vllm.config import KVTransferConfig
        from vllm.v1.engine.llm_engine import LLMEngine as VllmLLMEngine

        from mooncake.vllm_engine.grammar import GrammarLogitsProcessor

        self.config = config
        self.tokenizer = tokenizer
        if not torch.cuda.is_available():
            keep_freed_memory()  # what tcmalloc would do where it is not preloaded: no page faults per step
        self.bridge = Bridge(pusher=pusher)
        self._bridge_id = f"vllm-{uuid.uuid4().hex[:12]}"
        register_bridge(self._bridge_id, self.bridge)
        if pusher is not None:
            pusher.export = self._export
        kwargs: dict[str, Any] = dict(
            model=config.model,
            dtype=config.dtype,
            block_size=config.block_size,
            max_model_len=config.max_model_len,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=max(config.max_num_batched_tokens, config.block_size),
            enable_prefix_caching=config.enable_prefix_caching,
            seed=config.seed,
            kv_cache_dtype=config.kv_cache_dtype,
        )
        for key in ("kv_transfer_config", "enable_prefix_caching", "block_size", "kv_cache_dtype"):
            if key in vllm_args:
                raise ValueError(
                    f"--vllm-arg {key} is set by the worker (the pool connector; the pool as prefix cache; "
                    "the cluster's block size, --block-size; the KV dtype, --kv-cache-dtype)"
                )
        kwargs.update(vllm_args)
        self.world = _parallel_args(config, kwargs)
        kwargs["logits_processors"] = [*(kwargs.get("logits_processors") or ()), GrammarLogitsProcessor]
        self._grammars: GrammarBook | None = None  # checks constrained requests' grammars (built on first use)
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector=CONNECTOR_NAME,
            kv_connector_module_path="mooncake.vllm_engine.connector",
            kv_role="kv_both",
            kv_connector_extra_config={"bridge": self._bridge_id},
        )
        try:
            self._llm = self._start(
                config, EngineArgs, VllmLLMEngine, kwargs, sized="gpu_memory_utilization" in vllm_args
            )
        except BaseException:
            unregister_bridge(self._bridge_id)
            raise
        vc = self._llm.vllm_config
        mc = vc.model_config
        self.block_size = vc.cache_config.block_size
        if self.block_size != config.block_size:
            raise ValueError(f"vLLM chose block size {self.block_size}; the cluster's is {config.block_size}")
        self.max_model_len = mc.max_model_len
        self.step_tokens = vc.scheduler_config.max_num_batched_tokens  # its budget, --vllm-arg's where one was given
        self.vocab_size = mc.get_vocab_size()
        # the layout of the cache vLLM built for the layers it loaded: what this worker reports and the pool must hold
        layout = layout_of_kv_cache(config.model, self._scheduler().kv_cache_config, mc.dtype, config.kv_cache_dtype)
        if self.world > 1:  # each rank's cache holds its share of the heads; the pool every head
            layout = replace(layout, num_kv_heads=mc.get_total_num_kv_heads())
            self.bridge.shared.unlink()  # every process has it mapped by now: nothing is left behind at exit
            if pusher is not None:
                pusher.stops_cancelled_steps = False  # vLLM's ranks run each step to its end
        self._block_shape = layout.block_shape(self.block_size)
        self.block_bytes = layout.block_bytes(self.block_size)
        self.pool_block_bytes = self.block_bytes  # (vLLM's pool blocks are its cache's: no pool_kv_dtype)
        # the dtype vLLM computes KV in, as the gateway's keys name it (it reads --dtype: the same, checked in _start)
        self.fingerprint = engine_fingerprint(EngineKind.VLLM, config.model, mc.dtype, layout.dtype)
        self.eos_token_ids = (
            frozenset(_config_eos_ids(load_hf_config(config.model)))
            | generation_eos_ids(config.model)
            | frozenset(getattr(tokenizer, "eos_token_ids", ()))
        )
        self._reqs: dict[str, _Tracked] = {}
        self._landing: dict[str, tuple] = {}  # kv.remote requests waiting for their KV: (prompt, params, options)
        self._ids = 0
        self._threaded: int | None = None  # the thread whose torch thread count was set
        log.info(
            "vLLM engine ready: block %s (%d bytes), max_model_len %d",
            self._block_shape,
            self.block_bytes,
            self.max_model_len,
        )

    @staticmethod
    def _start(config: EngineConfig, engine_args_cls, engine_cls, kwargs: dict[str, Any], sized: bool):
        """Build vLLM's engine from ``kwargs``: its config first (vLLM's reading of the model, refused here when the
        pool connector cannot carry its KV), the cache memory sized from that layout (``config.num_kv_blocks`` or
        ``kv_cache_memory_gib``, unless ``sized``: --vllm-arg gpu_memory_utilization), then the engine, which loads
        the weights. Raises ValueError (one line, naming the model) for what vLLM or the connector refuses."""
        from vllm.usage.usage_lib import UsageContext
        from vllm.v1.executor import Executor

        try:
            engine_args = engine_args_cls(**kwargs)
        except TypeError as e:  # an EngineArgs keyword that does not exist
            raise ValueError(f"vLLM refused the engine arguments: {e}") from None
        try:
            vllm_config = engine_args.create_engine_config(UsageContext.ENGINE_CONTEXT)
        except (ValueError, OSError, KeyError) as e:  # pydantic's ValidationError is a ValueError
            raise refuse(config.model, EngineKind.VLLM, f"vLLM cannot serve it: {vllm_reason(e)}") from None
        mc = vllm_config.model_config
        if mc.dtype != config.torch_dtype:
            raise refuse(config.model, EngineKind.VLLM, f"vLLM chose dtype {mc.dtype}; --dtype is {config.dtype}")
        layout = layout_of_model_config(
            config.model, mc, vllm_config.parallel_config, vllm_config.cache_config.cache_dtype
        )
        cache = vllm_config.cache_config
        if not sized and cache.kv_cache_memory_bytes is None:  # (VLLM_CPU_KVCACHE_SPACE sets it on the CPU)
            block_bytes = layout.block_bytes(config.block_size)
            # as ours (kv_sizing.py): no more than the batch holds
            per_seq = blocks_for(mc.max_model_len, config.block_size)
            budget = int(config.kv_cache_memory_gib * 2**30) // block_bytes
            blocks = config.num_kv_blocks or max(1, min(budget, config.max_num_seqs * per_seq))
            cache.kv_cache_memory_bytes = (blocks + 1) * block_bytes  # + vLLM's null block
        return engine_cls(
            vllm_config=vllm_config,
            executor_class=Executor.get_class(vllm_config),
            log_stats=not engine_args.disable_log_stats,
            usage_context=UsageContext.ENGINE_CONTEXT,
        )

    # -- the interface ------------------------------------------------------------------------

    @property
    def block_shape(self) -> tuple[int, ...]:
        return self._block_shape

    @property
    def num_free_blocks(self) -> int:
        return self._scheduler().kv_cache_manager.block_pool.get_num_free_blocks()

    num_landing_blocks = 0  # its cache is vLLM's: KV lands in slots and joins through the connector
    kv_cache = None  # vLLM's own: nothing outside writes it

    def request_block_ids(self, request_id: str) -> list[int]:
        return []  # a request's KV lands in the decode worker's slots (land)

    def reclaim(self) -> None:
        pass

    def land(self, request_id: str, token: int, kv: Any = None) -> RequestOutput | None:
        """A ``remote_kv`` request's KV is in ``kv`` (landing slots, the pool layout) and its prefill sampled ``token``:
        the token's output, checked by the rule every engine's scheduler applies (``token_finish``; stop strings are
        the detokenizer's, mooncake.serving.text); unless it ends the request, vLLM is given it (prompt + outputs,
        their KV loaded). None when the
        request no longer waits (aborted)."""
        waiting = self._landing.pop(request_id, None)
        if waiting is None:
            return None
        prompt, params, options = waiting
        outputs = [*options.outputs, token]
        end = token_finish(
            token, params, self.eos_token_ids, len(outputs), len(prompt) + len(outputs), self.max_model_len
        )
        if end is None:
            self.add_request(
                prompt,
                params,
                request_id,
                PromptKV(len(prompt) + len(outputs) - 1, kv),
                replace(options, outputs=tuple(outputs)),
            )
        return RequestOutput(
            request_id=request_id,
            output_token_ids=outputs,
            new_token_ids=[token],
            finished=end is not None,
            finish_reason=end[0] if end is not None else None,
            num_prompt_tokens=len(prompt),
            num_cached_tokens=0,
            stop_reason=end[1] if end is not None else None,
        )

    last_step_tokens = 0  # vLLM does not say what a step computed: one token per output (set by step)

    def add_request(
        self,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        kv: PromptKV | None = None,
        options: RequestOptions | None = None,
    ) -> str:
        """Queue a request (see the module docstring for what vLLM is given). Raises ValueError for bad input, and
        for what only our engine does (``chunk_tokens``: vLLM's scheduler chunks). ``ahead`` is ignored: vLLM's
        first-come-first-served scheduler takes no request out of turn (its priority policy would, but it also preempts
        running requests by priority). ``kv.remote``: the request waits, outside vLLM, for its KV and its prefill's
        token (``land``)."""
        opts = options or RequestOptions()
        if opts.chunk_tokens:
            raise ValueError("chunk_tokens are our engine's: vLLM's scheduler chunks itself")
        if kv is not None and kv.remote:
            return self._wait_for_kv(prompt_token_ids, sampling_params, request_id, opts)
        cache_salt, initial_output_token_ids = opts.cache_salt, opts.outputs
        external_kv = kv.kv if kv is not None else None
        num_external_tokens = kv.num_tokens if kv is not None else 0
        from vllm import SamplingParams as VllmSamplingParams
        from vllm.inputs import TokensPrompt

        from mooncake.vllm_engine.grammar import GRAMMAR_KEY, INITIAL_KEY

        params = sampling_params or SamplingParams()
        prompt = checked_prompt(
            prompt_token_ids, params, self.max_model_len, self.vocab_size, self.tokenizer is not None
        )
        initial = [int(t) for t in initial_output_token_ids or []]
        remaining = params.max_tokens - len(initial)
        if remaining < 1:
            raise ValueError("initial_output_token_ids already reach max_tokens")
        sequence = prompt + initial
        if external_kv is not None and not 0 < num_external_tokens < len(sequence):
            raise ValueError(f"num_external_tokens must be in [1, {len(sequence) - 1}], got {num_external_tokens}")
        if initial and (params.presence_penalty or params.frequency_penalty):
            # vLLM counts only what it generated: the tokens generated elsewhere (the prefill's first token) would
            # escape the penalty, and the output would differ from vLLM serving alone
            raise ValueError(
                "presence_penalty and frequency_penalty are not supported on vLLM workers yet (vLLM would "
                "not count the first token, sampled on the prefill worker)"
            )
        if params.prompt_logprobs is not None and (external_kv is not None or initial):
            raise ValueError("prompt_logprobs need the whole prompt computed here: no imported KV or initial outputs")
        extra = None
        if params.grammar is not None:  # checked here (a 400), then followed by GrammarLogitsProcessor inside vLLM
            if self._grammars is None:
                if self.tokenizer is None:
                    raise ValueError("structured output needs an engine built with a tokenizer")
                self._grammars = GrammarBook(
                    self.tokenizer.backend.to_str(), self.vocab_size, self.tokenizer.eos_token_ids
                )
            self._grammars.new(params.grammar, initial)
            extra = {GRAMMAR_KEY: params.grammar, INITIAL_KEY: initial}
        rid = request_id if request_id is not None else f"req-{self._next_id()}"
        if rid in self._reqs:
            raise ValueError(f"request {rid!r} is already in the engine")
        vparams = VllmSamplingParams(
            max_tokens=remaining,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k,
            min_p=params.min_p,
            seed=params.seed,
            stop_token_ids=list(params.stop_token_ids),
            ignore_eos=params.ignore_eos,
            detokenize=False,
            presence_penalty=params.presence_penalty,
            frequency_penalty=params.frequency_penalty,
            repetition_penalty=params.repetition_penalty,
            logit_bias=dict(params.logit_bias) or None,
            min_tokens=max(0, params.min_tokens - len(initial)),
            logprobs=params.logprobs,
            extra_args=extra,
            prompt_logprobs=params.prompt_logprobs,
        )
        internal = self._llm.add_request(rid, TokensPrompt(prompt_token_ids=sequence), vparams)
        if external_kv is not None:
            self.bridge.loads[internal] = Load(external_kv, num_external_tokens)
        self.bridge.external[internal] = rid
        self._reqs[rid] = _Tracked(
            internal,
            params,
            len(prompt),
            num_external_tokens if external_kv is not None else 0,
            initial,
            list(initial),
            prompt=prompt,
            cache_salt=cache_salt,
        )
        return rid

    def _wait_for_kv(self, prompt_token_ids, sampling_params, request_id, options: RequestOptions) -> str:
        params = sampling_params or SamplingParams()
        checked_prompt(prompt_token_ids, params, self.max_model_len, self.vocab_size, self.tokenizer is not None)
        if len(options.outputs) >= params.max_tokens:
            raise ValueError("initial outputs already reach max_tokens")
        rid = request_id if request_id is not None else f"req-{self._next_id()}"
        if rid in self._reqs or rid in self._landing:
            raise ValueError(f"request {rid!r} is already in the engine")
        self._landing[rid] = (list(prompt_token_ids), params, options)
        return rid

    def step(self) -> list[RequestOutput]:
        if self.config.num_threads and self._threaded != threading.get_ident():
            # OpenMP gives each new thread (the worker's engine loop) a thread per core, whatever vLLM set for the
            # thread that built it; three engines on two cores would then each compute with two
            _set_num_threads(self.config.num_threads)
            self._threaded = threading.get_ident()
        results = []
        outputs = self._llm.step()
        if self.world > 1:
            self._after_step()
        for out in outputs:
            tracked = self._reqs.get(out.request_id)
            if tracked is None or not out.outputs:
                continue
            comp = out.outputs[0]
            before = len(tracked.outputs)
            tracked.outputs = tracked.initial + list(comp.token_ids)
            new = tracked.outputs[before:]
            if not new and not out.finished:
                continue
            done = out.finished
            reason = FinishReason(comp.finish_reason) if done and comp.finish_reason else None
            stop_reason = None
            if reason == FinishReason.STOP:  # a stop token id, or EOS (vLLM says None): the token that ended it
                stop_reason = comp.stop_reason if isinstance(comp.stop_reason, int) else tracked.outputs[-1]
            if done:
                self._forget(out.request_id)
            results.append(
                RequestOutput(
                    request_id=out.request_id,
                    output_token_ids=list(tracked.outputs),
                    new_token_ids=new,
                    finished=done,
                    finish_reason=reason,
                    num_prompt_tokens=tracked.num_prompt_tokens,
                    num_cached_tokens=tracked.num_cached_tokens
                    or (out.num_cached_tokens or 0),  # ours, else vLLM's prefix cache
                    stop_reason=stop_reason,
                    new_logprobs=_logprobs(comp, before - len(tracked.initial), tracked.params.logprobs),
                    prompt_logprobs=self._prompt_logprobs(tracked, out),
                )
            )
        self.last_step_tokens = len(results)
        return results

    @staticmethod
    def _prompt_logprobs(tracked: _Tracked, out) -> list[TokenLogprob] | None:
        """Ours from vLLM's prompt logprobs (None first, then {token id: Logprob} per prompt token), once."""
        k = tracked.params.prompt_logprobs
        if k is None or tracked.prompt_logprobs_sent or not out.prompt_logprobs:
            return None
        tracked.prompt_logprobs_sent = True
        return [_entry(token, step, k) for token, step in zip(tracked.prompt[1:], out.prompt_logprobs[1:])]

    def abort_request(self, request_id: str) -> bool:
        if self._landing.pop(request_id, None) is not None:
            return True
        if request_id not in self._reqs:
            return False
        self._llm.abort_request([request_id])
        self._forget(request_id)
        return True

    def has_unfinished(self) -> bool:
        return self._llm.has_unfinished_requests()

    def load(self) -> tuple[int, int]:
        reqs = list(self._reqs.values())
        return len(reqs), sum(r.num_prompt_tokens + len(r.outputs) for r in reqs)

    def set_max_num_seqs(self, n: int) -> None:
        self._scheduler().max_num_running_reqs = max(1, n)

    def close(self) -> None:
        unregister_bridge(self._bridge_id)
        try:
            self._llm.engine_core.shutdown()
        except Exception:  # noqa: BLE001 - best effort at exit
            log.debug("vLLM shutdown failed", exc_info=True)

    def computed_blocks(
        self, request_id: str, first_block: int
    ) -> tuple[list[bytes], torch.Tensor | None, bytes | None]:
        """Full blocks ``first_block..`` of a request whose KV vLLM has computed: their block keys (ours: prompt +
        outputs under this engine's fingerprint) and their KV in the pool layout, [n, L, 2, block_size, Hkv, D] on
        the CPU, and the key before them (None for block 0). ``([], None, None)`` when there are none yet or the
        request is gone. Engine thread only, between steps."""
        tracked = self._reqs.get(request_id)
        caches, layout = self.bridge.caches, self.bridge.layout
        if tracked is None or (self.world == 1 and (caches is None or layout is None)):
            return [], None, None
        scheduler = self._scheduler()
        req = scheduler.requests.get(tracked.internal_id)
        if req is None:
            return [], None, None
        bs = self.config.block_size
        end = req.num_computed_tokens // bs
        block_ids = scheduler.kv_cache_manager.get_block_ids(tracked.internal_id)[0][first_block:end]
        if end <= first_block or len(block_ids) < end - first_block:
            return [], None, None
        tokens = (tracked.prompt + tracked.outputs)[: end * bs]
        chain = block_keys(tokens, bs, self.fingerprint, tracked.cache_salt)
        keys, parent = chain[first_block:end], chain[first_block - 1] if first_block else None
        if self.world > 1:
            return keys, self.bridge.shared.kv[torch.tensor(block_ids, dtype=torch.long)], parent
        index = torch.tensor(block_ids, dtype=torch.long, device=caches[0].device)
        kv = torch.stack([layout.export_blocks(cache, index) for cache in caches], dim=1)  # [n, L, 2, bs, Hkv, D]
        return keys, kv.cpu(), parent

    # -- helpers ---------------------------------------------------------------------------------

    def _export(self, layer: int, cache: torch.Tensor | None, block_ids: list[int]) -> torch.Tensor:
        """The pusher's view of a layer: blocks ``block_ids`` in the pool layout, on the CPU (at size N > 1 from the
        shared copy: ``cache`` is None)."""
        if self.world > 1:
            return self.bridge.shared.kv[torch.tensor(block_ids, dtype=torch.long), layer]
        out = self.bridge.layout.export_blocks(cache, torch.tensor(block_ids, dtype=torch.long, device=cache.device))
        return out.cpu()

    def _after_step(self) -> None:
        """At size N > 1, once vLLM's step is done: wait for every rank's heads of its new KV in the shared copy,
        then push the step's completed blocks from there (a prefill worker's; the pusher's own step, layer by
        layer, as the connector drives it at size 1)."""
        executor = self._llm.engine_core.engine_core.model_executor
        pusher, shared = self.bridge.pusher, self.bridge.shared
        steps, self.bridge.steps = self.bridge.steps, []
        for meta in steps:
            if not any(r.num_new_tokens for r in meta.requests):
                continue  # (no forward ran)
            shared.wait_for(meta.step_id, alive=lambda: not getattr(executor, "is_failed", False))
            if pusher is not None:
                pusher.start_step(ConnectorStep(meta.step_id, meta.requests))
                for layer in range(shared.kv.shape[1]):
                    pusher.save_layer(layer, None, None, None)
                pusher.wait_for_save()

    def _forget(self, request_id: str) -> None:
        tracked = self._reqs.pop(request_id, None)
        if tracked is not None:
            self.bridge.loads.pop(tracked.internal_id, None)
            self.bridge.loading.pop(tracked.internal_id, None)
            self.bridge.external.pop(tracked.internal_id, None)

    def _scheduler(self):
        return self._llm.engine_core.engine_core.scheduler  # in-process: InprocClient -> EngineCore

    def _next_id(self) -> int:
        self._ids += 1
        return self._ids


def _parallel_args(config: EngineConfig, kwargs: dict[str, Any]) -> int:
    """vLLM's tensor-parallel size, from --tensor-parallel-size or --vllm-arg tensor_parallel_size (both: the same).
    At N > 1 steps run one at a time (no async scheduling: the worker pushes each step's KV after it), on vLLM's
    multiprocessing executor, and on the CPU each rank gets its share of the cores where vLLM's own binding (a NUMA
    node a rank) has too few nodes."""
    given = kwargs.get("tensor_parallel_size")
    world = config.tensor_parallel_size
    if given is not None and world > 1 and int(given) != world:
        raise ValueError(f"--tensor-parallel-size {world} and --vllm-arg tensor_parallel_size={given} disagree")
    world = int(given) if given is not None else world
    if world > 1:
        if kwargs.get("async_scheduling"):
            raise ValueError(
                "--vllm-arg async_scheduling: at tensor_parallel_size > 1 the worker pushes each step's KV once it "
                "is done, so steps run one at a time"
            )
        kwargs.update(tensor_parallel_size=world, async_scheduling=False)
        kwargs.setdefault("distributed_executor_backend", "mp")
        if not torch.cuda.is_available():
            bind_cpu_ranks(world)
    return world


def _logprobs(completion, start: int, k: int | None) -> list[TokenLogprob] | None:
    """Ours from vLLM's (per position, {token id: Logprob(logprob, rank)} holding the sampled token and the top k),
    for the completion's tokens from ``start`` on; None when the request did not ask."""
    if k is None or completion.logprobs is None:
        return None
    return [
        _entry(token, entries, k) for token, entries in zip(completion.token_ids[start:], completion.logprobs[start:])
    ]


def _entry(token: int, entries: dict, k: int) -> TokenLogprob:
    """One position's TokenLogprob from vLLM's {token id: Logprob(logprob, rank)} (the token and the top k)."""
    top = sorted(((t, e) for t, e in entries.items() if e.rank is not None and e.rank <= k), key=lambda te: te[1].rank)
    return TokenLogprob(int(token), float(entries[token].logprob), tuple((int(t), float(e.logprob)) for t, e in top))


def _config_eos_ids(cfg: dict[str, Any]) -> list[int]:
    """config.json's eos_token_id: one id, a list, or none."""
    eos = cfg.get("eos_token_id")
    if eos is None:
        return []
    return [int(t) for t in (eos if isinstance(eos, list) else [eos])]
