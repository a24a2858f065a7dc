"""Decode steps captured once as CUDA graphs and replayed: the GPU engine's decode step without launch overhead.

A decode step (every scheduled request takes one token, nothing else) is the same few hundred kernels each time;
launched one by one from Python they cost more than the GPU's work on a small model. ``DecodeGraphs`` captures the
model's forward over one token per sequence once per batch-size bucket and replays it, the step's inputs copied
into device buffers the graphs read:

    device buffer (int64), one copy from a pinned host mirror per step:
    | input ids [S] | positions [S] | slots [S] | context lengths [S] | block table [S, W] |
    S = max_num_seqs, W = ceil(max_model_len / block_size); the graph of bucket b reads rows [0, b)

A batch of n sequences runs in the smallest bucket b >= n. Rows [n, b) repeat row 0 (its token, position, slot,
context and blocks): they compute what row 0 computes and write the same K/V to the same slot, so they change
nothing, and their hidden states are never read. Attention is paged_decode (kernels/triton_decode.py), which
reads the cache in place up to each row's context length, so one graph serves every context length.

Who owns what: the runner owns the object and calls ``load`` then ``replay`` from its thread, once per step; the graphs,
their memory pool and the buffers live as long as the runner. The LM head, sampling and the KV connector's hooks run
outside the graph (the runner calls the hooks for every layer between ``load`` and ``replay``, and after it).

On the CPU there is no graph: ``capture=False`` runs the same forward over the same buffers and padding, so the
tests check on any machine that the graph-ready step gives the eager step's tokens.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence

import torch

from mooncake.blocks import blocks_for
from mooncake.engine.attention import AttentionMetadata
from mooncake.engine.connector import ConnectorStep, KVConnector
from mooncake.engine.model import CausalLM
from mooncake.engine.scheduler import ScheduledRequest

log = logging.getLogger(__name__)

_NO_HOOKS = KVConnector()
_NO_STEP = ConnectorStep(-1, [])


def graph_buckets(max_num_seqs: int) -> list[int]:
    """Batch sizes that get a graph: 1, 2, 4, 8, then steps of 8 to 64 and of 16 beyond, and ``max_num_seqs``."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_num_seqs]
    sizes += [b for b in range(16, min(max_num_seqs, 64) + 1, 8) if b < max_num_seqs]
    sizes += [b for b in range(80, max_num_seqs, 16)]
    return sizes + [max_num_seqs]


class DecodeGraphs:
    """Static buffers and one CUDA graph per bucket for the decode step of ``model`` over ``kv_cache``.

    ``decode_attention(bucket)`` gives the attention function a bucket's forward uses (its signature is
    attention.py's ``decode_kernel``), or None for the padded torch path (CPU without the compiled kernel).
    """

    def __init__(
        self,
        model: CausalLM,
        kv_cache: torch.Tensor,  # [L, 2, num_blocks, bs, Hkv, D]
        max_num_seqs: int,
        max_model_len: int,
        decode_attention: Callable[[int], Callable | None],
        capture: bool,
    ):
        if capture and kv_cache.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, not {kv_cache.device}")
        self.model, self.kv_cache = model, kv_cache
        self.device = kv_cache.device
        self.block_size = kv_cache.shape[3]
        self.max_num_seqs = max_num_seqs
        self.width = blocks_for(max_model_len, self.block_size)
        self.buckets = graph_buckets(max_num_seqs)
        s, w = max_num_seqs, self.width
        self._host = torch.zeros(4 * s + s * w, dtype=torch.long, pin_memory=self.device.type == "cuda")
        self._np = self._host.numpy()
        self._dev = self._host.to(self.device) if self.device.type != "cpu" else self._host.clone()
        self._ids, self._pos, self._slots, self._ctx = (self._dev[i * s : (i + 1) * s] for i in range(4))
        self._table = self._dev[4 * s :].view(s, w)
        dtype = next(model.parameters()).dtype  # the model's (an FP8 cache's dtype is not what it computes in)
        self.hidden = torch.zeros(s, model.args.hidden_size, dtype=dtype, device=self.device)  # [S, hidden]
        self._attention = {b: decode_attention(b) for b in self.buckets}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._loaded = 0  # sequences the buffers hold (load), which replay runs
        if capture:
            self._capture()

    def bucket(self, n: int) -> int:
        """The smallest bucket that holds ``n`` sequences; ValueError past ``max_num_seqs``."""
        for b in self.buckets:
            if b >= n:
                return b
        raise ValueError(f"{n} sequences exceed the graphs' {self.max_num_seqs}")

    def load(self, decodes: Sequence[ScheduledRequest]) -> torch.Tensor:
        """Put one decode step's inputs for ``decodes`` into the buffers; return the cache slot [n] each new token's K/V
        goes to (a device view, valid until the next ``load``). ``replay`` then runs the step.

        Host work is O(batch + its block-table entries): the inputs go into the pinned mirror, one copy moves them.
        """
        n = len(decodes)
        b = self.bucket(n)
        s, w, bs = self.max_num_seqs, self.width, self.block_size
        host = self._np
        table = host[4 * s :].reshape(s, w)
        pos = [d.num_computed_tokens for d in decodes]
        ids = [d.request.all_token_ids[p] for d, p in zip(decodes, pos)]
        slots = [d.request.block_ids[p // bs] * bs + p % bs for d, p in zip(decodes, pos)]
        for row, (d, p) in enumerate(zip(decodes, pos)):
            k = p // bs + 1
            table[row, :k] = d.request.block_ids[:k]
        pad = b - n  # rows [n, b) repeat row 0
        host[0:b] = ids + ids[:1] * pad
        host[s : s + b] = pos + pos[:1] * pad
        host[2 * s : 2 * s + b] = slots + slots[:1] * pad
        host[3 * s : 3 * s + b] = [p + 1 for p in pos] + [pos[0] + 1] * pad
        if pad:
            table[n:b] = table[0]
        if self.device.type == "cpu":
            self._dev.copy_(self._host)  # no graph reads these: the copy keeps the CPU step the GPU step's twin
        else:
            # Views of one buffer: the ids, positions, slots and lengths lie in [0, 4S), the table rows after.
            end = 4 * s + b * w
            self._dev[:end].copy_(self._host[:end], non_blocking=True)
        self._loaded = n
        return self._slots[:n]

    @torch.inference_mode()
    def replay(self) -> torch.Tensor:
        """Run the step ``load`` prepared: the hidden states [n, hidden] (normed), the new K/V written to the cache.
        The returned view is overwritten by the next replay."""
        n = self._loaded
        b = self.bucket(n)
        graph = self.graphs.get(b)
        if graph is not None:
            graph.replay()
        else:
            self._forward(b)
        return self.hidden[:n]

    def _forward(self, b: int) -> None:
        """The region a graph holds: the model over rows [0, b) of the buffers, hidden states into ``self.hidden``."""
        ctx, table = self._ctx[:b], self._table[:b]
        attention = self._attention[b]
        mask = None
        if attention is None:  # padded torch path: every row over the table's whole width, masked to its length
            mask = (torch.arange(self.width * self.block_size, device=self.device)[None, :] < ctx[:, None])[
                :, None, None, :
            ]
        meta = AttentionMetadata(
            slot_mapping=self._slots[:b],
            num_decodes=b,
            decode_block_table=table,
            decode_ctx_lens=ctx,
            decode_mask=mask,
            prefills=[],
            decode_kernel=attention,
        )
        self.hidden[:b].copy_(self.model(self._ids[:b], self._pos[:b], self.kv_cache, meta, _NO_HOOKS, _NO_STEP))

    def _capture(self) -> None:
        """One graph per bucket, largest first, sharing one memory pool; each after an eager warm-up run.

        Runs once, at engine start, while the cache holds no request: the warm-ups and captures write row 0's
        K/V (token 0 at position 0) into slot 0, which no request owns yet.
        """
        self._np[:] = 0
        self._np[3 * self.max_num_seqs : 4 * self.max_num_seqs] = 1  # context 1: attend to slot 0
        self._dev.copy_(self._host)
        pool = None
        with torch.inference_mode():
            for b in reversed(self.buckets):
                self._forward(b)  # warm-up: compiles kernels, settles the allocator
                torch.cuda.synchronize(self.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self._forward(b)
                pool = graph.pool() if pool is None else pool
                self.graphs[b] = graph
            torch.cuda.synchronize(self.device)
        log.info("captured decode graphs for batch sizes %s", self.buckets)


def decode_attention_for(
    device: torch.device, num_kv_heads: int, kernel: Callable | None
) -> Callable[[int], Callable | None]:
    """The per-bucket decode attention: the engine's ``kernel`` (Triton's paged_decode on CUDA, with its splits fixed
    per bucket; the compiled kernel on the CPU), or None for the padded torch path when the engine has none."""
    if kernel is None or device.type != "cuda":
        return lambda bucket: kernel
    from mooncake.engine.kernels.triton_decode import num_splits_for

    return lambda bucket: functools.partial(kernel, num_splits=num_splits_for(bucket, num_kv_heads, device))
