"""Where a prefill job's KV lands on its decode worker: one class per mechanism, chosen once per job
(``landing_for``), so the connector's ``save_layer`` is a loop over its jobs' landings.

    MappedCache   the decode engine's cache mapped here (its shared memory on this host, or its GPU memory by CUDA
                  IPC): each layer's blocks written by tensor copies, a gather and a scatter, no transfer-engine slices
    CacheSegment  the decode engine's cache on another host (or one this worker cannot map), through its segment: a
                  slice per run of blocks consecutive on both sides, per K and V
    LandingSlots  landing slots in the pool layout (stock vLLM decode workers; a cache out of reach): a slice per
                  block, per K and V

Each takes a layer's blocks from one of the connector's three sources: the bound cache in place (``from_cache``; a
CPU cache), a copy made by host staging or a vLLM export (``from_staged``), or, for a mapped GPU cache, the device
itself (``from_device``): ``conn`` is the PoolConnector (its bound cache, ``offset``, ``half``, ``first_layer``),
``job`` a PrefillJob, ``staging`` its HostStaging (untyped here: this module sits below the connector). The
pool's slots, written beside the landing unless the job stores them later, are the connector's part
(prefill/connector.py).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

from mooncake.engine.blockcopy import block_runs, copy_blocks
from mooncake.serving.kvlayout import tensor_bytes
from transfer import Slice, TransferError

log = logging.getLogger(__name__)

# A fault for tests only (tests/test_write_fence_cluster.py): "PART:SECONDS[,PART:SECONDS...]" stalls, once each, the
# copy of a layer into a mapped decode cache for a job whose request id contains PART, inside the copy: a worker
# stalled mid-write
STALL_ENV = "MOONCAKE_FAULT_STALL_MAPPED_COPY"


def _stall(request_id: str) -> None:
    for part, seconds in list(_stalls.items()):
        if part in request_id:
            del _stalls[part]
            log.warning("fault %s: the copy of %s stalls %.1f s", STALL_ENV, request_id, seconds)
            time.sleep(seconds)


def _parse_stalls(text: str) -> dict[str, float]:
    stalls = {}
    for spec in filter(None, text.split(",")):
        part, _, seconds = spec.rpartition(":")
        stalls[part] = float(seconds)
    return stalls


_stalls = _parse_stalls(os.environ.get(STALL_ENV, ""))

# where block i's K (kv=0) or V (kv=1) starts in a staged copy of blocks start..end of one layer
StagedAt = Callable[[int, int], int]


class Landing:
    """Landing slots (the pool layout): a slice per block, per K and V."""

    def __init__(self, job) -> None:
        self.job = job

    def from_cache(self, conn, layer: int, table: list[int], start: int, end: int) -> list[Slice]:
        """Slices writing layer ``layer`` of blocks start..end (cache blocks ``table[start:end]``) from the bound
        cache in place; a landing written here by copies returns none."""
        job, half = self.job, conn.half
        return [
            Slice(
                conn.offset(layer, kv, table[b]),
                job.landing_segment,
                job.landing_at(b, layer, kv, half),
                half,
                job.landing_token,
            )
            for b in range(start, end)
            for kv in (0, 1)
        ]

    def from_staged(self, layer: int, start: int, end: int, half: int, at: StagedAt, kv_major: bool) -> list[Slice]:
        """Slices writing a staged copy of layer ``layer`` of blocks start..end (``at``: where each block's K or V is
        in it; ``kv_major``: host staging's [2, n, ...], else an export's [n, 2, ...])."""
        job = self.job
        return [
            Slice(at(i, kv), job.landing_segment, job.landing_at(start + i, layer, kv, half), half, job.landing_token)
            for i in range(end - start)
            for kv in (0, 1)
        ]

    def from_device(self, staging, cache, layer: int, table: list[int], start: int, end: int) -> bool:
        """Write on the device itself, if this landing can (True); else the connector stages a host copy."""
        return False


LandingSlots = Landing


class CacheSegment(Landing):
    """Blocks of the decode engine's cache, through its segment: a slice per run of blocks consecutive on both
    sides, per K and V."""

    def from_cache(self, conn, layer: int, table: list[int], start: int, end: int) -> list[Slice]:
        job, half = self.job, conn.half
        return [
            Slice(
                conn.offset(layer, kv, src),
                job.landing_segment,
                job.cache_at(dst, layer, kv, half),
                k * half,
                job.landing_token,
            )
            for src, dst, k in block_runs(table[start:end], job.landing_blocks[start:end])
            for kv in (0, 1)
        ]

    def from_staged(self, layer: int, start: int, end: int, half: int, at: StagedAt, kv_major: bool) -> list[Slice]:
        if not kv_major:  # an export's [n, 2, ...]: a block's K and V are apart from its neighbours'
            return super().from_staged(layer, start, end, half, at, kv_major)
        job = self.job
        return [
            Slice(at(i, kv), job.landing_segment, job.cache_at(d, layer, kv, half), k * half, job.landing_token)
            for i, d, k in block_runs(range(end - start), job.landing_blocks[start:end])
            for kv in (0, 1)
        ]


class MappedCache(CacheSegment):
    """The decode engine's cache mapped here: each layer's blocks copied into it, no slices (an export, which never
    maps one, would go through the segment as CacheSegment does)."""

    def from_cache(self, conn, layer: int, table: list[int], start: int, end: int) -> list[Slice]:
        job = self.job
        try:
            _stall(job.request_id)
            copy_blocks(
                job.mapped_cache[layer].transpose(0, 1),
                job.landing_blocks[start:end],
                conn.kv_cache[layer - conn.first_layer].transpose(0, 1),
                table[start:end],
            )
        except (RuntimeError, IndexError) as e:
            job.fail(TransferError(f"writing the decode engine's cache failed: {e}"))
        return []

    def from_device(self, staging, cache, layer: int, table: list[int], start: int, end: int) -> bool:
        staging.copy_to(cache, table[start:end], self.job.mapped_cache[layer], self.job.landing_blocks[start:end])
        return True


class NarrowSlots(Landing):
    """Landing slots in the pool's narrower dtype (the Conductor's narrow hand-off): each layer's blocks converted
    into a copy (the cache's [2, n, ...] order), which is pushed and kept until its push settles."""

    def from_cache(self, conn, layer: int, table: list[int], start: int, end: int) -> list[Slice]:
        job, n = self.job, end - start
        staged = conn.kv_cache[layer - conn.first_layer][:, table[start:end]].to(job.narrow)  # [2, n, bs, Hkv, D]
        half = staged[0, 0].numel() * staged.element_size()
        slices = self.from_staged(layer, start, end, half, lambda i, kv: (kv * n + i) * half, True)
        conn._push(job, tensor_bytes(staged), slices)
        return []


def landing_for(job) -> Landing:
    """The job's landing, by what its decode worker granted and this worker could map."""
    if job.narrow is not None:
        return NarrowSlots(job)
    if job.mapped_cache is not None:
        return MappedCache(job)
    if job.landing_blocks is not None:
        return CacheSegment(job)
    return LandingSlots(job)
