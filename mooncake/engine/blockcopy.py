"""Copying KV blocks between caches and pool slots: ``copy_blocks``.

Every hand-off of a prompt's KV (a prefix imported from the pool, a prefill's blocks written
into a decode engine's cache) is "block ``dst_ids[i]`` of one tensor gets block ``src_ids[i]``
of another", along one dimension. A gather and a scatter (``index_select`` then
``index_copy_``) does any such copy in two tensor operations; on the CPU both are element
loops, and where the blocks come in runs that are consecutive on both sides (fresh
allocations mostly are) one ``copy_`` per run is a memcpy instead. Measured on the 2-core VM
with torch's one thread, 256 blocks of 30 layers of SmolLM2's KV (180 MiB;
``python -m benchmarks.blockcopy_bench``): 104 ms as gather and scatter, 47 ms as one run
(2.2x); scattered blocks fall back to the gather and scatter (the same 104 ms).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

MIN_RUN = 4  # on the CPU, copy run by run when the runs average at least this many blocks
_FLOAT8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A float8 tensor (an FP8 cache's KV) as its bytes, a uint8 view of the same shape: what moves it where torch
    has no float8 kernel (index_copy on the CPU, gloo's collectives). Any other tensor as it is."""
    return t.view(torch.uint8) if t.dtype in _FLOAT8 else t


def block_runs(src_ids: Sequence[int], dst_ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """(first source block, first destination block, length) of each maximal run consecutive on both sides."""
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src_ids, dst_ids):
        if runs:
            s0, d0, n = runs[-1]
            if s == s0 + n and d == d0 + n:
                runs[-1] = (s0, d0, n + 1)
                continue
        runs.append((s, d, 1))
    return runs


def copy_blocks(dst: torch.Tensor, dst_ids: Sequence[int], src: torch.Tensor, src_ids: Sequence[int]) -> None:
    """``dst[dst_ids[i]] = src[src_ids[i]]`` along dimension 0 of both (views: pass a transposed cache for its block
    dimension). Across devices or dtypes the source blocks are gathered where they are first, then converted: float8
    and a float dtype meet only where the pool is kept narrower than the cache (``pool_kv_dtype``), whose blocks are
    float8 at scale 1.0 (an FP8 cache's own scaled blocks move as bytes, never converted)."""
    n = len(dst_ids)
    if len(src_ids) != n:
        raise ValueError(f"{len(src_ids)} source blocks for {n} destination blocks")
    if n == 0:
        return
    if (src.dtype in _FLOAT8) != (dst.dtype in _FLOAT8):  # a pool narrower than the cache (--pool-kv-dtype)
        src = src.index_select(0, torch.as_tensor(list(src_ids), dtype=torch.long, device=src.device))
        src, src_ids = src.to(dst.device, dst.dtype), range(n)  # at scale 1.0, saturating at e4m3's +-448
    dst, src = as_bytes(dst), as_bytes(src)
    if src.device != dst.device or src.dtype != dst.dtype:
        src = src.index_select(0, torch.as_tensor(list(src_ids), dtype=torch.long, device=src.device)).to(
            dst.device, dst.dtype
        )
        src_ids = range(n)
    if dst.device.type == "cpu":
        runs = block_runs(src_ids, dst_ids)
        if len(runs) * MIN_RUN <= n:
            for s, d, k in runs:
                dst.narrow(0, d, k).copy_(src.narrow(0, s, k))
            return
    si, di = (torch.as_tensor(list(x), dtype=torch.long, device=dst.device) for x in (src_ids, dst_ids))
    dst.index_copy_(0, di, src.index_select(0, si))
