"""The decode worker (DESIGN §3): receive a prompt's KV from a prefill worker, then decode in a continuous batch.

    Generate(request, placement)                                        (a server stream)
      1. admission: the running batch stays under the TBT budget; with a full batch of
         landed requests already waiting for places, the request is turned away
         (RESOURCE_EXHAUSTED, retry later); requests still in prefill hold landing room
         (step 2), not places
      2. the request enters the engine waiting for its KV: the engine gives it blocks of its own
         paged cache, one per prompt block (native engine: the cache is a shared-memory segment
         on the CPU, also served over tcp/rdma, and is exported by CUDA IPC on a GPU); stock
         vLLM, or a prefill worker that cannot reach the cache, gets landing slots in a separate
         segment too. The worker registers that capacity (``kv_blocks``) and every heartbeat
         reports what its batch and its landings hold of it (``kv_held``, the engine's counts):
         the Conductor places a prompt only where its blocks fit
      3. Prefill(plan, landing) on the planned prefill worker: it writes the prompt's KV
         into those blocks (or slots) layer by layer and answers with the first token
      4. the engine takes the request on with that token (landing slots are copied in first,
         then freed): its output path checks the token for a stop as it checks every later one
      5. stream tokens, text and usage until it finishes, writing each generated block into
         the pool as it fills (write-behind, decode/writeback.py: a stream resumed on another
         decode worker loads it); the client going away (gRPC cancellation) aborts it
         everywhere: the prefill call, the engine, the slots

A resumed stream (its decode worker died; the gateway sends the prompt and the tokens the
client has) runs the same steps with prompt + those tokens as the sequence to prefill.

Ownership: the engine owns its blocks from admission to the request's end; a block a prefill may still write is
never given to another request (the write fence, decode/fence.py: the engine's connector holds it until the writer
says its writes are over or its process is gone). Landing slots are the hand-off's. ``Decoding.close`` lets a
request's resources go, in one place. Writes through the transfer server are refused outside the blocks granted to a
live Prefill call (``Grants``, decode/handoff.py).

The parts, each constructed whole here: the write fence (decode/fence.py), the hand-off from a prefill worker
(decode/handoff.py), a prompt computed here (decode/local_prefill.py), a request's state and what it holds
(decode/run.py), and write-behind (decode/writeback.py). ``generate`` calls down into them; none calls back.
"""

from __future__ import annotations

import functools
import logging
import queue
import time
from collections.abc import Iterator

import grpc

from decode.config import DecodeConfig
from decode.fence import Fence
from decode.handoff import CacheTarget, Grants, Handoff, NarrowSlots, ask_abort
from decode.local_prefill import LocalPrefill
from decode.run import Counts, Decoding, stream
from decode.writeback import BlockWriter
from kvstore.client import KVStoreClient
from mooncake import tls
from mooncake.engine.interface import EngineKind
from mooncake.engine.request import SamplingParams
from mooncake.engine.tokenizer import Tokenizer
from mooncake.runtime.channels import ByAddress, client_options
from mooncake.runtime.conductor_link import ConductorLink
from mooncake.serving.build import build_engine
from mooncake.serving.cuda_ipc import export_cuda_tensor
from mooncake.serving.engine_loop import EngineLoop
from mooncake.serving.kvlayout import SlotAllocator, slot_tensor
from mooncake.serving.reports import StepMean, mean_step
from mooncake.serving.sampling import params_from_pb
from mooncake.serving.status import Busy
from mooncake.serving.text import OutputText
from protos import conductor_pb2 as cpb
from protos import worker_pb2 as wpb
from protos import worker_pb2_grpc as wpb_grpc
from transfer import TransferConfig, TransferEngine

log = logging.getLogger(__name__)


class DecodeWorker:
    """Owns the engine, its loop and the parts below; ``generate`` runs on gRPC threads."""

    def __init__(self, config: DecodeConfig, link: ConductorLink | None = None) -> None:
        self.config = config
        self.link = link
        self.draining = False
        engine_config = config.engine_config
        self.tokenizer = Tokenizer.from_dir(engine_config.model)
        self.transfer = TransferEngine(
            TransferConfig(
                node=config.id, listen_host=config.host, shm_dir=config.shm_dir, **config.transport.model_dump()
            )
        )
        options = client_options(config.detect_s)
        prefills = ByAddress(lambda address: wpb_grpc.PrefillStub(tls.grpc_channel(address, options=options)))
        # a prefill worker writes landing slots (or cache blocks) only under the grant made for its Prefill call
        grants = Grants()
        # the engine's connector: it holds blocks a prefill may still write (wake: the engine takes back what it lets
        # go of at once, idle or not)
        self.fence = Fence(
            config.write_grace_s,
            functools.partial(ask_abort, prefills),
            wake=lambda: self.loop.call(lambda engine: engine.reclaim()),
        )
        # The engine's own cache is the landing zone (native engine): on the CPU it lives in a shared-memory segment
        # (prefill workers on this host write it in place, others through the transfer server); on CUDA it is exported
        # by CUDA IPC to prefill workers on this host. Landing slots remain for the rest.
        # (a tensor-parallel cache is split among its ranks' processes: a prompt's KV lands in slots, then each rank's
        # heads go to it)
        native = (
            config.engine is EngineKind.NATIVE and config.direct_landing and engine_config.tensor_parallel_size == 1
        )
        segment = None

        def place(nbytes: int):
            nonlocal segment
            segment = self.transfer.allocate("kvcache", nbytes, guard=self._cache_guard)
            return self.transfer.buffer(segment.name)

        self.engine = build_engine(
            config.engine,
            engine_config,
            vllm_args=config.vllm_args,
            tokenizer=self.tokenizer,
            connector=self.fence if config.engine is EngineKind.NATIVE else None,
            kv_cache_buffer=place if native and engine_config.device == "cpu" else None,
        )
        cuda_ipc = export_cuda_tensor(self.engine.kv_cache) if native and engine_config.device != "cpu" else b""
        self.cache = CacheTarget(segment, cuda_ipc, self.engine.kv_cache.shape[2] if native else 0)
        self.max_model_len = self.engine.max_model_len
        self.block_bytes = self.engine.block_bytes
        self.grants = grants
        bs = engine_config.block_size
        slots = config.landing_slots or 2 * -(-self.max_model_len // bs)
        self.landing_segment = self.transfer.allocate("landing", slots * self.block_bytes, guard=self._landing_guard)
        self.slots = SlotAllocator(slots)
        landing = slot_tensor(
            self.transfer.buffer(self.landing_segment.name), self.engine.block_shape, engine_config.kv_torch_dtype
        )
        self.narrow = None  # narrow landing slots, in the pool's dtype, where --pool-kv-dtype keeps it narrower
        if native and engine_config.pool_kv_dtype != "auto":
            narrow_bytes = self.engine.pool_block_bytes
            narrow_slots = slots * self.block_bytes // narrow_bytes  # the landing slots' bytes: 4x the blocks in fp8
            segment = self.transfer.allocate("landing-narrow", narrow_slots * narrow_bytes, guard=self._narrow_guard)
            tensor = slot_tensor(
                self.transfer.buffer(segment.name), self.engine.block_shape, engine_config.pool_torch_dtype
            )
            self.narrow = NarrowSlots(segment, tensor, SlotAllocator(narrow_slots), narrow_bytes)
        self.loop = EngineLoop(self.engine, name="decode-engine")
        self.writer = BlockWriter(self.loop, self.transfer, config.id, bs) if config.write_behind else None
        if self.writer is not None:  # a short answer's blocks outlive it until its write-behind read them
            self.writer.holds = config.engine is EngineKind.NATIVE
        self._pool = ByAddress(lambda address: KVStoreClient(address, engine=self.transfer, owner=config.id))
        self.handoff = Handoff(
            config.id,
            bs,
            self.block_bytes,
            config.prefill_timeout_s,
            self.loop,
            self.fence,
            grants,
            prefills,
            self.cache,
            self.landing_segment,
            landing,
            self.slots,
            self.narrow,
        )
        self.local = LocalPrefill(
            self.loop,
            self.tokenizer,
            bs,
            self.engine.fingerprint,
            self.engine.block_shape,
            engine_config.pool_torch_dtype,  # the pool's blocks (the engine converts them as it imports them)
            self._pool,
            self.writer,
            link,
        )
        self.counts = Counts()
        self._cap = 0  # the Conductor's batch cap (Conductor.decode_cap; 0: none yet)
        self.step_mean: StepMean | None = None  # the mean decode step between the last two heartbeats (None: no
        # step; mooncake.serving.reports.mean_step says which steps count)

    # -- what the transfer server lets a prefill write ------------------------------------------

    def _cache_guard(self, token: str, write: bool, offset: int, length: int) -> str | None:
        """The cache segment's capability check: bytes of the cache blocks granted to one Prefill call, while it runs.
        The cache is [L, 2, blocks, ...] in units of one block's K or V of one layer: unit u is block u % blocks."""
        half = self.block_bytes // (2 * self.engine.block_shape[0])
        units = range(offset // half, (offset + length - 1) // half + 1)
        blocks = (u % self.cache.num_blocks for u in units)
        return self.grants.check(token, blocks, f"cache blocks at bytes {offset}..{offset + length}")

    def _landing_guard(self, token: str, write: bool, offset: int, length: int) -> str | None:
        """The landing segment's capability check: bytes of slots granted to one Prefill call, while it runs."""
        first, last = offset // self.block_bytes, (offset + length - 1) // self.block_bytes
        return self.grants.check(token, range(first, last + 1), f"landing slots {first}..{last}")

    def _narrow_guard(self, token: str, write: bool, offset: int, length: int) -> str | None:
        """The narrow landing segment's: bytes of its slots granted to one Prefill call, while it runs."""
        size = self.narrow.block_bytes
        first, last = offset // size, (offset + length - 1) // size
        return self.grants.check(token, range(first, last + 1), f"narrow landing slots {first}..{last}")

    # -- what a heartbeat reports ------------------------------------------------------------------

    @property
    def cache_segment(self):
        return self.cache.segment

    @property
    def kv_shared(self) -> bool:
        """Do prompts land in the engine's own cache, which the running batch holds blocks of too (else: in landing
        slots, which only prompts in prefill hold)?"""
        return self.cache.shared

    @property
    def kv_blocks(self) -> int:
        """The blocks a prompt's KV lands in (registered with the Conductor: it places a prompt only where it fits)."""
        return self.cache.num_blocks if self.kv_shared else self.slots.num_slots

    @property
    def kv_held(self) -> tuple[int, int]:
        """(blocks of ``kv_blocks`` the running batch holds, blocks held for prompts in prefill and for prefills that
        may still write): every heartbeat reports them. The engine's and the fence's counts, read as a snapshot."""
        if not self.kv_shared:
            return 0, self.slots.num_slots - self.slots.num_free
        held = self.engine.num_landing_blocks + self.fence.quarantined_blocks
        return max(0, self.cache.num_blocks - self.engine.num_free_blocks - held), held

    @property
    def landing_room(self) -> int:
        """Blocks prompts can land in (``Load.landing_blocks``: the Conductor counts the blocks its requests not yet
        decoding hold against it): where prefills write the engine's cache itself, its free blocks and those of
        requests waiting for their KV; otherwise the landing slots."""
        if self.kv_shared:
            return self.engine.num_free_blocks + self.engine.num_landing_blocks
        return self.slots.num_slots

    @property
    def num_in_prefill(self) -> int:
        return self.counts.in_prefill

    # -- admission ----------------------------------------------------------------------------

    @property
    def batch_cap(self) -> int:
        """Most running requests: max_num_seqs, lowered to the Conductor's cap (its step model at its TBT SLO)."""
        cap = self.config.engine_config.max_num_seqs
        return min(cap, self._cap) if self._cap else cap

    @property
    def num_waiting(self) -> int:
        """Requests whose KV has landed, waiting for a place in the batch (the heartbeat reports them, and
        ``waiting_s``: the Conductor counts this worker full while many have waited past the TBT SLO)."""
        return max(0, self.loop.num_running - self.batch_cap)

    @property
    def waiting_s(self) -> float:
        """How long the longest waiting of them has waited for its next token (0: none waits). A landed request's
        first token is out at its landing, so a wait for a place is a gap between two of its tokens: the longest gap
        now open among the streams (one in the batch waits a step at most)."""
        return self.counts.longest_gap(time.monotonic()) if self.num_waiting else 0.0

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
        steps = []  # (batch, context tokens, seconds, new tokens) of each engine step since the last call
        while True:
            try:
                s = self.loop.steps.popleft()
            except IndexError:
                break
            steps.append((s.batch, s.context_tokens, s.seconds, s.new_tokens))
        self.step_mean = mean_step(*zip(*steps)) if steps else None
        cap = self.batch_cap
        self.loop.call(lambda engine: engine.set_max_num_seqs(cap))
        return cap

    def _admit(self) -> None:
        if self.draining:
            raise RuntimeError(f"decode worker {self.config.id} is draining")
        # Requests still in their prefill hold landing room (admission refuses when it runs out), not a place in the
        # batch: whether the batch has a place when one lands is the Conductor's forecast (early_predictive). Refused
        # here only: a whole batch of requests already landed and waiting for a place.
        cap, waiting = self.batch_cap, self.num_waiting
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
        local = req.placement.local_prefill
        # however it ends, run.close() lets its resources go and tells the Conductor (FINISHED)
        run = Decoding(req.request_id, self.loop, self.handoff, self.counts, self.link)
        try:
            params = self._params(req, prompt, len(outputs), local)
            if not local and not req.placement.prefill_address:
                raise ValueError("the request has no placement (a prefill address from the Conductor)")
            if local and self.config.engine is not EngineKind.NATIVE:
                raise ValueError(
                    f"decode worker {self.config.id} runs {self.config.engine.value}: it cannot compute a prompt itself"
                )
            self._admit()
            if local:
                yield from self.local.serve(req, prompt, outputs, params, run, context, t0)
            else:
                yield from self._handed_over(req, prompt, outputs, params, run, context, t0)
        finally:
            run.close()

    def _handed_over(
        self, req: wpb.GenerateRequest, prompt: list[int], outputs: list[int], params: SamplingParams, run, context, t0
    ) -> Iterator[wpb.GenerateChunk]:
        """A request whose prompt a prefill worker computes: its KV lands here, its first token joins the engine."""
        sequence = prompt + outputs  # what the prefill computes (its KV lands here)
        sink: queue.Queue = queue.Queue()
        salt = req.cache_salt if req.HasField("cache_salt") else None
        run.held = self.writer is not None and self.writer.holds
        run.landed = self.handoff.admit(
            req.request_id,
            prompt,
            params,
            outputs,
            salt,
            req.placement.prefill_address,
            sink.put,
            narrow=req.placement.narrow_handoff,
            hold=run.held,
        )
        first = self.handoff.prefill(req, sequence, len(outputs), run.landed, context)
        run.ttft_s = time.perf_counter() - t0
        run.handoff_s = max(0.0, run.ttft_s - first.worker_s)
        run.parts = (first.queue_s, first.prefill_s)
        if req.placement.admit_at_decode:
            self._check_late_admission(len(sequence))
        if not self.handoff.join(run.landed, first.token):
            return  # aborted meanwhile (the client left)
        run.decoding()
        usage = dict(prompt_tokens=len(prompt), cached_tokens=first.cached_tokens, cached_tokens_by_tier=first.by_tier)

        def started(out) -> dict:
            if not out.finished:
                if self.writer is not None:
                    run.written = self.writer.start(req.request_id, req.placement.prefill_node_address, len(sequence))
                if self.link is not None:
                    self.link.decode_started(req.request_id, run.ttft_s, run.handoff_s, *run.parts)
                    run.handoff_s, run.parts = 0.0, (0.0, 0.0)  # reported
            return {"logprobs": first.logprobs, "prompt_logprobs": first.prompt_logprobs}

        def progress(n: int) -> None:
            if run.written is not None:
                self.writer.progress(run.written, n)

        text = OutputText(self.tokenizer, prompt, params, outputs, req.text_shown)
        yield from stream(run, sink, text, usage, context, started, progress)

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

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self._pool.close()
        self.fence.close()
        self.loop.close()
        self.engine.close()
        self.transfer.close()
