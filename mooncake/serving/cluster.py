"""ClusterBackend: the gateway's way into the disaggregated cluster.

    generate(request)
      keys = block keys of the prompt (DESIGN §4: computed once, here at the edge)
      Conductor.Schedule(keys, lengths)      -> Placement (prefill, decode, prefix plan) | Rejection
      Decode(placement.decode).Generate(...) -> a stream of chunks
                                                (the decode worker calls the prefill worker)

A Rejection becomes ``Rejected`` (HTTP 429 with the Conductor's retry-after) or, when no
instance of a role is alive, ``Unavailable`` (503); a decode worker's RESOURCE_EXHAUSTED
is a rejection too, and a worker dying mid-request ends the stream with Unavailable.
Closing the stream early cancels the Generate call, which cancels the prefill.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator

import grpc
import grpc.aio

from mooncake.blocks import block_keys
from mooncake.serving.types import BackendError, GenerationBackend, GenerationChunk, GenerationRequest, InvalidRequest, Rejected, Unavailable
from protos import conductor_pb2 as cpb
from protos import conductor_pb2_grpc as cpb_grpc
from protos import worker_pb2 as wpb
from protos import worker_pb2_grpc as wpb_grpc

RETRY_AFTER_KEY = "retry-after-s"  # decode.server's trailing metadata on RESOURCE_EXHAUSTED
UNAVAILABLE_REASONS = ("no_prefill_instance", "no_decode_instance")


def sampling_to_pb(req: GenerationRequest) -> wpb.Sampling:
    return wpb.Sampling(max_tokens=req.max_tokens, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, seed=req.seed,
                        stop=list(req.stop), stop_token_ids=list(req.stop_token_ids), ignore_eos=req.ignore_eos,
                        include_stop_str_in_output=req.include_stop_str_in_output)  # fmt: skip


class ClusterBackend(GenerationBackend):
    """Serves ``model_name`` through the Conductor at ``conductor`` (a gRPC address)."""

    def __init__(self, conductor: str, model_name: str, max_model_len: int, block_size: int, fingerprint: bytes,
                 schedule_timeout_s: float = 5.0) -> None:  # fmt: skip
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.fingerprint = fingerprint
        self.schedule_timeout_s = schedule_timeout_s
        self._conductor_address = conductor
        self._conductor: cpb_grpc.ConductorStub | None = None
        self._decoders: dict[str, wpb_grpc.DecodeStub] = {}
        self._channels: list[grpc.aio.Channel] = []
        self._loop: asyncio.AbstractEventLoop | None = None

    def _conductor_stub(self) -> cpb_grpc.ConductorStub:
        loop = asyncio.get_running_loop()
        if loop is not self._loop:  # a grpc.aio channel belongs to the event loop it was made in
            self._loop, self._conductor, self._decoders, self._channels = loop, None, {}, []
        if self._conductor is None:
            channel = grpc.aio.insecure_channel(self._conductor_address)
            self._channels.append(channel)
            self._conductor = cpb_grpc.ConductorStub(channel)
        return self._conductor

    def _decoder(self, address: str) -> wpb_grpc.DecodeStub:
        stub = self._decoders.get(address)
        if stub is None:
            channel = grpc.aio.insecure_channel(address)
            self._channels.append(channel)
            stub = self._decoders[address] = wpb_grpc.DecodeStub(channel)
        return stub

    async def schedule(self, request: GenerationRequest) -> cpb.Placement:
        keys = block_keys(request.prompt_token_ids, self.block_size, self.fingerprint, request.cache_salt)
        msg = cpb.ScheduleRequest(request_id=request.request_id, key_chain=b"".join(keys), prompt_tokens=len(request.prompt_token_ids),
                                  block_tokens=self.block_size, slo_class=request.slo_class)  # fmt: skip
        try:
            resp = await self._conductor_stub().Schedule(msg, timeout=self.schedule_timeout_s)
        except grpc.RpcError as e:
            raise _error(e, "the Conductor") from None
        if resp.HasField("rejection"):
            r = resp.rejection
            cls = Unavailable if r.reason in UNAVAILABLE_REASONS else Rejected
            raise cls(r.message, code=r.reason, retry_after_s=r.retry_after_s)
        return resp.placement

    async def generate(self, request: GenerationRequest) -> AsyncGenerator[GenerationChunk, None]:
        placement = await self.schedule(request)
        msg = wpb.GenerateRequest(request_id=request.request_id, prompt_token_ids=request.prompt_token_ids,
                                  sampling=sampling_to_pb(request), cache_salt=request.cache_salt, placement=placement)  # fmt: skip
        call = self._decoder(placement.decode_address).Generate(msg)
        finished = False
        try:
            async for c in call:
                finished = bool(c.finish_reason)
                yield GenerationChunk(token_ids=list(c.token_ids), text=c.text, finish_reason=c.finish_reason or None,
                                      prompt_tokens=c.prompt_tokens, completion_tokens=c.completion_tokens, cached_tokens=c.cached_tokens,
                                      cached_tokens_by_tier=dict(c.cached_tokens_by_tier))  # fmt: skip
            if not finished:
                raise Unavailable(f"decode worker {placement.decode_id} ended the stream without finishing")
        except grpc.RpcError as e:
            retry = None
            for key, value in (await call.trailing_metadata()) or ():
                if key == RETRY_AFTER_KEY:
                    retry = float(value)
            raise _error(e, f"decode worker {placement.decode_id}", retry) from None
        finally:
            if not finished:
                call.cancel()

    async def health(self) -> dict:
        try:
            listing = await self._conductor_stub().ListInstances(cpb.ListInstancesRequest(), timeout=2.0)
        except grpc.RpcError as e:
            raise Unavailable(f"the Conductor at {self._conductor_address} does not answer: {e.code().name}") from None
        alive = {role: 0 for role in ("prefill", "decode", "kvstore")}
        for inst in listing.instances:
            if inst.state == cpb.ALIVE:
                alive[cpb.Role.Name(inst.role).lower()] += 1
        if not alive["prefill"] or not alive["decode"]:
            raise Unavailable(f"no {'prefill' if not alive['prefill'] else 'decode'} worker is alive")
        return {"status": "ok", "backend": "cluster", "alive": alive, "policy": listing.policy, "admission": listing.admission}

    async def close(self) -> None:
        channels, self._channels = self._channels, []
        self._conductor, self._decoders = None, {}
        for channel in channels:
            await channel.close()


def _error(e: grpc.RpcError, who: str, retry_after_s: float | None = None) -> BackendError:
    code, details = e.code(), e.details() or ""
    if code is grpc.StatusCode.INVALID_ARGUMENT:
        return InvalidRequest(details)
    if code is grpc.StatusCode.RESOURCE_EXHAUSTED:
        reason = details.split(":", 1)[0] if ":" in details else "overloaded"
        return Rejected(details, code=reason, retry_after_s=retry_after_s or 1.0)
    return Unavailable(f"{who} failed: {code.name} {details}".strip())
