"""The decode worker's side of the hand-off: have the planned prefill worker compute the prompt and write its KV into
this worker's cache (blocks granted for the call, in place) or its landing slots, and answer with the first token.

A part of ``decode.worker.DecodeWorker`` (which inherits it): it reads the worker's config, its prefill channels
(``_prefills``), its cache and landing segments, and its grants (``_grants``: what a transfer-server write may touch,
checked by ``_cache_guard`` and ``_landing_guard``, open only while the call runs).
"""

from __future__ import annotations

import functools
import logging
import secrets

import grpc

from decode.run import Decoding, Failed, FirstToken
from kvstore.wire import segment_to_pb
from mooncake.runtime.process import when_gone
from mooncake.serving.status import REQUEST_CODES, Cancelled
from protos import worker_pb2 as wpb
from transfer.types import host_id

log = logging.getLogger(__name__)

ABORT_TIMEOUT_S = 2.5  # a prefill worker's Abort answers within 2 s (prefill.server.ABORT_WAIT_S); then the grace


class RemotePrefill:
    """Prefill on a prefill worker, its KV landing here (mixed into DecodeWorker)."""

    def _cache_guard(self, token: str, write: bool, offset: int, length: int) -> str | None:
        """The cache segment's capability check (transfer server): bytes of the cache blocks granted to one Prefill
        call, while it runs. The cache is [L, 2, blocks, ...] in units of one block's K or V of one layer: unit u is
        block u % blocks."""
        half = self.block_bytes // (2 * self.engine.block_shape[0])
        units = range(offset // half, (offset + length - 1) // half + 1)
        blocks = (u % self.cache_num_blocks for u in units)
        return self._check_grant(token, blocks, f"cache blocks at bytes {offset}..{offset + length}")

    def _landing_guard(self, token: str, write: bool, offset: int, length: int) -> str | None:
        """The landing segment's capability check (transfer server, every request): bytes of slots granted to one
        Prefill call, while it runs."""
        first, last = offset // self.block_bytes, (offset + length - 1) // self.block_bytes
        return self._check_grant(token, range(first, last + 1), f"landing slots {first}..{last}")

    def _check_grant(self, token: str, indices, what: str) -> str | None:
        """None when every one of ``indices`` (slots or cache blocks) is granted to the live Prefill call ``token``."""
        with self._grants_lock:
            granted = self._grants.get(token)
        if granted is None:
            return "no live landing grant with that token (one Prefill call's, while it runs)"
        if not all(i in granted for i in indices):
            return f"{what} are not all granted to that prefill"
        return None

    def _prefill(
        self, req: wpb.GenerateRequest, sequence: list[int], num_outputs: int, run: Decoding, context
    ) -> FirstToken:
        try:
            return self._granted_prefill(req, sequence, num_outputs, run, context)
        except Failed as e:
            if e.code is not grpc.StatusCode.FAILED_PRECONDITION or not run.blocks:
                raise
        # that prefill worker cannot write this engine's CUDA cache (another host, or no GPU):
        # landing slots, from now on
        log.info(
            "prefill worker at %s cannot write this decode engine's cache: it lands in slots",
            req.placement.prefill_address,
        )
        self._staged_prefills.add(req.placement.prefill_address)
        run.free_blocks(now=True)
        run.slots, _ = self._reserve(
            -(-len(sequence) // self.config.engine_config.block_size), req.placement.prefill_address
        )
        return self._granted_prefill(req, sequence, num_outputs, run, context)

    def _granted_prefill(
        self, req: wpb.GenerateRequest, sequence: list[int], num_outputs: int, run: Decoding, context
    ) -> FirstToken:
        token = secrets.token_hex(16)
        with self._grants_lock:
            self._grants[token] = frozenset(run.blocks or run.slots)
        try:
            return self._call_prefill(req, sequence, num_outputs, run, context, token)
        finally:
            with self._grants_lock:
                del self._grants[token]  # a straggling write after the call (a cancelled prefill's) is refused

    def _stop_prefill(self, address: str, request_id: str, token: str) -> bool:
        """Have the prefill worker end the call we gave up on; True once it says that call writes nothing more (its
        blocks or slots go back now), False when it does not say so in time (they go back ``write_grace_s`` later)."""
        try:
            # wait_for_ready: a connection its keepalive dropped (a worker stopped a while) comes back within the wait
            stub = self._prefills.get(address)
            abort = wpb.AbortRequest(request_id=request_id, landing_token=token)
            return stub.Abort(abort, timeout=ABORT_TIMEOUT_S, wait_for_ready=True).stopped
        except grpc.RpcError as e:
            log.info("prefill worker at %s did not confirm the end of %s: %s", address, request_id, e.code().name)
            return False

    def _landing(self, run: Decoding, token: str) -> wpb.Landing:
        """Where the prefill writes: the granted cache blocks (in place) or landing slots."""
        if not run.blocks:
            return wpb.Landing(
                segment=segment_to_pb(self.landing_segment),
                offsets=[s * self.block_bytes for s in run.slots],
                block_bytes=self.block_bytes,
                token=token,
            )
        segment = segment_to_pb(self.cache_segment) if self.cache_segment is not None else None
        return wpb.Landing(
            segment=segment,
            block_bytes=self.block_bytes,
            token=token,
            cache_blocks=run.blocks,
            cache_num_blocks=self.cache_num_blocks,
            cuda_ipc=self.cuda_ipc,
            host=host_id(),
        )

    def _call_prefill(
        self, req: wpb.GenerateRequest, sequence: list[int], num_outputs: int, run: Decoding, context, token: str
    ) -> FirstToken:
        """Have the planned prefill worker write the KV of ``sequence`` (the prompt and, resuming, the ``num_outputs``
        tokens streamed so far) where ``run`` lands it; return the token after it."""
        placement = req.placement
        landing = self._landing(run, token)
        call = self._prefills.get(placement.prefill_address).Prefill.future(
            wpb.PrefillRequest(
                request_id=req.request_id,
                prompt_token_ids=sequence,
                sampling=req.sampling,
                cache_salt=req.cache_salt if req.HasField("cache_salt") else None,
                plan=placement.plan,
                landing=landing,
                num_output_tokens=num_outputs,
                ahead=placement.ahead,
            ),
            timeout=self.config.prefill_timeout_s,
        )
        when_gone(context, call.cancel)  # the client went away: so does the prefill
        try:
            resp = call.result()
        except grpc.FutureCancelledError:
            run.answered = self._stop_prefill(placement.prefill_address, req.request_id, token)
            raise Cancelled("the client cancelled the request") from None
        except grpc.RpcError as e:
            code = e.code()
            run.answered = code not in (
                grpc.StatusCode.CANCELLED,
                grpc.StatusCode.DEADLINE_EXCEEDED,
                grpc.StatusCode.UNAVAILABLE,
            )
            if code is grpc.StatusCode.DEADLINE_EXCEEDED:
                run.answered = self._stop_prefill(placement.prefill_address, req.request_id, token)
            elif not run.answered:  # the blocks go back once the worker says the call writes nothing (run.free_blocks)
                run.confirm = functools.partial(self._stop_prefill, placement.prefill_address, req.request_id, token)
            if code in REQUEST_CODES:  # the request's own fate: passed on as it is (mooncake.serving.status)
                raise Failed(code, e.details()) from None
            raise Failed(
                grpc.StatusCode.UNAVAILABLE,
                f"prefill worker {placement.prefill_id} at {placement.prefill_address} failed: "
                f"{code.name} {e.details()}",
                failed_instance=placement.prefill_id,
            ) from None
        run.answered = True
        by_tier = {}
        if resp.local_tokens:
            by_tier["dram"] = resp.local_tokens - resp.ssd_tokens
            if resp.ssd_tokens:
                by_tier["ssd"] = resp.ssd_tokens
        if resp.fetched_tokens:
            by_tier["remote"] = resp.fetched_tokens
        logprobs = [resp.first_logprob] if resp.HasField("first_logprob") else []
        return FirstToken(
            resp.first_token,
            resp.cached_tokens,
            {k: v for k, v in by_tier.items() if v},
            logprobs,
            list(resp.prompt_logprobs),
            resp.queue_s,
            resp.prefill_s,
        )
