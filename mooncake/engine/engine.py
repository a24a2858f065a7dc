"""LLMEngine: the single-process inference engine that prefill and decode workers run.

One step is three hops, owned by three objects:

    scheduler.schedule()          who runs, with how many tokens (pure; scheduler.py)
    runner.execute(...)           imports, forward, sampling (torch; runner.py)
    scheduler.update_from_output  advance, stop checks, free blocks (pure)

The engine turns requests into RequestOutputs of token ids; their text and stop strings are the
serving layer's one detokenizer's (mooncake.serving.text). It is synchronous and not thread-safe:
a server runs it in one loop.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from mooncake.blocks import KeyChain, blocks_for, model_fingerprint
from mooncake.engine.block_pool import BlockPool
from mooncake.engine.config import EngineConfig
from mooncake.engine.connector import KVConnector, StepCancelled
from mooncake.engine.cpu import keep_freed_memory
from mooncake.engine.grammar import GrammarBook
from mooncake.engine.kernels import load_paged_decode, load_triton_attention
from mooncake.engine.kv_sizing import cache_blocks
from mooncake.engine.loader import generation_eos_ids, load_model
from mooncake.engine.parallel import SINGLE, TensorParallel
from mooncake.engine.request import (
    FinishReason,
    PromptKV,
    Request,
    RequestOptions,
    RequestStatus,
    SamplingParams,
    TokenLogprob,
    checked_prompt,
)
from mooncake.engine.runner import ModelRunner
from mooncake.engine.scheduler import NoRoom, Scheduler
from mooncake.engine.weights import model_identity

log = logging.getLogger(__name__)


@dataclass(slots=True)
class RequestOutput:
    """A request's progress after a step (or its final state)."""

    request_id: str
    output_token_ids: list[int]  # every token generated so far
    new_token_ids: list[int]  # tokens generated in this step
    finished: bool
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_cached_tokens: int  # prompt tokens served from the prefix cache
    stop_reason: int | None = None  # the stop token that ended it (stop strings: mooncake.serving.text)
    new_logprobs: list[TokenLogprob] | None = None  # one per new token, when the request asked for logprobs
    prompt_logprobs: list[TokenLogprob] | None = None  # prompt tokens 1.. (the first and the last output, when asked)


@dataclass(slots=True)
class EngineStats:
    num_running: int
    num_waiting: int
    num_kv_blocks: int
    num_free_blocks: int
    kv_usage: float
    prefix_hit_rate: float
    num_preemptions: int


class LLMEngine:
    """Paged-KV continuous-batching engine over one model. See module docstring."""

    def __init__(
        self,
        config: EngineConfig,
        connector: KVConnector | None = None,
        tokenizer=None,
        kv_cache_buffer: Callable[[int], Any] | None = None,
        tp: TensorParallel = SINGLE,
    ):
        """``kv_cache_buffer(nbytes)``, when given (CPU only), returns the writable buffer the paged cache lives in: a
        decode worker's cache in shared memory, which prefill workers on its host write a prompt's KV into in place.
        ``tp``: this process is one rank of a tensor-parallel engine (mooncake.engine.parallel); every rank is given
        the same requests and steps alike (its scheduler is deterministic), holding its shard of the model and its
        KV heads' cache."""
        self.config = config
        self.device = torch.device(config.device)
        if self.device.type == "cpu":
            keep_freed_memory()
            if config.num_threads:
                torch.set_num_threads(config.num_threads)
        self.model = load_model(config.model, config.torch_dtype, self.device, tp=tp)
        args = self.model.args
        self.args = args
        limit = args.max_position_embeddings
        if config.max_model_len is not None and config.max_model_len > limit:
            raise ValueError(f"max_model_len {config.max_model_len} exceeds the model's {limit} positions")
        self.max_model_len = config.max_model_len or limit
        self.block_size = config.block_size
        elem = config.kv_torch_dtype.itemsize  # a float8 cache's block: a byte an element
        # a block in the pool layout holds every KV head; this rank's cache block its own (tensor parallelism)
        self.block_bytes = args.num_layers * 2 * config.block_size * args.num_kv_heads * args.head_dim * elem
        cache_block_bytes = self.block_bytes // args.num_kv_heads * self.model.num_kv_heads
        # every rank holds rank 0's block ids: the least any rank has room for (a GPU's free memory may differ)
        num_blocks = tp.least(cache_blocks(config, args, cache_block_bytes, self.max_model_len), self.device)
        # a block as the pool keeps it (--pool-kv-dtype: narrower than the cache) and the identity behind its keys
        self.pool_block_bytes = self.block_bytes // elem * config.pool_torch_dtype.itemsize
        identity = config.model_fingerprint or model_identity(
            config.model, config.dtype, config.kv_dtype, config.pool_dtype
        )
        self.fingerprint = model_fingerprint(identity)
        self.pool = BlockPool(num_blocks, config.enable_prefix_caching)
        self.scheduler = Scheduler(
            self.pool,
            config.block_size,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            self.max_model_len,
            on_finish=self._on_finish,
        )
        kernel = step_kernel = None
        if config.use_kernels and self.device.type == "cpu" and config.torch_dtype == torch.float32:
            kernel = load_paged_decode(config.kernel_dir)
        elif self.device.type == "cuda":
            kernel, step_kernel = load_triton_attention()
            if config.kv_cache_dtype != "auto" and torch.cuda.get_device_capability(self.device) < (8, 9):
                kernel = step_kernel = None  # Triton reads float8 e4m3 from Ada and Hopper on: the torch path
        self.runner = ModelRunner(
            self.model,
            num_blocks,
            config.block_size,
            self.max_model_len,
            self.device,
            config.kv_torch_dtype,
            config.seed,
            decode_kernel=kernel,
            step_kernel=step_kernel,
            kv_buffer=kv_cache_buffer(num_blocks * cache_block_bytes) if kv_cache_buffer is not None else None,
        )
        if config.decode_graphs:
            self.runner.enable_decode_graphs(config.max_num_seqs, self.max_model_len, capture=config.captures_graphs)
        self.connector = connector or KVConnector()
        self.connector.stops_cancelled_steps = True  # step() catches StepCancelled
        self.tokenizer = tokenizer
        self.last_step_tokens = 0  # tokens the last step computed
        self.eos_token_ids = (
            frozenset(args.eos_token_ids)
            | generation_eos_ids(config.model)
            | frozenset(getattr(tokenizer, "eos_token_ids", ()))
        )
        self._ids = itertools.count()
        self._holding: set[str] = set()  # requests whose blocks outlive their end (RequestOptions.hold)
        self._held: dict[str, tuple[list[bytes], list[int], int]] = {}  # ended ones: (block keys, blocks, computed)

    # -- requests -------------------------------------------------------------------

    def add_request(
        self,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        kv: PromptKV | None = None,
        options: RequestOptions | None = None,
    ) -> str:
        """Queue a request; return its id. Raises ValueError for bad input, NoRoom for a ``kv.remote`` request whose
        blocks are not free.

        ``kv``: KV of its leading tokens computed elsewhere (``PromptKV``): imported into the cache when the request is
        admitted, so it starts with ``num_computed_tokens > 0``; or, ``remote``, the whole sequence's, written from
        outside into blocks it is given now (``request_block_ids``): it waits for it until ``land`` (its connector's
        scheduler side holds those blocks past an abort while a writer may still write). ``options``: see
        ``RequestOptions``.
        """
        params = sampling_params or SamplingParams()
        opts = options or RequestOptions()
        prompt = checked_prompt(
            prompt_token_ids, params, self.max_model_len, self.args.vocab_size, self.tokenizer is not None
        )
        outputs = [int(t) for t in opts.outputs]
        if params.prompt_logprobs is not None and (kv is not None or outputs):
            raise ValueError("prompt_logprobs need the whole prompt computed here: no imported KV or initial outputs")
        if len(outputs) >= params.max_tokens:
            raise ValueError("initial outputs already reach max_tokens")
        total = len(prompt) + len(outputs)
        if kv is not None and kv.remote and kv.num_tokens != total:
            raise ValueError(f"remote KV covers the whole sequence of {total} tokens, not {kv.num_tokens}")
        if kv is not None and not kv.remote:
            if not 0 < kv.num_tokens < total:
                raise ValueError(f"imported KV must cover [1, {total - 1}] tokens, got {kv.num_tokens}")
            n_blocks = blocks_for(kv.num_tokens, self.block_size)
            if tuple(kv.kv.shape[1:]) != self.runner.pool_block_shape or kv.kv.shape[0] < n_blocks:
                raise ValueError(
                    f"imported KV of shape {tuple(kv.kv.shape)} does not hold {n_blocks} blocks "
                    f"of shape {self.runner.pool_block_shape}"
                )
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        request = Request(
            request_id=rid,
            prompt_token_ids=prompt,
            sampling_params=params,
            key_chain=KeyChain.start(self.block_size, self.fingerprint, opts.cache_salt),
            eos_token_ids=self.eos_token_ids,
            output_token_ids=outputs,
            external_kv=kv.kv if kv is not None and not kv.remote else None,
            num_external_tokens=kv.num_tokens if kv is not None and not kv.remote else 0,
            num_landed_tokens=kv.num_tokens if kv is not None and kv.remote else 0,
            chunk_tokens=max(0, opts.chunk_tokens),
        )
        if params.grammar is not None:
            self._grammars().add(rid, params.grammar, outputs)
        try:
            if kv is not None and kv.remote:
                self.scheduler.add_landing(request)
            else:
                self.scheduler.add_request(request, ahead=opts.ahead)
        except (ValueError, NoRoom):
            self.runner.drop_request(rid)
            raise
        if params.seed is not None:
            self.runner.add_generator(rid, params.seed, num_sampled=len(outputs) + bool(kv is not None and kv.remote))
        if opts.hold:
            self._holding.add(rid)
        return rid

    def land(self, request_id: str, token: int, kv: torch.Tensor | None = None) -> RequestOutput | None:
        """The KV of a ``kv.remote`` request is here and its prefill sampled ``token``: the token's output, made and
        checked as any sampled token's (finished if it stops the request; else the request decodes from the next
        step). The KV is in the request's blocks, or in ``kv`` [n, L, 2, bs, Hkv, D] (landing slots), imported into
        them when it is scheduled. None when the request no longer waits for it (aborted)."""
        req = self.scheduler.landing.get(request_id)
        if req is None:
            return None
        if kv is not None:
            n_blocks = len(req.block_ids)
            if tuple(kv.shape[1:]) != self.runner.pool_block_shape or kv.shape[0] < n_blocks:
                raise ValueError(f"landed KV of shape {tuple(kv.shape)} does not hold {n_blocks} blocks")
            req.external_kv, req.num_external_tokens = kv, req.num_landed_tokens
        self.scheduler.land(request_id, token)
        if req.sampling_params.grammar is not None and not req.status.finished:
            self.runner.grammars.accept(request_id, token)
        return self._output(req, req.status.finished, None)

    @property
    def num_landing_blocks(self) -> int:
        """Blocks held by requests whose KV is on its way (a decode worker's heartbeat reports them)."""
        return self.scheduler.num_landing_blocks

    @property
    def step_tokens(self) -> int:
        return self.scheduler.max_num_batched_tokens

    def _grammars(self) -> GrammarBook:
        """The engine's constrained requests (built on first use: llguidance reads the tokenizer once, ~0.2 s)."""
        if self.runner.grammars is None:
            backend = getattr(self.tokenizer, "backend", None)
            if backend is None:
                raise ValueError("structured output needs an engine built with a tokenizer")
            self.runner.grammars = GrammarBook(backend.to_str(), self.runner.vocab_size, self.eos_token_ids)
        return self.runner.grammars

    def abort_request(self, request_id: str) -> bool:
        """Abort a queued or running request and free its blocks. False if unknown/finished."""
        request = self.scheduler.requests.get(request_id)
        if request is None:
            return False
        self.scheduler.abort(request_id)
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- what a worker reads and sets (mooncake.engine.interface.WorkerEngine) ---------------

    @property
    def block_shape(self) -> tuple[int, ...]:
        """One block in the pool layout: (L, 2, block_size, Hkv, D), every KV head (whatever this rank holds)."""
        return self.runner.pool_block_shape

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def kv_cache(self) -> torch.Tensor:
        """Its paged cache [L, 2, blocks, bs, Hkv, D]: prefills write reserved blocks of it in place."""
        return self.runner.kv_cache

    @property
    def vocab_size(self) -> int:
        return self.args.vocab_size

    def load(self) -> tuple[int, int]:
        """(requests in the engine, their tokens so far; not those whose KV is on its way); read on the engine's thread
        after a step."""
        requests = [r for r in self.scheduler.requests.values() if r.status != RequestStatus.WAITING_FOR_REMOTE_KV]
        return len(requests), sum(r.num_tokens for r in requests)

    def computed_blocks(
        self, request_id: str, first_block: int
    ) -> tuple[list[bytes], torch.Tensor | None, bytes | None]:
        """Full blocks ``first_block..`` of a request in the engine whose KV is computed: their block keys, their
        KV in the pool layout, [n, L, 2, block_size, Hkv, D] (a copy), and the key before them (None for block 0).
        ``([], None, None)`` when there are none yet or the request is gone (an ended one's blocks are read while
        ``RequestOptions.hold`` keeps them). Engine thread only, between steps
        (the decode worker's write-behind calls it). In the pool's dtype (``pool_kv_dtype``)."""
        req = self.scheduler.requests.get(request_id)
        if req is not None:
            keys, block_ids, computed = req.block_keys(), req.block_ids, req.num_computed_tokens
        elif request_id in self._held:  # it ended: its blocks are held until release_held
            keys, block_ids, computed = self._held[request_id]
        else:
            return [], None, None
        end = min(computed // self.block_size, len(keys), len(block_ids))
        if end <= first_block:
            return [], None, None
        parent = keys[first_block - 1] if first_block else None
        kv = self.runner.export_blocks(block_ids[first_block:end])
        if kv.dtype != self.config.pool_torch_dtype:  # a pool kept narrower (--pool-kv-dtype): float8 at scale 1.0
            kv = kv.to(self.config.pool_torch_dtype)
        return keys[first_block:end], kv, parent

    def close(self) -> None:
        """Nothing to release: the engine's memory goes with it."""

    def set_max_num_seqs(self, n: int) -> None:
        """Cap the running batch (a decode worker keeps its TBT under the SLO with it)."""
        self.scheduler.max_num_seqs = n

    def _on_finish(self, request: Request) -> bool:
        # Called by the scheduler before a finished or aborted request's blocks are freed; True: the connector keeps
        # them (they come back through released_blocks, freed before a later step).
        rid = request.request_id
        self.runner.drop_request(rid)
        if self.connector.request_finished(rid, list(request.block_ids)):
            self._holding.discard(rid)  # the connector keeps them (a prefill may still write them): not ours to read
            return True
        if rid not in self._holding:
            return False
        self._holding.discard(rid)
        self._held[rid] = (request.block_keys(), list(request.block_ids), request.num_computed_tokens)
        return True

    def release_held(self, request_id: str) -> None:
        """The blocks of ``request_id`` (``RequestOptions.hold``) are read: freed if it ended, else freed as it ends.
        Engine thread only."""
        self._holding.discard(request_id)
        held = self._held.pop(request_id, None)
        if held is not None:
            self.pool.free(held[1])

    def reclaim(self) -> None:
        """Free the blocks the connector has let go of (``KVConnector.released_blocks``); every step does first."""
        released = self.connector.released_blocks()
        if released:
            self.pool.free(released)

    # -- the step -------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one scheduling step; return outputs for every request that got a token."""
        self.reclaim()
        out = self.scheduler.schedule()
        self.last_step_tokens = out.num_batched_tokens  # what the step computed (EngineLoop's samples)
        try:
            sampled = self.runner.execute(out, self.connector)
        except StepCancelled:  # every request of the step was cancelled by its caller: dropped mid-step, as aborts
            for s in out.scheduled:
                self.scheduler.abort(s.request.request_id)
            log.info("a step of %d requests stopped mid-way: all of them were cancelled", len(out.scheduled))
            return []
        for rid, entries in sampled.prompt_logprobs.items():
            req = self.scheduler.requests.get(rid)
            for position, entry in entries:
                if req is not None and position == len(req.prompt_logprobs) + 1:  # a recomputed prompt adds nothing new
                    req.prompt_logprobs.append(entry)
        finished = {id(r) for r in self.scheduler.update_from_output(out, sampled.tokens)}
        results = []
        for s in out.scheduled:
            req = s.request
            if req.request_id in sampled.tokens:  # else a prompt chunk short of the end: nothing to report yet
                results.append(self._output(req, id(req) in finished, sampled.logprobs.get(req.request_id)))
        return results

    def _output(self, req: Request, done: bool, logprob: TokenLogprob | None) -> RequestOutput:
        """The output of ``req``'s newest token (``done``: the scheduler finished it). Token ids only: text and stop
        strings are the serving layer's one detokenizer's (mooncake.serving.text)."""
        return RequestOutput(
            request_id=req.request_id,
            output_token_ids=list(req.output_token_ids),
            new_token_ids=[req.output_token_ids[-1]],
            finished=done,
            finish_reason=req.finish_reason if done else None,
            num_prompt_tokens=req.num_prompt_tokens,
            num_cached_tokens=req.num_cached_tokens,
            stop_reason=req.stop_reason if done else None,
            new_logprobs=[logprob] if logprob is not None else None,
            prompt_logprobs=list(req.prompt_logprobs)
            if (len(req.output_token_ids) == 1 or done) and req.sampling_params.prompt_logprobs is not None
            else None,
        )

    def generate(
        self, prompts: list[list[int]], sampling_params: SamplingParams | list[SamplingParams] | None = None
    ) -> list[RequestOutput]:
        """Run ``prompts`` to completion; return their final outputs in input order. Token ids only: stop strings need
        the detokenizer (``mooncake.serving.text.generate_text``)."""
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        if any(p is not None and p.stop for p in params):
            raise ValueError("stop strings are matched on text: mooncake.serving.text.generate_text")
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, params)]
        final: dict[str, RequestOutput] = {}
        while len(final) < len(ids):
            for o in self.step():
                if o.finished:
                    final[o.request_id] = o
        return [final[i] for i in ids]

    # -- KV export / import ---------------------------------------------------------

    def request_block_ids(self, request_id: str) -> list[int]:
        """The block table of a live request (blocks in sequence order)."""
        request = self.scheduler.requests.get(request_id)
        if request is None:
            raise ValueError(f"unknown or finished request {request_id!r}")
        return list(request.block_ids)

    def export_kv(self, block_ids: list[int]) -> torch.Tensor:
        """KV of the given blocks in the pool layout, [n, L, 2, block_size, Hkv, D], on the CPU: every KV head, gathered
        from the ranks under tensor parallelism (a collective: every rank calls it)."""
        if any(not 0 <= b < self.pool.num_blocks for b in block_ids):
            raise ValueError("block id out of range")
        return self.runner.export_blocks(block_ids)

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_kv_blocks=self.pool.num_blocks,
            num_free_blocks=self.pool.num_free_blocks,
            kv_usage=self.pool.usage,
            prefix_hit_rate=self.pool.stats.hit_rate,
            num_preemptions=self.scheduler.num_preemptions,
        )
