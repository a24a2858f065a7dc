"""Tensor parallelism: which part of each weight and KV head a rank holds, and the collectives that join the parts.

    tp = TensorParallel.init(rank, size, init_method)   # one process per rank: gloo on the CPU, NCCL on CUDA
    model = load_model(model_dir, dtype, device, tp=tp)  # this rank's shard of every layer
    tp.check(args)                                       # ValueError naming what does not divide

Megatron's split, as vLLM's and SGLang's models do it:

    qkv_proj, gate_up_proj, experts' gate/up   column-parallel: a rank holds its heads' (its intermediate slice's) rows
    o_proj, down_proj, experts' down           row-parallel: its input columns; the partial sums are all-reduced
    embed_tokens, lm_head                      vocabulary-parallel: a rank holds a contiguous 1/size of the rows (the
                                               vocabulary padded to a multiple of size); the embedding's lookups
                                               outside them are zero and all-reduced, the logits all-gathered
    norms, the router                          every rank whole

Query heads split evenly. KV heads split evenly where there are at least ``size`` of them; where there are fewer, each
is kept by ``size / num_kv_heads`` ranks (replicated, as vLLM does): rank r holds KV head ``r * num_kv_heads // size``,
the one its query heads read. A rank's KV cache holds its KV heads only: ``kv_heads(args)``.

``TensorParallel()`` (size 1) is the engine without parallelism: no collective is called, every weight is whole.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from mooncake.engine.blockcopy import as_bytes
from mooncake.engine.model_args import ModelArgs


@dataclass(frozen=True, slots=True)
class TensorParallel:
    """This process's rank among ``size`` that each hold 1/size of the model; ``group``: the process group of the
    model's collectives (None: the default one); ``calls``: a gloo group for the objects rank 0 sends the others
    (mooncake.engine.ranks; None: ``group``), which on CUDA keeps them off NCCL, and sees a dead peer at once."""

    rank: int = 0
    size: int = 1
    group: Any = None
    calls: Any = None

    @classmethod
    def init(
        cls, rank: int, size: int, init_method: str, backend: str = "gloo", timeout: timedelta | None = None
    ) -> TensorParallel:
        """Join the ``size`` ranks at ``init_method`` (``tcp://host:port`` or ``file:///path``) as ``rank``; the
        backend is the engine's device's (gloo for the CPU, nccl for CUDA: the caller says which); ``timeout``: how
        long a collective may wait (None: torch's)."""
        if size == 1:
            return cls()
        kwargs = {} if timeout is None else {"timeout": timeout}
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size, **kwargs)
        return cls(rank, size, None)

    # -- what a rank holds ---------------------------------------------------------------------

    def part(self, n: int, what: str) -> slice:
        """This rank's contiguous 1/size of ``n`` (``what`` names it in the error when ``n`` does not divide)."""
        if n % self.size:
            raise ValueError(f"{what} ({n}) cannot be split evenly among {self.size} tensor-parallel ranks")
        k = n // self.size
        return slice(self.rank * k, (self.rank + 1) * k)

    def q_heads(self, args: ModelArgs) -> slice:
        return self.part(args.num_heads, "the attention heads")

    def kv_heads(self, args: ModelArgs) -> slice:
        """This rank's KV heads: its 1/size of them, or (fewer heads than ranks) the one its query heads read."""
        return self.kv_heads_of(self.rank, args.num_kv_heads)

    def kv_heads_of(self, rank: int, num_kv_heads: int) -> slice:
        """Rank ``rank``'s KV heads among ``num_kv_heads`` (``kv_heads``)."""
        if num_kv_heads >= self.size:
            return replace(self, rank=rank).part(num_kv_heads, "the KV heads")
        if self.size % num_kv_heads:
            raise ValueError(
                f"{self.size} tensor-parallel ranks cannot share the model's {num_kv_heads} KV heads evenly"
            )
        h = rank * num_kv_heads // self.size
        return slice(h, h + 1)

    def vocab(self, args: ModelArgs) -> slice:
        """This rank's rows of the embedding and LM head: a contiguous 1/size of the vocabulary padded to a multiple
        of size (the last rank's rows past the vocabulary are zero and never sampled)."""
        per = -(-args.vocab_size // self.size)
        return slice(self.rank * per, (self.rank + 1) * per)

    def check(self, args: ModelArgs) -> None:
        """ValueError naming the first dimension of ``args`` that does not split among the ranks."""
        if self.size == 1:
            return
        self.q_heads(args)
        self.kv_heads(args)
        self.part(args.intermediate_size, "the MLP's intermediate size")
        if args.num_experts:
            self.part(args.moe_intermediate_size, "the experts' intermediate size")

    # -- joining the parts ---------------------------------------------------------------------

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """x summed over the ranks, in place (row-parallel partial sums); x itself at size 1."""
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def gather_kv_heads(self, own: torch.Tensor, num_kv_heads: int) -> torch.Tensor | None:
        """Every KV head from each rank's own [..., heads, D], in head order, on rank 0 (None on the others): a pool
        block's (each head once where ranks share one). Each rank sends its own part only. ``own`` itself at size 1."""
        if self.size == 1:
            return own
        dtype = own.dtype
        own = as_bytes(own.contiguous())  # (gloo has no float8: an FP8 cache's KV goes as its bytes)
        parts = [torch.empty_like(own) for _ in range(self.size)] if self.rank == 0 else None
        dist.gather(own, parts, dst=0, group=self.group)
        if parts is None:
            return None
        if num_kv_heads < self.size:  # rank r keeps head r * num_kv_heads // size: one rank of each head's share
            parts = parts[:: self.size // num_kv_heads]
        return torch.cat(parts, dim=-2).view(dtype)

    def scatter_kv_heads(self, full: torch.Tensor | None, out: torch.Tensor) -> torch.Tensor:
        """Rank 0's KV in the pool layout ``full`` [..., Hkv, D] (None on the other ranks) sent out by heads: each
        rank's ``out`` [..., its heads, D] (contiguous) gets its own (a collective: every rank calls it)."""
        parts = None
        if self.rank == 0:
            heads = full.shape[-2]
            parts = [
                as_bytes(full[..., self.kv_heads_of(r, heads), :].to(out.dtype).contiguous()) for r in range(self.size)
            ]
        dist.scatter(as_bytes(out), parts, src=0, group=self.group)
        return out

    def least(self, n: int, device: torch.device) -> int:
        """The smallest of every rank's ``n`` (the cache's blocks: every rank must hold rank 0's block ids)."""
        if self.size == 1:
            return n
        x = torch.tensor([n], dtype=torch.long, device=device)
        dist.all_reduce(x, op=dist.ReduceOp.MIN, group=self.group)
        return int(x.item())

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """The ranks' x joined along the last dimension, in rank order (vocabulary-parallel logits)."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)


SINGLE = TensorParallel()
