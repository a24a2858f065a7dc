"""One stage of chunked pipeline parallelism (CPP, Mooncake §5.1): a contiguous range of a model's layers, their
paged KV cache, and a request's prompt chunks run through them in order.

    stage 0: layers [0, a)   chunk k: token ids -> hidden ---\\
    stage 1: layers [a, b)   chunk k: hidden -> hidden ------ (while stage 0 runs chunk k + 1)
    ...
    stage X-1: [c, L)        chunk k: hidden -> normed hidden; after the last chunk, the first token

A stage never sees another stage's layers or KV: what crosses a stage boundary is one
chunk's hidden states [n, hidden]. Its cache holds only its layers,

    kv_cache: [num_local_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]

so ``export(request)`` gives its layers of the request's blocks, [n, local L, 2, bs, Hkv,
D]; the stages' exports concatenated along the layer axis are the pool layout's blocks.
What runs a stage (a thread here, a process with the transfer engine between stages in a
worker) is not this module's business: ``run_chunk`` is called once per chunk, in order,
by one thread at a time.
"""

from __future__ import annotations

import torch

from mooncake.blocks import blocks_for
from mooncake.engine.attention import AttentionMetadata, PrefillSegment
from mooncake.engine.block_pool import BlockPool
from mooncake.engine.connector import ConnectorStep, KVConnector, StepRequest
from mooncake.engine.grammar import GrammarBook
from mooncake.engine.loader import generation_eos_ids, load_model
from mooncake.engine.request import SamplingParams, TokenLogprob
from mooncake.engine.sampler import History, sample, token_logprobs


def split_layers(num_layers: int, num_stages: int) -> list[range]:
    """Contiguous layer ranges for ``num_stages`` stages, as even as they go (earlier stages take the remainder)."""
    if not 1 <= num_stages <= num_layers:
        raise ValueError(f"{num_stages} stages cannot split {num_layers} layers")
    base, extra = divmod(num_layers, num_stages)
    out, start = [], 0
    for i in range(num_stages):
        stop = start + base + (i < extra)
        out.append(range(start, stop))
        start = stop
    return out


class PipelineStage:
    """Layers ``layers`` of the model in ``model_dir`` and their paged KV cache. Not thread-safe: one caller."""

    def __init__(
        self,
        model_dir: str,
        layers: range,
        *,
        num_blocks: int,
        block_size: int,
        max_model_len: int,
        dtype: torch.dtype = torch.float32,
        device: str = "cpu",
        seed: int = 0,
        tokenizer=None,
    ) -> None:
        self.device = torch.device(device)
        self.model = load_model(model_dir, dtype, self.device, layers=layers)
        args = self.model.args
        self.tokenizer = tokenizer  # the last stage's, for a grammar's first token
        self.eos_token_ids = (
            frozenset(args.eos_token_ids)
            | generation_eos_ids(model_dir)
            | frozenset(getattr(tokenizer, "eos_token_ids", ()))
        )
        self._grammars: GrammarBook | None = None
        self.layers = self.model.layer_range
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.kv_cache = torch.zeros(
            len(self.layers),
            2,
            num_blocks,
            block_size,
            args.num_kv_heads,
            args.head_dim,
            dtype=dtype,
            device=self.device,
        )
        self.model.rope_tables(max_model_len)
        self.pool = BlockPool(num_blocks, enable_prefix_caching=False)  # allocation only: the pool is the cache
        self.tables: dict[str, list[int]] = {}  # request -> its blocks, in sequence order
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed)
        self._step = 0
        self._done: dict[str, int] = {}  # request -> its tokens run (or imported) here

    @property
    def is_first(self) -> bool:
        return self.model.is_first

    @property
    def is_last(self) -> bool:
        return self.model.is_last

    @torch.inference_mode()
    def run_chunk(
        self,
        request_id: str,
        start: int,
        *,
        token_ids: list[int] | None = None,
        hidden: torch.Tensor | None = None,
        connector: KVConnector | None = None,
    ) -> torch.Tensor:
        """Run tokens [start, start + n) of a request through this stage's layers; their hidden states out, [n, hidden].

        The first stage takes ``token_ids``, the others the previous stage's ``hidden`` for the same chunk. Chunks of
        a request come in order (``start`` is the number of its tokens already run here). ``connector`` sees each
        layer's KV saved, under the layer's global index. Raises ValueError for out-of-order chunks or a full cache.
        """
        n = len(token_ids) if token_ids is not None else int(hidden.shape[0])
        table = self.tables.setdefault(request_id, [])
        if start != self._done.get(request_id, 0):
            raise ValueError(f"chunk of {request_id} at {start}, but {self._done.get(request_id, 0)} tokens ran here")
        if start + n > self.max_model_len:
            raise ValueError(f"{start + n} tokens exceed max_model_len {self.max_model_len}")
        need = blocks_for(start + n, self.block_size) - len(table)
        if need > self.pool.num_free_blocks:
            raise ValueError(f"stage {self.layers} has {self.pool.num_free_blocks} free KV blocks, {need} needed")
        table.extend(b.block_id for b in self.pool.allocate(max(0, need)))
        bs, dev = self.block_size, self.device
        positions = torch.arange(start, start + n, device=dev)
        block_table = torch.tensor(table, dtype=torch.long, device=dev)
        slots = block_table[positions // bs] * bs + positions % bs
        meta = AttentionMetadata(
            slot_mapping=slots,
            num_decodes=0,
            decode_block_table=None,
            decode_ctx_lens=None,
            decode_mask=None,
            prefills=[PrefillSegment(0, n, start + n, block_table)],
        )
        step = ConnectorStep(self._step, [StepRequest(request_id, start, n, slots, list(table))])
        self._step += 1
        connector = connector or KVConnector()
        connector.start_step(step)
        ids = torch.tensor(token_ids, dtype=torch.long, device=dev) if token_ids is not None else None
        x = hidden.to(device=dev, dtype=self.kv_cache.dtype) if hidden is not None else None
        out = self.model(ids, positions, self.kv_cache, meta, connector, step, hidden=x)
        connector.wait_for_save()
        self._done[request_id] = start + n
        return out

    def import_prefix(self, request_id: str, kv: torch.Tensor, num_tokens: int) -> None:
        """Give a new request the KV of its first ``num_tokens`` tokens (a reused prefix: this stage's layers of its
        blocks, [n, local L, 2, block_size, Hkv, D], from the pool); its chunks then start there."""
        if request_id in self.tables:
            raise ValueError(f"{request_id} already has blocks here")
        n = blocks_for(num_tokens, self.block_size)
        if (
            tuple(kv.shape[1:]) != (len(self.layers), *self.kv_cache.shape[1:2], *self.kv_cache.shape[3:])
            or kv.shape[0] < n
        ):
            raise ValueError(f"prefix KV of shape {tuple(kv.shape)} does not fit {n} blocks of this stage's layers")
        if n > self.pool.num_free_blocks:
            raise ValueError(f"stage {self.layers} has {self.pool.num_free_blocks} free KV blocks, {n} needed")
        table = self.tables[request_id] = [b.block_id for b in self.pool.allocate(n)]
        idx = torch.tensor(table, dtype=torch.long, device=self.device)
        self.kv_cache.index_copy_(
            2, idx, kv[:n].to(device=self.device, dtype=self.kv_cache.dtype).permute(1, 2, 0, 3, 4, 5)
        )
        self._done[request_id] = num_tokens

    @torch.inference_mode()
    def sample_first(
        self, hidden_last: torch.Tensor, params: SamplingParams, prompt: list[int], outputs: list[int] = ()
    ) -> tuple[int, TokenLogprob | None]:
        """The first token from the last prompt row's normed hidden state [hidden] (last stage only), and its logprob
        when ``params`` asks. ``outputs`` are tokens the request generated before (a resumed stream: they ran through
        the pipeline as prompt): penalties count them, a seeded generator skips their draws, a grammar replays them,
        so the token is the one an undisturbed engine samples."""
        if not self.is_last:
            raise RuntimeError("only the last stage holds the head")
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(params.seed)
            scratch = torch.empty(self.model.args.vocab_size, dtype=torch.float32, device=self.device)
            for _ in outputs:  # one noise draw per sampled token (sampler.sample)
                scratch.exponential_(generator=generator)
        logits = self.model.compute_logits(hidden_last[None])  # [1, V]
        masked = logits
        constraint = None
        if params.grammar is not None:
            constraint = self._grammar_book().new(params.grammar, outputs)
            masked = logits.clone()
            constraint.mask_(masked[0])
        history = History(prompt, tuple(outputs), self.eos_token_ids)
        token = sample(masked, [params], [generator], self.generator, [history])[0]
        return token, token_logprobs(logits, [token], [params.logprobs])[0]

    @torch.inference_mode()
    def prompt_logprobs(
        self, hidden: torch.Tensor, start: int, prompt: list[int], top: int
    ) -> list[tuple[int, TokenLogprob]]:
        """(position, logprob) of each prompt token that rows [start, start + n) of ``hidden`` (this stage's output
        for one chunk, last stage only) predict: row i predicts token i + 1."""
        n = min(int(hidden.shape[0]), len(prompt) - 1 - start)
        if n <= 0:
            return []
        logits = self.model.compute_logits(hidden[:n])
        entries = token_logprobs(logits, prompt[start + 1 : start + 1 + n], [top] * n)
        return [(start + 1 + i, e) for i, e in enumerate(entries)]

    def _grammar_book(self) -> GrammarBook:
        if self._grammars is None:
            backend = getattr(self.tokenizer, "backend", None)
            if backend is None:
                raise ValueError("structured output needs the model's tokenizer")
            self._grammars = GrammarBook(backend.to_str(), self.model.args.vocab_size, self.eos_token_ids)
        return self._grammars

    def export(self, request_id: str) -> torch.Tensor:
        """This stage's layers of the request's blocks, [n, local L, 2, block_size, Hkv, D], on the CPU."""
        idx = torch.tensor(self.tables[request_id], dtype=torch.long, device=self.device)
        return self.kv_cache.index_select(2, idx).permute(2, 0, 1, 3, 4, 5).contiguous().cpu()

    def release(self, request_id: str) -> None:
        """Free the request's blocks (after its KV went out)."""
        self.pool.free(self.tables.pop(request_id, []))
        self._done.pop(request_id, None)
