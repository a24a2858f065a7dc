"""One layer of vLLM's paged KV cache, converted to and from the pool layout (DESIGN §4).

vLLM hands a connector each attention layer's cache as a tensor of logical shape
``[num_blocks, Hkv, block_size, 2 * D]``, but what lies inside a block depends on the
attention backend and, on the CPU, on the instruction set: CPU_ATTN packs K for its
kernels (on this machine's AVX-512 "vec" path K is not ``[Hkv, bs, D]``), FLASH_ATTN
keeps per-token ``[K | V]`` rows. Rather than copy each backend's packing rules, the
converter asks the backend itself once, at start-up:

    probe:  write token t, head h, dim d of K with the code (t*Hkv + h)*D + d and of V
            with n + that code (n = bs*Hkv*D), through the layer's own cache writer
            (``impl.do_kv_cache_update``, what the forward pass uses), into one block;
            read the block back in its logical order: element j holds code c(j)
    export: pool[c] = block[j], so a gather by the inverse permutation turns whole
            blocks of a layer into ``[2, bs, Hkv, D]`` each
    import: the same writer, given K and V in the pool layout and the tokens' slots,
            so packing is the backend's own and only the tokens asked for are written

A writer that is not a permutation of elements fails the probe with a clear error. Codes are written in base-128
digits, a pass per digit, because bfloat16 holds integers exactly only up to 256. An FP8 cache (``kv_cache_dtype``
fp8: vLLM keeps float8 e4m3 bytes, uint8 to torch) is probed in base-16 digits, which e4m3 holds exactly: the digits
go to the writer as float8 values, which ``fp8_writer`` turns into the layer's values (times its scale) and vLLM's
writer quantizes back to the same bytes; its blocks leave as float8 (the pool layout's bytes) and come back through
the same writer.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

Writer = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]  # (key [T,H,D], value [T,H,D], slots [T])
_DIGIT = 128
_FP8_DIGIT = 16  # e4m3 holds 0..15 exactly
_EXACT_INTEGERS = (torch.float32, torch.float16, torch.bfloat16)  # each holds 0.._DIGIT exactly
FP8 = torch.float8_e4m3fn


def fp8_writer(write: Writer, k_scale: float, v_scale: float, dtype: torch.dtype) -> Writer:
    """A writer of float8 K and V (the pool layout's values of an FP8 cache) through vLLM's ``write``, which takes the
    layer's values in ``dtype`` and quantizes them by its scales: each float8 value times its scale, in float32."""

    def fp8_write(key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor) -> None:
        write((key.float() * k_scale).to(dtype), (value.float() * v_scale).to(dtype), slots)

    return fp8_write


class BlockLayout:
    """Converts whole blocks of one layer between a vLLM cache and the pool layout. Same for every layer."""

    def __init__(self, gather: torch.Tensor, block_size: int, num_kv_heads: int, head_size: int) -> None:
        self.gather = gather  # [2*bs*Hkv*D] long: pool element c <- logical block element gather[c]
        self.block_size, self.num_kv_heads, self.head_size = block_size, num_kv_heads, head_size

    @classmethod
    def probe(cls, cache: torch.Tensor, block: int, write: Writer) -> "BlockLayout":
        """Learn the layout of ``cache`` ([num_blocks, Hkv, bs, 2D]) by writing codes into ``block``.

        The block's contents are restored afterwards. Raises ValueError when the writer does
        not place each element once, unchanged.
        """
        _, heads, bs, two_d = cache.shape
        d = two_d // 2
        n = bs * heads * d
        codes = torch.arange(2 * n, dtype=torch.long)  # pool order: [2][bs][Hkv][D]
        fp8 = cache.dtype == torch.uint8  # an FP8 cache's bytes (the writer given: fp8_writer's)
        if cache.dtype not in _EXACT_INTEGERS and not fp8:
            raise ValueError(f"cannot probe a KV cache of dtype {cache.dtype} (quantized caches are not supported)")
        base, written = (_FP8_DIGIT, FP8) if fp8 else (_DIGIT, cache.dtype)
        saved = cache[block].clone()
        slots = torch.arange(block * bs, (block + 1) * bs, dtype=torch.long, device=cache.device)
        found = torch.zeros(heads * bs * two_d, dtype=torch.long)
        try:
            for p in range(max(1, math.ceil(math.log(2 * n, base)))):
                digits = (codes // base**p) % base
                kv = digits.to(written).view(2, bs, heads, d).to(cache.device)
                write(kv[0].contiguous(), kv[1].contiguous(), slots)
                read = cache[block].reshape(-1).to("cpu")
                found += (read.view(FP8).float() if fp8 else read).to(torch.long) * base**p
        finally:
            cache[block].copy_(saved)
        if not torch.equal(found.sort().values, codes):
            raise ValueError(
                "the attention backend's KV cache writer does not store each element once, unchanged "
                "(an FP8 or otherwise quantized cache?): it cannot be converted to the pool layout"
            )
        gather = torch.empty_like(found)
        gather[found] = torch.arange(found.numel())
        return cls(gather.to(cache.device), bs, heads, d)

    def export_blocks(self, cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
        """Blocks ``block_ids`` of one layer in the pool layout: [n, 2, bs, Hkv, D], contiguous, on the cache's
        device."""
        blocks = cache.index_select(0, block_ids).reshape(len(block_ids), -1)  # [n, Hkv*bs*2D] logical order
        out = blocks.index_select(1, self.gather)
        out = out.view(len(block_ids), 2, self.block_size, self.num_kv_heads, self.head_size)
        return out.view(FP8) if out.dtype == torch.uint8 else out  # an FP8 cache's bytes are float8

    def import_tokens(self, write: Writer, kv: torch.Tensor, slots: torch.Tensor) -> None:
        """Write the first ``len(slots)`` tokens of ``kv`` ([n, 2, bs, Hkv, D], pool layout) to cache slots
        ``slots``."""
        n, _, bs, heads, d = kv.shape
        num_tokens = len(slots)
        device = slots.device  # the cache's: the writer runs there (a GPU's copy is synchronous here)
        key = kv[:, 0].reshape(n * bs, heads, d)[:num_tokens].to(device).contiguous()
        value = kv[:, 1].reshape(n * bs, heads, d)[:num_tokens].to(device).contiguous()
        write(key, value, slots)
