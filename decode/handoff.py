"""The hand-off from a prefill worker: the planned prefill worker computes the prompt and writes its KV here, into
blocks the engine gave the request at admission (in place) or into landing slots, and answers with the first token.

    Handoff.admit(...)     the request enters the engine waiting for its KV (``remote_kv``: the engine gives it its
                           blocks), or, where its KV cannot land in the engine's cache (stock vLLM; a prefill worker
                           that cannot reach it), takes landing slots
    Handoff.prefill(...)   the Prefill call, under a grant (``Grants``): what the transfer server lets that call write,
                           while it runs; the fence (decode/fence.py) holds what it writes into until its writes are
                           proven over
    Landed.join(token)     the KV is here: the engine takes the request on with the prefill's token, which goes out
                           through the engine's output path (its stop checks) as every later token does

The engine's blocks are the engine's: this part never frees one. Landing slots are this part's: freed when the request
joined the engine (their KV copied in) or, when it never does, once the fence says their writer is done.
"""

from __future__ import annotations

import logging
import secrets
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field

import grpc
import torch

from decode.fence import Fence, Writer
from kvstore.wire import segment_to_pb
from mooncake.blocks import blocks_for
from mooncake.engine.request import PromptKV, RequestOptions, SamplingParams
from mooncake.engine.scheduler import NoRoom
from mooncake.runtime.channels import ByAddress
from mooncake.runtime.process import WRITER_METADATA, when_gone
from mooncake.serving.engine_loop import EngineLoop, Sink
from mooncake.serving.kvlayout import SlotAllocator
from mooncake.serving.status import REQUEST_CODES, Busy, Cancelled
from protos import worker_pb2 as wpb
from transfer.types import host_id

log = logging.getLogger(__name__)

ABORT_TIMEOUT_S = 2.5  # a prefill worker's Abort answers within 2 s (prefill.server.ABORT_WAIT_S)
LOST_CODES = (grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE)


class Failed(Exception):
    """A status to end the stream with: ``code``, a message, and the instance that failed when it was not this one
    (the prefill worker: the gateway's retry reports it to the Conductor)."""

    def __init__(self, code: grpc.StatusCode, message: str, failed_instance: str = "") -> None:
        super().__init__(message)
        self.code = code
        self.failed_instance = failed_instance


@dataclass(slots=True)
class FirstToken:
    token: int
    cached_tokens: int
    by_tier: dict[str, int]
    logprobs: list  # [wpb.TokenLogprob] of the token, when the sampling asked
    prompt_logprobs: list  # [wpb.TokenLogprob] of prompt tokens 1.., when the sampling asked
    queue_s: float = 0.0  # the prefill worker's own queue
    prefill_s: float = 0.0  # and its own prefill

    @property
    def worker_s(self) -> float:
        return self.queue_s + self.prefill_s


class Grants:
    """What each live Prefill call may write through the transfer server: a token -> the cache blocks or landing slots
    granted to it. The transfer server asks ``check`` about every write; a token is revoked when its call ends."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._granted: dict[str, frozenset[int]] = {}

    def grant(self, indices: Iterable[int]) -> str:
        token = secrets.token_hex(16)
        with self._lock:
            self._granted[token] = frozenset(indices)
        return token

    def revoke(self, token: str) -> None:
        with self._lock:
            self._granted.pop(token, None)

    def check(self, token: str, indices: Iterable[int], what: str) -> str | None:
        """None when every one of ``indices`` is granted to the live call ``token``; else why not."""
        with self._lock:
            granted = self._granted.get(token)
        if granted is None:
            return "no live landing grant with that token (one Prefill call's, while it runs)"
        if not all(i in granted for i in indices):
            return f"{what} are not all granted to that prefill"
        return None


def ask_abort(prefills: ByAddress, writer: Writer) -> tuple[bool, str]:
    """Have the prefill worker end ``writer``'s call: (it says the call writes nothing more, the process that said
    so); (False, "") when it could not be asked."""
    try:
        # wait_for_ready: a connection its keepalive dropped (a worker stopped a while) comes back within the wait
        abort = wpb.AbortRequest(request_id=writer.request_id, landing_token=writer.token)
        answer = prefills.get(writer.address).Abort(abort, timeout=ABORT_TIMEOUT_S, wait_for_ready=True)
        return answer.stopped, answer.writer
    except grpc.RpcError as e:
        log.info("prefill worker at %s did not answer the abort of %s: %s", writer.address, writer.request_id, e.code())
        return False, ""


@dataclass
class CacheTarget:
    """Where prompts land in the engine's own cache: its segment (a CPU cache in shared memory) or its CUDA IPC
    handle, its blocks, and the prefill workers found unable to write it (they get landing slots)."""

    segment: object | None
    cuda_ipc: bytes
    num_blocks: int
    staged: set[str] = field(default_factory=set)

    @property
    def shared(self) -> bool:
        return self.segment is not None or bool(self.cuda_ipc)


class Landed:
    """One request's landing: the blocks the engine gave it (the prefill writes them in place) or landing slots
    (``narrow``: the narrow ones, in the pool's dtype)."""

    def __init__(self, request_id: str, blocks: list[int], slots: list[int]) -> None:
        self.request_id, self.blocks, self.slots = request_id, blocks, slots
        self.narrow = False


@dataclass(frozen=True)
class NarrowSlots:
    """Landing slots in the pool's dtype where it is narrower than the cache (--pool-kv-dtype): a hand-off the
    Conductor chose to move narrow (Placement.narrow_handoff) lands here and is converted as it joins the engine."""

    segment: object
    tensor: torch.Tensor  # [slots, L, 2, bs, Hkv, D] in the pool's dtype
    slots: SlotAllocator
    block_bytes: int


class Handoff:
    """The hand-off's part of a decode worker (see the module docstring). Constructed whole by the worker."""

    def __init__(
        self,
        worker_id: str,
        block_size: int,
        block_bytes: int,
        prefill_timeout_s: float,
        loop: EngineLoop,
        fence: Fence,
        grants: Grants,
        prefills: ByAddress,
        cache: CacheTarget,
        landing_segment,
        landing: torch.Tensor,
        slots: SlotAllocator,
        narrow: NarrowSlots | None = None,
    ) -> None:
        self.worker_id, self.block_size, self.block_bytes = worker_id, block_size, block_bytes
        self.prefill_timeout_s = prefill_timeout_s
        self.loop, self.fence, self.grants, self.prefills = loop, fence, grants, prefills
        self.cache = cache
        self.landing_segment, self.landing, self.slots = landing_segment, landing, slots
        self.narrow = narrow
        self.narrow_landings = {"narrow": 0, "full": 0}  # hand-offs the Conductor moved narrow, by how they landed

    def direct(self, prefill_address: str) -> bool:
        """Does this prefill worker's KV land in the engine's cache itself (not in landing slots)?"""
        return self.cache.shared and prefill_address not in self.cache.staged

    def admit(
        self,
        request_id: str,
        prompt: list[int],
        params: SamplingParams,
        outputs: list[int],
        cache_salt: str | None,
        prefill_address: str,
        sink: Sink,
        narrow: bool = False,
        hold: bool = False,
    ) -> Landed:
        """The request enters the engine waiting for its KV (ours gives it its blocks now); where that KV cannot land
        in the engine's cache, or is to move narrow (``narrow``, the Conductor's choice, where this worker has narrow
        slots: where they are all held, it moves full width), it gets landing slots too. Raises Busy when there is no
        room, ValueError for what the engine refuses."""
        total = len(prompt) + len(outputs)
        try:
            blocks = self.loop.submit_nowait(
                sink,
                then=lambda engine, rid: engine.request_block_ids(rid),
                prompt_token_ids=prompt,
                sampling_params=params,
                request_id=request_id,
                kv=PromptKV.landing(total),
                options=RequestOptions(cache_salt=cache_salt, outputs=tuple(outputs), hold=hold),
            ).result()
        except NoRoom as e:
            raise Busy(f"decode worker {self.worker_id}: {e}", "decode_busy") from None
        landed = Landed(request_id, blocks, [])
        if narrow and self.narrow is not None:
            try:
                self._take_slots(landed, total, narrow=True)
                self.narrow_landings["narrow"] += 1
                return landed
            except Busy:  # every narrow slot is held (prompts waiting for their prefill): it moves full width
                self.narrow_landings["full"] += 1
        if not self.direct(prefill_address):
            self._take_slots(landed, total)
        return landed

    def _allocator(self, narrow: bool) -> SlotAllocator:
        return self.narrow.slots if narrow else self.slots

    def _take_slots(self, landed: Landed, num_tokens: int, narrow: bool = False) -> None:
        n = blocks_for(num_tokens, self.block_size)
        allocator = self._allocator(narrow)
        slots = allocator.allocate(n)
        if slots is None:
            raise Busy(
                f"decode worker {self.worker_id} has no {n} free landing slots ({allocator.num_free} free)",
                "decode_busy",
            )
        landed.slots, landed.narrow = slots, narrow

    def join(self, landed: Landed, token: int) -> bool:
        """The prefill answered with ``token``: the request goes on in the engine, whose output path says whether the
        token ends it (slots: their KV copied in, and they are freed). False when it was aborted meanwhile."""
        kv = None
        if landed.slots:
            source = self.narrow.tensor if landed.narrow else self.landing  # (narrow: converted as the engine imports)
            kv = source.index_select(0, torch.tensor(landed.slots, dtype=torch.long))  # [n, L, 2, bs, Hkv, D]
            self._allocator(landed.narrow).free(landed.slots)
            landed.slots = []
        return self.loop.land(landed.request_id, token, kv).result()

    def release(self, landed: Landed) -> None:
        """The request ends before it joined: its slots go back once their writer is done (its blocks are the
        engine's: aborting the request frees them, past the fence)."""
        slots, landed.slots = landed.slots, []
        if slots:
            allocator = self._allocator(landed.narrow)
            self.fence.after_writes(landed.request_id, lambda: allocator.free(slots))

    def prefill(
        self, req: wpb.GenerateRequest, sequence: list[int], num_outputs: int, landed: Landed, context
    ) -> FirstToken:
        """Have the planned prefill worker write the KV of ``sequence`` where ``landed`` says; return its first token.
        A prefill worker that cannot write this engine's cache (another host, no GPU) gets landing slots from then on,
        and is asked again."""
        try:
            return self._granted(req, sequence, num_outputs, landed, context)
        except Failed as e:
            if e.code is not grpc.StatusCode.FAILED_PRECONDITION or landed.slots:
                raise
        address = req.placement.prefill_address
        log.info("prefill worker at %s cannot write this decode engine's cache: it lands in slots", address)
        self.cache.staged.add(address)
        self._take_slots(landed, len(sequence))
        return self._granted(req, sequence, num_outputs, landed, context)

    def _granted(self, req, sequence: list[int], num_outputs: int, landed: Landed, context) -> FirstToken:
        token = self.grants.grant(landed.slots or landed.blocks)
        writer = self.fence.open(req.request_id, req.placement.prefill_address, token)
        try:
            return self._call(req, sequence, num_outputs, landed, context, writer)
        finally:
            self.grants.revoke(token)  # a straggling write through the transfer server is refused from here

    def _landing_pb(self, landed: Landed, token: str) -> wpb.Landing:
        if landed.slots:
            segment, block_bytes = (
                (self.narrow.segment, self.narrow.block_bytes)
                if landed.narrow
                else (self.landing_segment, self.block_bytes)
            )
            return wpb.Landing(
                segment=segment_to_pb(segment),
                offsets=[s * block_bytes for s in landed.slots],
                block_bytes=block_bytes,  # (narrow: the pool's, which tells the prefill worker to convert)
                token=token,
            )
        segment = segment_to_pb(self.cache.segment) if self.cache.segment is not None else None
        return wpb.Landing(
            segment=segment,
            block_bytes=self.block_bytes,
            token=token,
            cache_blocks=landed.blocks,
            cache_num_blocks=self.cache.num_blocks,
            cuda_ipc=self.cache.cuda_ipc,
            host=host_id(),
        )

    def _call(self, req, sequence: list[int], num_outputs: int, landed: Landed, context, writer: Writer) -> FirstToken:
        placement = req.placement
        call = self.prefills.get(placement.prefill_address).Prefill.future(
            wpb.PrefillRequest(
                request_id=req.request_id,
                prompt_token_ids=sequence,
                sampling=req.sampling,
                cache_salt=req.cache_salt if req.HasField("cache_salt") else None,
                plan=placement.plan,
                landing=self._landing_pb(landed, writer.token),
                num_output_tokens=num_outputs,
                ahead=placement.ahead,
            ),
            timeout=self.prefill_timeout_s,
        )
        when_gone(context, call.cancel)  # the client went away: so does the prefill
        try:
            resp = call.result()
        except grpc.FutureCancelledError:
            self.fence.give_up(writer, _writer_of(call))
            raise Cancelled("the client cancelled the request") from None
        except grpc.RpcError as e:
            code = e.code()
            if code in LOST_CODES:  # it may still be writing: the fence holds its blocks until that is proven over
                self.fence.give_up(writer, _writer_of(call))
            else:
                self.fence.answered(writer)
            if code in REQUEST_CODES:  # the request's own fate: passed on as it is (mooncake.serving.status)
                raise Failed(code, e.details()) from None
            raise Failed(
                grpc.StatusCode.UNAVAILABLE,
                f"prefill worker {placement.prefill_id} at {placement.prefill_address} failed: "
                f"{code.name} {e.details()}",
                failed_instance=placement.prefill_id,
            ) from None
        except BaseException:
            self.fence.give_up(writer, _writer_of(call))
            raise
        self.fence.answered(writer)
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


def _writer_of(call) -> str:
    """The writing process the call's first metadata named ("" when none came: the call never reached a worker, or the
    worker died first). Read once the call is over (ended here if it is not), when reading it no longer waits."""
    if not call.done():
        call.cancel()
    try:
        metadata = call.initial_metadata() or ()
    except Exception:  # noqa: BLE001 - a call that never started has none
        return ""
    return next((value for key, value in metadata if key == WRITER_METADATA), "")
