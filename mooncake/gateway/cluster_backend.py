"""ClusterBackend: the gateway's way into the disaggregated cluster.

    generate(request)
      keys = block keys of the prompt (DESIGN §4: computed once, here at the edge, on a thread)
      Conductor.Schedule(keys, lengths)      -> Placement (prefill, decode, prefix plan) | Rejection
                                                (over the Conductor's fast path, conductor/fastpath.py,
                                                where it has one; gRPC otherwise)
      Decode(placement.decode).Generate(...) -> a stream of chunks
                                                (the decode worker calls the prefill worker)

A Rejection becomes ``Rejected`` (HTTP 429 with the Conductor's retry-after); a decode
worker's RESOURCE_EXHAUSTED is a rejection too. A rejection that says the cluster refuses
even the cheapest request (``shed_s``, conductor.core.Conductor.shed_s) makes the gateway
refuse new requests itself, before tokenizing them (``shedding``), while a background
probe asks the Conductor again every time the verdict runs out; the first probe that
hears otherwise ends it. A refusal of a request of N prompt tokens for a reason that a
longer prompt only makes worse has the gateway refuse new requests of its admission class
and at least N tokens itself, before their keys and Schedule, for a moment
(mooncake.gateway.shedding.RefusedSizes). A component that fails the request is
outlived where it can be (mooncake.gateway.recovery): a prefill or decode worker that
fails it before its first token gets it placed elsewhere (the Conductor hears which one
failed), a decode worker dying mid-stream gets it resumed on another one from the pool's
KV, and while the Conductor or every worker of a role is away it waits. What cannot be
outlived within the budget ends as ``Unavailable`` (503). Closing the stream early
cancels the Generate call, which cancels the prefill.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator

import grpc
import grpc.aio

from conductor.fastpath import AsyncFastChannel
from mooncake import tls
from mooncake.blocks import block_keys
from mooncake.gateway.recovery import Action, Fault, RecoveryConfig, RequestProgress
from mooncake.gateway.shedding import AdmissionClass, RefusedSizes
from mooncake.runtime.channels import Conductors, client_options
from mooncake.runtime.framed import ControlError
from mooncake.serving.sampling import logprob_from_pb, sampling_to_pb
from mooncake.serving.status import FAILED_INSTANCE_KEY, RETRY_AFTER_KEY, client_error
from mooncake.serving.types import (
    BackendError,
    GenerationBackend,
    GenerationChunk,
    GenerationRequest,
    Offer,
    Quote,
    Recovery,
    Rejected,
    Unavailable,
)
from protos import conductor_pb2 as cpb
from protos import conductor_pb2_grpc as cpb_grpc
from protos import worker_pb2 as wpb
from protos import worker_pb2_grpc as wpb_grpc

log = logging.getLogger(__name__)

UNAVAILABLE_REASONS = ("no_prefill_instance", "no_decode_instance")
SHED_PROBE_LEAD_S = 0.05  # a shedding gateway probes the Conductor this long before the verdict runs out
FAST_PATH_RECHECK_S = 5.0  # how often to ask a Conductor without a (working) fast path whether it has one now
HASH_INLINE_TOKENS = 4096  # shorter prompts hash their keys on the event loop (well under a millisecond)


class ClusterBackend(GenerationBackend):
    """Serves ``model_name`` through the Conductor at ``conductor`` (a gRPC address)."""

    def __init__(
        self,
        conductor: str,
        model_name: str,
        max_model_len: int,
        block_size: int,
        fingerprint: bytes,
        schedule_timeout_s: float = 5.0,
        recovery: RecoveryConfig | None = None,
    ) -> None:
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.fingerprint = fingerprint
        self.schedule_timeout_s = schedule_timeout_s
        self.recovery = recovery or RecoveryConfig()
        self._conductors = Conductors(conductor)
        self._conductor: cpb_grpc.ConductorStub | None = None
        self._fast: AsyncFastChannel | None = None  # the Conductor's fast path (None: not known yet, or it has none)
        self._fast_checked = -float("inf")  # when the Conductor was last asked where its fast path is
        self._shed_until = (
            0.0  # until then (monotonic), new requests are refused here: the Conductor said it refuses all
        )
        self._shed_rejection: Rejected | None = None  # the rejection that said so (its reason and retry-after)
        self._shed_task: asyncio.Task | None = None  # the probe that asks again before _shed_until
        self._refused = RefusedSizes()  # the sizes the Conductor refused a moment ago, by admission class
        self._reports: set[asyncio.Task] = set()  # FINISHED reports on their way (_forget)
        self._decoders: dict[str, wpb_grpc.DecodeStub] = {}
        self._channels: list[grpc.aio.Channel] = []
        self._loop: asyncio.AbstractEventLoop | None = None

    def _conductor_stub(self) -> cpb_grpc.ConductorStub:
        loop = asyncio.get_running_loop()
        if loop is not self._loop:  # a grpc.aio channel belongs to the event loop it was made in
            self._loop, self._conductor, self._decoders, self._channels = loop, None, {}, []
            self._fast, self._fast_checked = None, -float("inf")
        if self._conductor is None:
            channel = tls.grpc_aio_channel(self._conductors.current, options=client_options(self.recovery.detect_s))
            self._channels.append(channel)
            self._conductor = cpb_grpc.ConductorStub(channel)
        return self._conductor

    def _next_conductor(self, failed: str) -> None:
        """The Conductor at ``failed`` did not answer: use the next one (once, however many requests saw it fail)."""
        if self._conductors.failed(failed):
            self._conductor, self._fast, self._fast_checked = None, None, -float("inf")

    def _decoder(self, address: str) -> wpb_grpc.DecodeStub:
        stub = self._decoders.get(address)
        if stub is None:
            channel = tls.grpc_aio_channel(address, options=client_options(self.recovery.detect_s))
            self._channels.append(channel)
            stub = self._decoders[address] = wpb_grpc.DecodeStub(channel)
        return stub

    async def schedule(self, request: GenerationRequest, progress: RequestProgress | None = None) -> cpb.Placement:
        """A placement for ``request`` (resuming: for its prompt and the tokens streamed so far).

        Raises _Fault for what a retry may outlive (the Conductor away, no instance alive),
        Rejected or InvalidRequest for what it may not.
        """
        sequence = request.prompt_token_ids + (progress.output_token_ids if progress else [])
        if len(sequence) >= HASH_INLINE_TOKENS:  # a long prompt's keys take milliseconds: off the event loop
            keys = await asyncio.to_thread(block_keys, sequence, self.block_size, self.fingerprint, request.cache_salt)
        else:
            keys = block_keys(sequence, self.block_size, self.fingerprint, request.cache_salt)
        msg = cpb.ScheduleRequest(
            request_id=request.request_id,
            key_chain=b"".join(keys),
            prompt_tokens=len(sequence),
            block_tokens=self.block_size,
            slo_class=request.slo_class,
            failed=progress.report_failed() if progress else (),
            priority=request.priority,
            tenant=request.tenant,
            tenant_weight=request.tenant_weight,
            retry=progress is not None and progress.attempts > 0,  # placed before: it goes ahead of the queue now
            follows=request.follows or "",
            ttft_slo_s=request.ttft_slo_s,
            tbt_slo_s=request.tbt_slo_s,
        )
        started = time.monotonic()
        while True:
            resp = await self._schedule_once(msg, progress)
            if resp.HasField("placement") or resp.HasField("rejection") or resp.wait_s <= 0:
                break
            # early_wait: predicted to meet its SLOs if placed later; the Conductor keeps its place in line
            if progress is not None:
                progress.maybe_placed = False
            await asyncio.sleep(resp.wait_s)
            msg.waited_s = time.monotonic() - started
            msg.ClearField("failed")  # reported once
        if resp.HasField("rejection"):
            if progress is not None:
                progress.maybe_placed = False
            r = resp.rejection
            if r.reason in UNAVAILABLE_REASONS:
                raise _Fault(Fault.NO_INSTANCE, Unavailable(r.message, code=r.reason, retry_after_s=r.retry_after_s))
            offer = Offer(r.retry_after_s, r.offer_slo_class or None) if r.retry_after_s > 0 else None
            rejected = Rejected(r.message, code=r.reason, retry_after_s=r.retry_after_s, offer=offer)
            if resp.shed_s > 0:
                self._shed(rejected, resp.shed_s)
            if not msg.retry and not msg.waited_s:  # what a new request would hear (a retry goes ahead of the
                # queue; a waiter spent part of its TTFT SLO)
                self._refused.note_refused(_admission_class(request), msg.prompt_tokens, rejected, time.monotonic())
            if progress is not None and progress.faults:
                raise _Fault(
                    Fault.BUSY, rejected
                )  # it outlived a failure already: wait for room rather than fail it now
            raise rejected
        if progress is not None and progress.quote is None and resp.HasField("predicted"):
            progress.quote = Quote(msg.waited_s + resp.predicted.ttft_s, resp.predicted.tbt_s)  # its first Schedule's
        if not msg.retry:
            self._refused.note_placed(_admission_class(request), msg.prompt_tokens)
        return resp.placement

    async def _schedule_once(self, msg: cpb.ScheduleRequest, progress: RequestProgress | None):
        """One Schedule call. Raises _Fault when the Conductor is away, the client's error for what it refused."""
        address = self._conductors.current
        if progress is not None:
            progress.maybe_placed = True  # until it answers otherwise: the answer may never reach us
        try:
            resp = await self._conductor_call("Schedule", msg)
        except grpc.RpcError as e:
            error = client_error(e.code(), e.details() or "", f"the Conductor at {address}")
        except ControlError as e:
            error = client_error(e.code, e.details, f"the Conductor at {address}")
        else:
            error = None
        if error is not None:
            if isinstance(error, Unavailable):
                self._next_conductor(address)
                raise _Fault(Fault.CONDUCTOR, error) from None
            raise error from None
        return resp

    async def _conductor_call(self, method: str, msg):
        """``method`` (Schedule or Report) over the fast path when the Conductor has one (and it answers), else over
        gRPC."""
        stub = self._conductor_stub()
        fast = await self._fast_channel(stub)
        if fast is not None:
            try:
                return await fast.call(method, msg, self.schedule_timeout_s)
            except (ConnectionError, TimeoutError, OSError) as e:  # gRPC decides whether the Conductor is away
                log.warning("the Conductor's fast path at %s failed (%s): %s goes over gRPC", fast.target, e, method)
                self._fast, self._fast_checked = None, time.monotonic()
                await fast.close()
        return await getattr(stub, method)(msg, timeout=self.schedule_timeout_s)

    # -- shedding ------------------------------------------------------------------------------

    def shedding(self) -> Rejected | None:
        """A 429 for a new request, at once, while the Conductor's last word is that it refuses every request."""
        if time.monotonic() >= self._shed_until or self._shed_rejection is None:
            return None
        r = self._shed_rejection
        return Rejected(
            f"{r.message} (refused at the gateway: the cluster refuses every request for now)",
            code=r.code,
            retry_after_s=r.retry_after_s,
        )

    def _shed(self, rejected: Rejected, shed_s: float) -> None:
        self._shed_until, self._shed_rejection = time.monotonic() + shed_s, rejected
        if self._shed_task is None or self._shed_task.done():
            self._shed_task = asyncio.get_running_loop().create_task(self._probe_until_accepting())

    async def _probe_until_accepting(self) -> None:
        """While shedding, ask the Conductor (a probe: it decides and records nothing) shortly before the verdict runs
        out; a verdict of 0, or a Conductor that does not answer, ends the shedding (requests then ask it
        themselves)."""
        try:
            while True:
                await asyncio.sleep(max(0.0, self._shed_until - time.monotonic() - SHED_PROBE_LEAD_S))
                try:
                    resp = await self._conductor_call("Schedule", cpb.ScheduleRequest(probe=True))
                except (grpc.RpcError, ControlError):
                    resp = None
                if resp is None or resp.shed_s <= 0:
                    self._shed_until = 0.0
                    return
                self._shed_until = time.monotonic() + resp.shed_s
        except asyncio.CancelledError:
            self._shed_until = 0.0
            raise

    async def _fast_channel(self, stub: cpb_grpc.ConductorStub) -> AsyncFastChannel | None:
        """The Conductor's fast path, asked for (over gRPC) at most every FAST_PATH_RECHECK_S."""
        if self._fast is not None or time.monotonic() - self._fast_checked < FAST_PATH_RECHECK_S:
            return self._fast
        self._fast_checked = time.monotonic()
        address = self._conductors.current
        try:
            listing = await stub.ListInstances(
                cpb.ListInstancesRequest(role=cpb.KVSTORE), timeout=self.schedule_timeout_s
            )
        except grpc.RpcError:
            return None  # the Schedule call that follows says what is wrong
        if listing.control_port and address == self._conductors.current:
            self._fast = AsyncFastChannel(f"{address.rpartition(':')[0]}:{listing.control_port}")
        return self._fast

    async def generate(self, request: GenerationRequest) -> AsyncGenerator[GenerationChunk, None]:
        """Stream ``request``, placing it again when a component fails it (see mooncake.gateway.recovery)."""
        progress = RequestProgress(time.monotonic(), self.recovery)
        received = False
        try:
            async with contextlib.aclosing(self._generate(request, progress)) as chunks:
                async for chunk in chunks:
                    received = True
                    yield chunk
        finally:
            if progress.maybe_placed and not received:
                self._forget(request.request_id)

    async def _generate(
        self, request: GenerationRequest, progress: RequestProgress
    ) -> AsyncGenerator[GenerationChunk, None]:
        usage: tuple[int, dict[str, int]] | None = None  # the first prefill's cache hits: what the client is told
        refused = self._refused.refuses(_admission_class(request), len(request.prompt_token_ids), time.monotonic())
        if refused is not None:  # before its keys and Schedule: the Conductor refused one as long a moment ago
            raise refused
        while True:
            try:
                placement = await self.schedule(request, progress)
                progress.placed()
                first = True
                async for c in self._stream(request, placement, progress):
                    head = usage is None  # the request's first chunk
                    if usage is None:
                        usage = (c.cached_tokens, dict(c.cached_tokens_by_tier))
                    elif first and progress.resumed:
                        progress.resumed_prefill(
                            len(request.prompt_token_ids) + len(progress.output_token_ids), c.cached_tokens
                        )
                    first = False
                    progress.received(list(c.token_ids), c.text, bool(c.finish_reason))
                    yield GenerationChunk(
                        token_ids=list(c.token_ids),
                        text=c.text,
                        finish_reason=c.finish_reason or None,
                        prompt_tokens=c.prompt_tokens,
                        completion_tokens=c.completion_tokens,
                        cached_tokens=usage[0],
                        cached_tokens_by_tier=usage[1],
                        recovery=self._recovery(request, progress) if c.finish_reason else None,
                        logprobs=[logprob_from_pb(lp) for lp in c.logprobs]
                        if request.sampling.logprobs is not None
                        else None,
                        prompt_logprobs=[logprob_from_pb(lp) for lp in c.prompt_logprobs]
                        if c.prompt_logprobs
                        else None,
                        quote=progress.quote if head else None,
                    )
                    if c.finish_reason:
                        return
                raise _Fault(
                    Fault.DECODE,
                    Unavailable(f"decode worker {placement.decode_id} ended the stream without finishing"),
                    placement.decode_id,
                )
            except _Fault as fault:
                step = progress.failure(fault.fault, time.monotonic(), fault.instance)
                if step.action is Action.GIVE_UP:
                    error = fault.error
                    error.message = f"{error.message} ({step.reason})"
                    error.retry_after_s = error.retry_after_s or progress.retry_after_s
                    raise error from None
                log.warning(
                    "request %s: %s: %s; %s in %.2f s",
                    request.request_id,
                    step.reason,
                    fault.error.message,
                    step.action.value,
                    step.delay_s,
                )
                if step.delay_s:
                    await asyncio.sleep(step.delay_s)

    def _forget(self, request_id: str) -> None:
        """Tell the Conductor that ``request_id`` ended before any token (the client left, or every placement failed).

        The Conductor counts a placed request in its decode worker's batch until the worker
        reports it finished, and a worker that never got it never will: the client hung up
        while Schedule's answer was on its way, or before the worker's admission. A storm of
        such requests (tests/test_chaos.py) had the Conductor count 10 requests in prefill on
        a worker holding none, and refuse (decode_busy) until the flights expired. A second
        report, when the worker did have it, and a report of a request never placed, are
        ignored. Sent on a task of its own: the request's own task may be being cancelled."""
        task = asyncio.get_running_loop().create_task(self._report_finished(request_id))
        self._reports.add(task)
        task.add_done_callback(self._reports.discard)

    async def _report_finished(self, request_id: str) -> None:
        msg = cpb.ReportRequest(requests=[cpb.RequestEvent(request_id=request_id, kind=cpb.RequestEvent.FINISHED)])
        try:
            await self._conductor_call("Report", msg)
        except (grpc.RpcError, ControlError, ConnectionError, TimeoutError, OSError) as e:
            log.debug("could not report %s finished (%s): the Conductor expires it", request_id, e)

    @staticmethod
    def _recovery(request: GenerationRequest, progress: RequestProgress) -> Recovery | None:
        if not progress.faults:
            return None
        recovery = Recovery(
            [f"{f.value}:{i}" for f, i, _ in progress.faults],
            [t for _, _, t in progress.faults],
            progress.attempts,
            progress.resumed,
            progress.loaded_tokens,
            progress.recomputed_tokens,
        )
        log.info(
            "request %s finished after outliving %s (%d placements, %d resumed; %d tokens loaded, %d recomputed)",
            request.request_id,
            ", ".join(recovery.faults),
            recovery.placements,
            recovery.resumes,
            recovery.loaded_tokens,
            recovery.recomputed_tokens,
        )
        return recovery

    async def _stream(
        self, request: GenerationRequest, placement: cpb.Placement, progress: RequestProgress
    ) -> AsyncGenerator[wpb.GenerateChunk, None]:
        """One placement's chunks from its decode worker. Raises _Fault when a worker fails it."""
        msg = wpb.GenerateRequest(
            request_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            sampling=sampling_to_pb(request.sampling),
            cache_salt=request.cache_salt,
            placement=placement,
            output_token_ids=progress.output_token_ids,
            text_shown=progress.text_shown,
        )
        call = self._decoder(placement.decode_address).Generate(msg)
        finished = False
        try:
            async for c in call:
                finished = bool(c.finish_reason)
                yield c
        except grpc.RpcError as e:
            retry, failed = None, ""
            for key, value in (await call.trailing_metadata()) or ():
                if key == RETRY_AFTER_KEY:
                    retry = float(value)
                elif key == FAILED_INSTANCE_KEY:
                    failed = value
            error = client_error(e.code(), e.details() or "", f"decode worker {placement.decode_id}", retry)
            if isinstance(error, Unavailable) and e.code() is not grpc.StatusCode.CANCELLED:
                if failed:
                    raise _Fault(Fault.PREFILL, error, failed) from None
                raise _Fault(Fault.DECODE, error, placement.decode_id) from None
            if isinstance(error, Rejected) and progress.faults:
                raise _Fault(Fault.BUSY, error) from None
            raise error from None
        finally:
            if not finished:
                call.cancel()

    async def health(self) -> dict:
        address = self._conductors.current
        try:
            listing = await self._conductor_stub().ListInstances(cpb.ListInstancesRequest(), timeout=2.0)
        except grpc.RpcError as e:
            self._next_conductor(address)
            raise Unavailable(f"the Conductor at {address} does not answer: {e.code().name}") from None
        alive = {role: 0 for role in ("prefill", "decode", "kvstore")}
        for inst in listing.instances:
            if inst.state == cpb.ALIVE:
                alive[cpb.Role.Name(inst.role).lower()] += 1
        if not alive["prefill"] or not alive["decode"]:
            raise Unavailable(f"no {'prefill' if not alive['prefill'] else 'decode'} worker is alive")
        return {
            "status": "ok",
            "backend": "cluster",
            "alive": alive,
            "policy": listing.policy,
            "admission": listing.admission,
        }

    async def close(self) -> None:
        channels, self._channels = self._channels, []
        self._conductor, self._decoders = None, {}
        fast, self._fast = self._fast, None
        if fast is not None:
            await fast.close()
        if self._shed_task is not None:
            self._shed_task.cancel()
        for channel in channels:
            await channel.close()


def _admission_class(request: GenerationRequest) -> AdmissionClass:
    """What the Conductor admits a request by besides its size (RefusedSizes keeps refusals apart by it): a request
    asking for its own SLO targets is not refused for another's."""
    return request.slo_class, request.priority, request.tenant, request.ttft_slo_s, request.tbt_slo_s


class _Fault(Exception):
    """A fault the request may outlive: what failed (``instance``, when known) and the error the client gets if not."""

    def __init__(self, fault: Fault, error: BackendError, instance: str = "") -> None:
        super().__init__(error.message)
        self.fault, self.error, self.instance = fault, error, instance
