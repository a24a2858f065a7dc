"""The decode worker (DESIGN §3): receive a prompt's KV from a prefill worker, then decode in a continuous batch.

    Generate(request, placement)                                        (a server stream)
      1. admission: the running batch stays under the TBT budget; with a full batch of
         landed requests already waiting for places, the request is turned away
         (RESOURCE_EXHAUSTED, retry later); requests still in prefill hold landing room
         (step 2), not places
      2. reserve blocks of the engine's own paged cache, one per prompt block (native engine:
         the cache is a shared-memory segment on the CPU, also served over tcp/rdma, and is
         exported by CUDA IPC on a GPU); stock vLLM, or a prefill worker that cannot reach the
         cache, gets landing slots in a separate segment instead. The worker registers that
         capacity (``kv_blocks``) and every heartbeat reports what its batch and its landings
         hold of it (``kv_held``): the Conductor places a prompt only where its blocks fit
      3. Prefill(plan, landing) on the planned prefill worker: it writes the prompt's KV
         into those blocks (or slots) layer by layer and answers with the first token
      4. add the request to the running batch with its KV already in its blocks (landing
         slots are copied in first, then freed); the first token counts as generated
      5. stream tokens, text and usage until it finishes, writing each generated block into
         the pool as it fills (write-behind, decode/writeback.py: a stream resumed on another
         decode worker loads it); the client going away (gRPC cancellation) aborts it
         everywhere: the prefill call, the engine, the slots

A resumed stream (its decode worker died; the gateway sends the prompt and the tokens the
client has) runs the same steps with prompt + those tokens as the sequence to prefill.

Ownership: a request's state (``DecodeState``) says what it holds: cache blocks or landing
slots while PREFILLING (from step 2 until it joins the batch, or fails: blocks of a prefill
that never answered return ``write_grace_s`` later, so a straggling write lands in nothing
anyone attends), a place in the engine's batch while DECODING; ``Decoding.close`` frees
whichever, in one place. Writes through the transfer server are refused outside the blocks
granted to a live Prefill call (``_cache_guard``, ``_landing_guard``: decode/handoff.py).

The parts: a request's state and what it holds (decode/run.py: ``Decoding.close`` is the one place that frees
it and reports FINISHED to the Conductor), the hand-off from a prefill worker (decode/handoff.py), a prompt
computed here (decode/local_prefill.py), and write-behind (decode/writeback.py).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Iterator

import grpc

from decode.config import DecodeConfig
from decode.handoff import RemotePrefill
from decode.local_prefill import LocalPrefill
from decode.run import DecodeState, Decoding
from decode.writeback import BlockWriter
from kvstore.client import KVStoreClient
from mooncake import tls
from mooncake.engine.interface import EngineKind
from mooncake.engine.request import SamplingParams, match_stop_string
from mooncake.engine.tokenizer import Tokenizer
from mooncake.runtime.channels import ByAddress, client_options
from mooncake.runtime.conductor_link import ConductorLink
from mooncake.serving.build import build_engine
from mooncake.serving.cuda_ipc import export_cuda_tensor
from mooncake.serving.engine_loop import EngineLoop
from mooncake.serving.kvlayout import SlotAllocator, slot_tensor
from mooncake.serving.sampling import logprob_to_pb, params_from_pb
from mooncake.serving.status import Busy
from mooncake.serving.text import TextStream
from protos import conductor_pb2 as cpb
from protos import worker_pb2 as wpb
from protos import worker_pb2_grpc as wpb_grpc
from transfer import TransferConfig, TransferEngine

log = logging.getLogger(__name__)


class DecodeWorker(RemotePrefill, LocalPrefill):
    """Owns the engine, the landing segment and the prefill channels. ``generate`` runs on gRPC threads."""

    def __init__(self, config: DecodeConfig, link: ConductorLink | None = None) -> None:
        self.config = config
        self.tokenizer = Tokenizer.from_dir(config.engine_config.model)
        engine_config = config.engine_config
        self.transfer = TransferEngine(
            TransferConfig(
                node=config.id, listen_host=config.host, shm_dir=config.shm_dir, **config.transport.model_dump()
            )
        )
        # a prefill worker writes landing slots (or cache blocks) only under the grant made for
        # its Prefill call (_prefill)
        self._grants: dict[str, frozenset[int]] = {}
        self._grants_lock = threading.Lock()
        # The engine's own cache is the landing zone (native engine): on the CPU it lives in a shared-memory segment
        # (prefill workers on this host write it in place, others through the transfer server); on CUDA it is exported
        # by CUDA IPC to prefill workers on this host. Landing slots remain for the rest.
        native = config.engine is EngineKind.NATIVE and config.direct_landing
        self.cache_segment = None
        self.cuda_ipc = b""
        place = self._place_cache if native and config.engine_config.device == "cpu" else None
        self.engine = build_engine(
            config.engine, engine_config, vllm_args=config.vllm_args, tokenizer=self.tokenizer, kv_cache_buffer=place
        )
        if native and config.engine_config.device != "cpu":
            self.cuda_ipc = export_cuda_tensor(self.engine.kv_cache)
        self.cache_num_blocks = self.engine.kv_cache.shape[2] if native else 0
        self._staged_prefills: set[str] = set()  # prefill workers that cannot write this cache (another host, no GPU)
        self.max_model_len = self.engine.max_model_len
        self.block_bytes = self.engine.block_bytes
        slots = config.landing_slots or 2 * -(-self.max_model_len // config.engine_config.block_size)
        self.landing_segment = self.transfer.allocate("landing", slots * self.block_bytes, guard=self._landing_guard)
        self.engine_dtype = engine_config.torch_dtype
        self.landing = slot_tensor(
            self.transfer.buffer(self.landing_segment.name), self.engine.block_shape, self.engine_dtype
        )
        self.slots = SlotAllocator(slots)
        self.loop = EngineLoop(self.engine, name="decode-engine")
        self.writer = (
            BlockWriter(self.loop, self.transfer, config.id, config.engine_config.block_size)
            if config.write_behind
            else None
        )
        self._cap = 0  # the Conductor's batch cap (Conductor.decode_cap; 0: none yet)
        self.step_mean: tuple[float, float, float] | None = None  # (batch, context tokens, seconds) of the mean step
        # between the last two heartbeats (None: no step): one sample of the last step alone swung with whatever else
        # the cores were doing at that moment
        options = client_options(config.detect_s)
        self._prefills = ByAddress(lambda address: wpb_grpc.PrefillStub(tls.grpc_channel(address, options=options)))
        self._pool = ByAddress(
            lambda address: KVStoreClient(address, engine=self.transfer, owner=config.id)
        )  # prefixes read here
        self._in_prefill = 0  # requests between admission and joining the batch
        self._count_lock = threading.Lock()
        self.link = link
        self.draining = False

    def _place_cache(self, nbytes: int):
        """The engine's cache, in a shared-memory segment served to prefill workers (the engine calls it once)."""
        self.cache_segment = self.transfer.allocate("kvcache", nbytes, guard=self._cache_guard)
        return self.transfer.buffer(self.cache_segment.name)

    def release_blocks(self, blocks: list[int]) -> None:
        """Give reserved cache blocks back to the engine (a prefill that failed, or was left behind)."""
        self.loop.call(lambda engine: engine.release_blocks(blocks))

    def _direct(self, prefill_address: str) -> bool:
        """Does this request's KV land in the engine's cache itself (not in landing slots)?"""
        return (self.cache_segment is not None or bool(self.cuda_ipc)) and prefill_address not in self._staged_prefills

    @property
    def kv_shared(self) -> bool:
        """Do prompts land in the engine's own cache, which the running batch holds blocks of too (else: in landing
        slots, which only prompts in prefill hold)?"""
        return self.cache_segment is not None or bool(self.cuda_ipc)

    @property
    def kv_blocks(self) -> int:
        """The blocks a prompt's KV lands in (registered with the Conductor: it places a prompt only where it fits)."""
        return self.cache_num_blocks if self.kv_shared else self.slots.num_slots

    @property
    def kv_held(self) -> tuple[int, int]:
        """(blocks of ``kv_blocks`` the running batch holds, blocks held for prompts still in prefill): every
        heartbeat reports them. Read off the engine's counts without its thread: a heartbeat's snapshot."""
        if not self.kv_shared:
            return 0, self.slots.num_slots - self.slots.num_free
        reserved = self.engine.num_reserved_blocks
        return max(0, self.cache_num_blocks - self.engine.num_free_blocks - reserved), reserved

    @property
    def landing_room(self) -> int:
        """Blocks prompts can land in (``Load.landing_blocks``: the Conductor counts the blocks its requests not yet
        decoding hold against it): where prefills write the engine's cache itself, its free blocks and those reserved
        for prefills under way; otherwise the landing slots."""
        if self.kv_shared:
            return self.engine.num_free_blocks + self.engine.num_reserved_blocks
        return self.slots.num_slots

    def _reserve(self, num_blocks: int, prefill_address: str) -> tuple[list[int], list[int]]:
        """(landing slots, cache blocks) for a prompt of ``num_blocks`` blocks: one of them is empty. Raises Busy."""
        if self._direct(prefill_address):
            blocks = self.loop.call(lambda engine: engine.reserve_blocks(num_blocks)).result()
            if blocks is None:
                raise Busy(f"decode worker {self.config.id} has no {num_blocks} free cache blocks", "decode_busy")
            return [], blocks
        slots = self.slots.allocate(num_blocks)
        if slots is None:
            raise Busy(
                f"decode worker {self.config.id} has no {num_blocks} free landing slots ({self.slots.num_free} free)",
                "decode_busy",
            )
        return slots, []

    # -- admission ----------------------------------------------------------------------------

    @property
    def batch_cap(self) -> int:
        """Most running requests: max_num_seqs, lowered to the Conductor's cap (its step model at its TBT SLO)."""
        cap = self.config.engine_config.max_num_seqs
        return min(cap, self._cap) if self._cap else cap

    def set_batch_cap(self, cap: int) -> None:
        """The Conductor's batch cap, from its answer to a heartbeat (0: none known yet). It owns the step model: one
        fit of the steps every decode worker reports, one headroom (its --tbt-headroom). Applied at the next one."""
        self._cap = max(0, int(cap))

    @property
    def step_tokens(self) -> int:
        """Its engine's token budget per step (0: an engine that does not say): it registers it with the Conductor."""
        return self.engine.step_tokens

    def learn_step_times(self) -> int:
        """The mean decode step since the last call (``step_mean``: the Conductor's step model learns from it); apply
        the batch cap to the engine and return it (the heartbeat reports it: the Conductor then refuses what
        ``_admit`` would).

        Called with every heartbeat."""
        n = batches = contexts = seconds = 0
        while True:
            try:
                step = self.loop.steps.popleft()
            except IndexError:
                break
            if (
                step.batch > 0 and step.seconds > 0 and step.new_tokens <= step.batch
            ):  # (a prompt's chunk in it: not a decode step)
                n, batches, contexts, seconds = (
                    n + 1,
                    batches + step.batch,
                    contexts + step.context_tokens,
                    seconds + step.seconds,
                )
        self.step_mean = (batches / n, contexts / n, seconds / n) if n else None
        cap = self.batch_cap
        self.loop.call(lambda engine: engine.set_max_num_seqs(cap))
        return cap

    def _admit(self) -> None:
        if self.draining:
            raise RuntimeError(f"decode worker {self.config.id} is draining")
        # Requests still in their prefill hold landing room (``_reserve`` refuses when it runs out), not a place in the
        # batch: whether the batch has a place when one lands is the Conductor's forecast (early_predictive). Refused
        # here only: a whole batch of requests already landed and waiting for a place.
        cap = self.batch_cap
        waiting = max(0, self.loop.num_running - cap)
        if waiting >= cap:
            raise Busy(
                f"decode worker {self.config.id} has a full batch waiting ({waiting} requests waiting for a place in "
                f"a batch of {cap})",
                "decode_busy",
            )

    # -- the stream ----------------------------------------------------------------------------

    def generate(self, req: wpb.GenerateRequest, context: grpc.ServicerContext) -> Iterator[wpb.GenerateChunk]:
        """Serve one request (see the module docstring). Raises Busy or Failed before or during the stream.

        A resumed stream (``req.output_token_ids``: tokens another decode worker already
        streamed before it died) is prefilled as prompt + those tokens, mostly from the
        pool, and goes on from there; its chunks count and show only what is new.
        """
        t0 = time.perf_counter()
        prompt, outputs = list(req.prompt_token_ids), list(req.output_token_ids)
        sequence = prompt + outputs  # what the prefill computes (its KV lands here)
        local = req.placement.local_prefill
        run = Decoding(self, req.request_id, [], [])  # however it ends, run.close() tells the Conductor (FINISHED)
        try:
            params = self._params(req, prompt, len(outputs), local)
            if not local and not req.placement.prefill_address:
                raise ValueError("the request has no placement (a prefill address from the Conductor)")
            if local and self.config.engine is not EngineKind.NATIVE:
                raise ValueError(
                    f"decode worker {self.config.id} runs {self.config.engine.value}: it cannot compute a prompt itself"
                )
            self._admit()
            if not local:  # (a local prompt: the engine gives it blocks as it computes)
                run.slots, run.blocks = self._reserve(
                    -(-len(sequence) // self.config.engine_config.block_size), req.placement.prefill_address
                )
        except BaseException:
            run.close()
            raise
        if local:
            try:
                yield from self._local(req, prompt, outputs, params, run, context, t0)
            finally:
                run.close()
            return
        try:
            first = self._prefill(req, sequence, len(outputs), run, context)
            run.ttft_s = time.perf_counter() - t0
            run.handoff_s = max(0.0, run.ttft_s - first.worker_s)
            run.parts = (first.queue_s, first.prefill_s)
            if req.placement.admit_at_decode:
                self._check_late_admission(len(sequence))
            stream = TextStream.of_request(self.tokenizer, prompt, params, outputs, req.text_shown)
            finish, text = self._first_token_finish(first.token, params, stream, len(outputs))
            usage = dict(
                prompt_tokens=len(prompt), cached_tokens=first.cached_tokens, cached_tokens_by_tier=first.by_tier
            )
            if finish is not None:
                run.state = DecodeState.DONE
                yield wpb.GenerateChunk(
                    token_ids=[first.token],
                    text=text,
                    finish_reason=finish,
                    completion_tokens=len(outputs) + 1,
                    logprobs=first.logprobs,
                    prompt_logprobs=first.prompt_logprobs,
                    **usage,
                )
                return
            outputs_queue: queue.Queue = queue.Queue()
            salt = req.cache_salt if req.HasField("cache_salt") else None
            run.join(outputs_queue, prompt, params, outputs + [first.token], len(sequence), salt)
            run.written = (
                self.writer.start(req.request_id, req.placement.prefill_node_address, len(sequence))
                if self.writer
                else None
            )
            if self.link is not None:
                self.link.decode_started(req.request_id, run.ttft_s, run.handoff_s, *run.parts)
                run.handoff_s, run.parts = 0.0, (0.0, 0.0)  # reported
            yield wpb.GenerateChunk(
                token_ids=[first.token],
                text=text,
                completion_tokens=len(outputs) + 1,
                logprobs=first.logprobs,
                prompt_logprobs=first.prompt_logprobs,
                **usage,
            )
            yield from self._stream(run, outputs_queue, stream, usage, len(prompt), context)
        finally:
            run.close()

    def _stream(
        self,
        run: Decoding,
        outputs_queue: queue.Queue,
        stream: TextStream,
        usage: dict,
        num_prompt: int,
        context,
        first=None,
    ) -> Iterator[wpb.GenerateChunk]:
        """The engine's outputs for ``run``, as chunks, until it finishes or the client leaves; ``first(out)``, when
        given, is called with the first output (and may add to its chunk: a dict of fields)."""
        while True:
            try:
                out = outputs_queue.get(timeout=0.1)
            except queue.Empty:
                if not context.is_active():
                    return
                continue
            if isinstance(out, BaseException):
                raise RuntimeError(f"the decode engine failed: {out}")
            extra = first(out) if first is not None else {}
            first = None
            run.output_tokens = len(out.output_token_ids)
            # a finished output's text is the engine's, cut before a stop string the new token completed
            text = stream.finish(out.text) if out.finished else stream.push(out.new_token_ids)
            yield wpb.GenerateChunk(
                token_ids=list(out.new_token_ids),
                text=text,
                finish_reason=out.finish_reason.value if out.finished else "",
                completion_tokens=len(out.output_token_ids),
                logprobs=[logprob_to_pb(lp) for lp in out.new_logprobs or ()],
                **usage,
                **extra,
            )
            if out.finished:
                run.state = DecodeState.DONE
                return
            if run.written is not None:  # the newest token's KV is computed by the next step
                self.writer.progress(run.written, num_prompt + len(out.output_token_ids) - 1)

    def _params(
        self, req: wpb.GenerateRequest, prompt: list[int], num_outputs: int, local: bool = False
    ) -> SamplingParams:
        s = req.sampling
        if not prompt:
            raise ValueError("the prompt is empty")
        if num_outputs >= s.max_tokens:
            raise ValueError(f"a resumed stream with {num_outputs} tokens already has its max_tokens ({s.max_tokens})")
        if len(prompt) + s.max_tokens > self.max_model_len:
            raise ValueError(
                f"{len(prompt)} prompt tokens + {s.max_tokens} max_tokens exceed the context of {self.max_model_len}"
            )
        return (
            params_from_pb(s) if local else params_from_pb(s, prompt_logprobs=None)
        )  # a prefill worker computes those

    def _check_late_admission(self, context_tokens: int) -> None:
        """The Conductor's baseline admission rejects here, after the prefill (its prefill is then wasted); the
        placement says when (``Placement.admit_at_decode``): the other admissions decided before the prefill."""
        if self.link is None or not self.link.registered.is_set():
            return
        try:
            verdict = self.link.stub.AdmitAtDecode(
                cpb.AdmitAtDecodeRequest(decode_id=self.config.id, context_tokens=context_tokens), timeout=2.0
            )
        except grpc.RpcError:
            return  # the Conductor is away: serve
        if not verdict.admit:
            raise Busy(verdict.rejection.message, verdict.rejection.reason, verdict.rejection.retry_after_s)

    def _first_token_finish(
        self, token: int, params: SamplingParams, stream: TextStream, num_outputs: int
    ) -> tuple[str | None, str]:
        """Does the prefill's token already end the request? (finish reason or None, the text to show now)."""
        previous = stream.text
        stream.add([token])
        if token in params.stop_token_ids or (not params.ignore_eos and token in self.engine.eos_token_ids):
            # the ending token's text shows only with include_stop_str_in_output (shown_output_ids)
            return "stop", stream.finish(None if params.include_stop_str_in_output else previous)
        if params.stop:
            cut, stop = match_stop_string(stream.text, previous, params)
            if stop is not None:
                return "stop", stream.finish(cut)
        if num_outputs + 1 >= params.max_tokens:
            return "length", stream.finish()
        return None, stream.reveal()

    @property
    def num_in_prefill(self) -> int:
        return self._in_prefill

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self._pool.close()
        self.loop.close()
        self.engine.close()
        self.transfer.close()
