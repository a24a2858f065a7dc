"""The decode worker computing a prompt itself (the Conductor's local placement, conductor.local): the planned prefix
read from the pool node, the rest through this worker's engine between the batch's decode steps.

A part of a decode worker (``decode.worker.DecodeWorker`` holds one, constructed whole): the engine loop, the pool
clients, write-behind and the Conductor link are given to it.
"""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Iterator

import grpc
import torch

from decode.run import Decoding, stream
from decode.writeback import BlockWriter
from kvstore.client import KVStoreClient, KVStoreUnavailable
from mooncake.blocks import block_keys
from mooncake.engine.request import PromptKV, RequestOptions, SamplingParams
from mooncake.engine.tokenizer import Tokenizer
from mooncake.runtime.channels import ByAddress
from mooncake.runtime.conductor_link import ConductorLink
from mooncake.runtime.process import when_gone
from mooncake.serving.engine_loop import EngineLoop
from mooncake.serving.kvlayout import slot_tensor
from mooncake.serving.sampling import logprob_to_pb
from mooncake.serving.text import OutputText
from protos import worker_pb2 as wpb
from transfer.types import TransferError

log = logging.getLogger(__name__)


class LocalPrefill:
    """Prefill on this decode worker."""

    def __init__(
        self,
        loop: EngineLoop,
        tokenizer: Tokenizer,
        block_size: int,
        fingerprint: bytes,
        block_shape: tuple[int, ...],
        dtype: torch.dtype,
        pool: ByAddress[KVStoreClient],
        writer: BlockWriter | None,
        link: ConductorLink | None,
    ) -> None:
        self.loop, self.tokenizer, self.block_size = loop, tokenizer, block_size
        self.fingerprint, self.block_shape, self.dtype = fingerprint, block_shape, dtype
        self.pool, self.writer, self.link = pool, writer, link

    def serve(
        self,
        req: wpb.GenerateRequest,
        prompt: list[int],
        outputs: list[int],
        params: SamplingParams,
        run: Decoding,
        context,
        t0: float,
    ) -> Iterator[wpb.GenerateChunk]:
        """Compute the prompt here (the Conductor's local placement, conductor.local): read the planned prefix from
        the pool node, run the rest through this engine (in chunks of its token budget, between the batch's decode
        steps), stream as a handed-over request streams; the prompt's new blocks go into the pool as they fill, as
        generated ones do (write-behind), so the next turn finds them there."""
        rid, plan = req.request_id, req.placement.plan
        salt = req.cache_salt if req.HasField("cache_salt") else None
        sequence = prompt + outputs
        external, cached = None, 0
        if (
            plan.fetch_blocks and plan.fetch_address and params.prompt_logprobs is None
        ):  # (those need the whole prompt here)
            external, cached = self._read_prefix(plan.fetch_address, sequence, salt, plan.fetch_blocks)
        outputs_queue: queue.Queue = queue.Queue()
        run.held = self.writer is not None and self.writer.holds
        future = self.loop.submit_nowait(
            outputs_queue.put,
            prompt_token_ids=prompt,
            sampling_params=params,
            request_id=rid,
            kv=PromptKV(cached, external) if external is not None else None,
            options=RequestOptions(
                cache_salt=salt, outputs=tuple(outputs), chunk_tokens=req.placement.local_chunk_tokens, hold=run.held
            ),
        )
        future.result()  # a ValueError (the request's own: INVALID_ARGUMENT) ends it here
        run.decoding()
        when_gone(context, lambda: self.loop.abort(rid))  # the client went away: so does the prompt's computation
        usage = dict(
            prompt_tokens=len(prompt), cached_tokens=cached, cached_tokens_by_tier={"remote": cached} if cached else {}
        )

        def first(out) -> dict:
            run.ttft_s = time.perf_counter() - t0
            if self.writer is not None:  # from the first block not read from the pool: the prompt's own, then generated
                run.written = self.writer.start(rid, req.placement.prefill_node_address, cached)
            if self.link is not None and not out.finished:
                self.link.decode_started(rid, run.ttft_s)
            return {"prompt_logprobs": [logprob_to_pb(lp) for lp in out.prompt_logprobs or ()]}

        text = OutputText(self.tokenizer, prompt, params, outputs, req.text_shown)

        def progress(n: int) -> None:
            if run.written is not None:
                self.writer.progress(run.written, n)

        yield from stream(run, outputs_queue, text, usage, context, first, progress)

    def _read_prefix(
        self, address: str, sequence: list[int], salt: str | None, planned: int
    ) -> tuple[torch.Tensor | None, int]:
        """Up to ``planned`` leading blocks of ``sequence``'s KV from the pool node at ``address``, as the engine
        imports them ([blocks, *block_shape]), and the tokens they make computed (all they hold but the sequence's last
        token).
        Fewer when the node has fewer by now (evicted), none when it cannot be read: the engine computes the rest."""
        bs = self.block_size
        keys = block_keys(sequence, bs, self.fingerprint, salt)[:planned]
        if not keys:
            return None, 0
        try:
            got = self.pool.get(address).get(keys)
        except (KVStoreUnavailable, TransferError, TimeoutError, KeyError, grpc.RpcError) as e:
            log.info("prefix of %d blocks from %s unreadable (%s): computed here instead", len(keys), address, e)
            return None, 0
        if not got.num_blocks:
            return None, 0
        kv = slot_tensor(got.data, self.block_shape, self.dtype)
        return kv, min(
            got.num_blocks * bs, len(sequence) - 1
        )  # its last token is computed here (the first output needs it)
