"""ModelRunner: owns the model and the KV cache tensor; turns a SchedulerOutput into tokens.

KV cache, one tensor for the whole engine:

    kv_cache: [num_layers, 2 (K, V), num_blocks, block_size, num_kv_heads, head_dim]

so ``kv_cache[:, :, b]`` is block ``b`` in the pool layout of DESIGN §4
(``[layers][2][block_size][kv_heads][head_dim]``) and ``kv_cache[l, :, b]`` one layer of
it: export and import are single indexed copies.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from mooncake.blocks import blocks_for
from mooncake.engine.attention import AttentionMetadata, PrefillSegment, StepAttention
from mooncake.engine.blockcopy import copy_blocks
from mooncake.engine.connector import ConnectorStep, KVConnector, StepRequest
from mooncake.engine.decode_graph import DecodeGraphs, decode_attention_for
from mooncake.engine.grammar import GrammarBook
from mooncake.engine.model import CausalLM
from mooncake.engine.request import TokenLogprob
from mooncake.engine.sampler import History, PenaltyBook, sample, token_logprobs
from mooncake.engine.scheduler import ScheduledRequest, SchedulerOutput

_CUDA_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


class ModelRunner:
    """Runs one forward step at a time. Not thread-safe; the engine loop owns it."""

    def __init__(
        self,
        model: CausalLM,
        num_blocks: int,
        block_size: int,
        max_model_len: int,
        device: torch.device,
        dtype: torch.dtype,
        seed: int,
        decode_kernel=None,
        kv_buffer=None,
        step_kernel=None,
    ):
        args = model.args
        self.model = model
        self.decode_kernel = decode_kernel  # used for float32 on CPU only
        self.step_kernel = step_kernel  # a step with prompt chunks in one call a layer (kernels/triton_varlen.py)
        self.block_size = block_size
        self.device = device
        self.vocab_size = args.vocab_size  # the width of the logits (and of each sampling draw)
        shape = (args.num_layers, 2, num_blocks, block_size, model.num_kv_heads, args.head_dim)  # this rank's heads
        self.tp = model.tp
        # where this rank's heads are among a pool block's (None: it holds them all)
        self.kv_heads = model.tp.kv_heads(args) if model.tp.size > 1 else None
        self.pool_block_shape = (args.num_layers, 2, block_size, args.num_kv_heads, args.head_dim)
        if kv_buffer is None:
            self.kv_cache = torch.zeros(shape, dtype=dtype, device=device)
        else:  # memory another process writes too (a decode worker's cache in shared memory): CPU only
            if device.type != "cpu":
                raise ValueError("a KV cache in a given buffer lives on the CPU")
            self.kv_cache = torch.frombuffer(kv_buffer, dtype=dtype, count=math.prod(shape)).view(shape)
        model.rope_tables(max_model_len)
        self.default_generator = torch.Generator(device=device)
        self.default_generator.manual_seed(seed)
        self.generators: dict[str, torch.Generator] = {}
        self.penalties = PenaltyBook(args.vocab_size, device)  # penalized requests' token counts, step to step
        self.grammars: GrammarBook | None = None  # set by an engine with a tokenizer (constrained decoding)
        self.step_id = 0
        self.graphs: DecodeGraphs | None = None  # set by enable_decode_graphs
        # tensor parallelism (mooncake.engine.ranks): rank 0's other ranks, sent each step's plan and each export
        # before rank 0 runs its part; a follower's runner samples nothing (its logits are computed: a collective)
        self.followers = None
        self.samples = True
        # rank 0 of a prefill worker's ranks: every KV head of the cache, for its pool connector (ranks.Mirror)
        self.mirror: torch.Tensor | None = None

    def enable_decode_graphs(self, max_num_seqs: int, max_model_len: int, capture: bool) -> None:
        """Run pure decode steps of up to ``max_num_seqs`` sequences through DecodeGraphs: captured as CUDA graphs
        (``capture``, CUDA only), or the same static-buffer step run uncaptured. Called once, before any request."""
        attention = decode_attention_for(self.device, self.kv_cache.shape[4], self.decode_kernel)
        self.graphs = DecodeGraphs(self.model, self.kv_cache, max_num_seqs, max_model_len, attention, capture)

    @property
    def block_shape(self) -> tuple[int, ...]:
        """Shape of one block of this cache: [L, 2, block_size, Hkv, D], this rank's KV heads (``pool_block_shape``:
        every head, the pool's layout)."""
        layers, two, _, bs, hkv, d = self.kv_cache.shape
        return (layers, two, bs, hkv, d)

    def add_generator(self, request_id: str, seed: int, num_sampled: int = 0) -> None:
        """A seeded generator for ``request_id``, as it stands after sampling ``num_sampled`` tokens.

        Each sampled token draws one noise vector over the vocabulary (sampler.sample), so
        skipping that many draws lets a request whose first tokens were sampled elsewhere
        (a prefill worker's first token, a resumed stream's tokens) go on exactly as one
        engine alone would.
        """
        gen = torch.Generator(device=self.device)
        gen.manual_seed(seed)
        if num_sampled:
            scratch = torch.empty(self.vocab_size, dtype=torch.float32, device=self.device)
            for _ in range(num_sampled):
                scratch.exponential_(generator=gen)
        self.generators[request_id] = gen

    def drop_request(self, request_id: str) -> None:
        self.generators.pop(request_id, None)
        self.penalties.drop(request_id)
        if self.grammars is not None:
            self.grammars.drop(request_id)

    def export_blocks(self, block_ids: list[int]) -> torch.Tensor | None:
        """Copy blocks out in the pool layout: [n, L, 2, block_size, Hkv, D] on the CPU, every KV head (gathered from
        the tensor-parallel ranks onto rank 0, a collective: a follower sends its heads and gets None)."""
        if self.followers is not None:
            self.followers.export(block_ids)
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        own = self.kv_cache.index_select(2, idx).permute(2, 0, 1, 3, 4, 5).contiguous()
        every = self.tp.gather_kv_heads(own, self.pool_block_shape[3])
        return every.cpu() if every is not None else None  # a follower sent its heads to rank 0

    def own_heads(self, kv: torch.Tensor) -> torch.Tensor:
        """This rank's KV heads of pool-layout KV [..., Hkv, D] (a view; all of it without tensor parallelism)."""
        return kv if self.kv_heads is None else kv[..., self.kv_heads, :]

    def import_blocks(self, block_ids: list[int], data: torch.Tensor) -> None:
        """Write pool-layout blocks [n, L, 2, block_size, Hkv, D] into the given cache blocks (this rank's heads)."""
        if tuple(data.shape[1:]) != self.pool_block_shape or data.shape[0] != len(block_ids):
            raise ValueError(
                f"KV blocks of shape {tuple(data.shape)} do not fit {len(block_ids)} blocks of {self.pool_block_shape}"
            )
        copy_blocks(self.kv_cache.transpose(0, 2), block_ids, self.own_heads(data).transpose(1, 2), range(len(data)))

    @staticmethod
    def _heads_buffer(dst: torch.Tensor, n: int) -> torch.Tensor:
        """Where ``n`` blocks of one layer of this rank's heads arrive (contiguous: a collective writes it whole)."""
        return torch.empty((n, *dst.shape[1:]), dtype=dst.dtype, device=dst.device)

    def import_layer(self, layer: int, imp: "_Import") -> None:
        """Write one layer of an import's external KV into its cache blocks (tensor parallelism: rank 0 reads it and
        sends each rank its heads; a follower's import has no source of its own)."""
        n = len(imp.block_ids)
        ext = imp.external_kv
        dst = self.kv_cache[layer].transpose(0, 1)  # [blocks, 2, bs, heads, D]
        if ext is None:
            src = self.tp.scatter_kv_heads(None, self._heads_buffer(dst, n))
            copy_blocks(dst, imp.block_ids, src, range(n))
            return
        if isinstance(ext, torch.Tensor):
            src, ids = ext[:, layer], range(imp.first_block, imp.first_block + n)  # [N, 2, bs, Hkv, D]
        else:  # a lazy source (ExternalKV): where one layer of its blocks is
            src, ids = ext.source(layer, imp.first_block, imp.first_block + n)
        if self.mirror is not None:
            copy_blocks(self.mirror[layer].transpose(0, 1), imp.block_ids, src, ids)
        if self.followers is not None:
            index = torch.as_tensor(list(ids), dtype=torch.long, device=src.device)
            src = self.tp.scatter_kv_heads(src.index_select(0, index).to(self.device), self._heads_buffer(dst, n))
            ids = range(n)
        copy_blocks(dst, imp.block_ids, self.own_heads(src) if self.followers is None else src, ids)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, connector: KVConnector) -> Sampled:
        """Run one step: imports, forward over every scheduled token, sampling.

        Returns the token of each request that reached the end of its sequence this step
        (the others were mid-prompt chunks), and its log-probabilities if it asked.
        """
        if self.followers is not None:
            self.followers.step(out, self.mirror is not None)
        imports = [_Import(imp.block_ids, imp.request.external_kv, imp.first_block) for imp in out.imports]
        if not out.scheduled:
            for imp in imports:
                for layer in range(self.kv_cache.shape[0]):
                    self.import_layer(layer, imp)
            return Sampled({}, {})
        # Decodes (one new token) first, then prefill chunks: see attention.py.
        decodes = [s for s in out.scheduled if s.num_new_tokens == 1]
        prefills = [s for s in out.scheduled if s.num_new_tokens > 1]
        if self._graph_step(decodes, prefills):
            return self._execute_graph(decodes, imports, connector)
        if imports:  # each layer's imported KV lands just before that layer runs: loading overlaps computing
            connector = _LayerImports(self, connector, imports)
        ordered = decodes + prefills
        input_ids, positions, meta, step, sample_rows = self._prepare(decodes, prefills)
        segments = [
            (row, s)
            for row, s in zip(_row_starts(ordered), ordered)
            if s.request.sampling_params.prompt_logprobs is not None
        ]
        connector.start_step(step)
        with self._attention_backends():
            hidden = self.model(input_ids, positions, self.kv_cache, meta, connector, step)
        connector.wait_for_save()
        self.step_id += 1
        prompt = {s.request.request_id: self._prompt_logprobs(hidden, row, s) for row, s in segments}
        rows = [r for r, _ in sample_rows]
        if not rows:
            return Sampled({}, {}, prompt)
        return self._sample(
            hidden[torch.tensor(rows, device=self.device)], [ordered[i].request for _, i in sample_rows], prompt
        )

    def _attention_backends(self):
        """On CUDA, no cuDNN attention for the prefill chunks (flash takes them): cuDNN builds a plan for every new
        (query, key) length, hundreds of ms each, and a server sees a new prompt length with nearly every request.
        Only the backends' on/off flags change, for the forward's duration; their priority order (process-wide, and
        not restored exactly by torch) is left alone."""
        if self.device.type != "cuda":
            return contextlib.nullcontext()
        return sdpa_kernel(_CUDA_SDPA_BACKENDS)

    def _graph_step(self, decodes: list[ScheduledRequest], prefills: list[ScheduledRequest]) -> bool:
        """Whether this step runs through the decode graphs: decodes only, each sampling, within the largest bucket."""
        graphs = self.graphs
        return (
            graphs is not None
            and bool(decodes)
            and not prefills
            and len(decodes) <= graphs.max_num_seqs
            and all(s.samples for s in decodes)
        )

    def _execute_graph(
        self, decodes: list[ScheduledRequest], imports: list[_Import], connector: KVConnector
    ) -> Sampled:
        """A decode step through DecodeGraphs. Work that needs Python per layer happens around it: the imports'
        KV lands for every layer before it, and the connector sees every layer's load before and save after."""
        layers = list(zip(range(self.kv_cache.shape[0]), self.model.layer_range))  # (index here, the model's)
        slots = self.graphs.load(decodes)  # [n] on the device
        hooks = type(connector) is not KVConnector  # the base connector's hooks do nothing: skip building a step
        if hooks:
            step = ConnectorStep(
                self.step_id,
                [
                    StepRequest(
                        s.request.request_id, s.num_computed_tokens, 1, slots[i : i + 1], list(s.request.block_ids)
                    )
                    for i, s in enumerate(decodes)
                ],
            )
            connector.start_step(step)
            for _, layer in layers:
                connector.wait_for_layer_load(layer)
        for imp in imports:
            for layer, _ in layers:
                self.import_layer(layer, imp)
        hidden = self.graphs.replay()
        if hooks:
            for here, layer in layers:
                connector.save_layer(layer, self.kv_cache[here, 0], self.kv_cache[here, 1], step)
            connector.wait_for_save()
        self.step_id += 1
        return self._sample(hidden, [s.request for s in decodes], {})

    def _sample(self, hidden: torch.Tensor, reqs: list, prompt: dict) -> Sampled:
        """Logits of the sampling rows ``hidden`` [N, hidden] (one per request of ``reqs``), then tokens and
        logprobs."""
        logits = self.model.compute_logits(hidden)
        if not self.samples:
            return Sampled({}, {}, prompt)
        params = [r.sampling_params for r in reqs]
        histories = counts = None
        if any(p.shapes_logits for p in params):
            histories = [History(r.prompt_token_ids, r.output_token_ids, r.eos_token_ids) for r in reqs]
            counts = [
                self.penalties.counts(r.request_id, h) if p.penalizes else None
                for r, p, h in zip(reqs, params, histories)
            ]
        constrained = [i for i, r in enumerate(reqs) if self.grammars is not None and r.request_id in self.grammars]
        masked = logits
        if constrained:
            masked = logits.clone()
            for i in constrained:
                self.grammars.mask_(masked[i], reqs[i].request_id)
        tokens = sample(
            masked, params, [self.generators.get(r.request_id) for r in reqs], self.default_generator, histories, counts
        )
        for i in constrained:
            self.grammars.accept(reqs[i].request_id, tokens[i])
        logprobs = token_logprobs(logits, tokens, [p.logprobs for p in params])
        return Sampled(
            {r.request_id: t for r, t in zip(reqs, tokens)},
            {r.request_id: lp for r, lp in zip(reqs, logprobs) if lp is not None},
            prompt,
        )

    def _prompt_logprobs(self, hidden: torch.Tensor, start: int, s: ScheduledRequest) -> list[tuple[int, TokenLogprob]]:
        """(position, logprob) of each prompt token this prefill chunk predicts: row i predicts the token after it."""
        req, c = s.request, s.num_computed_tokens
        n = min(s.num_new_tokens, req.num_prompt_tokens - 1 - c)  # the last prompt row predicts an output token
        if n <= 0:
            return []
        logits = self.model.compute_logits(hidden[start : start + n])  # [n, V]
        if not self.samples:
            return []
        targets = list(req.prompt_token_ids[c + 1 : c + 1 + n])
        entries = token_logprobs(logits, targets, [req.sampling_params.prompt_logprobs] * n)
        return [(c + 1 + i, e) for i, e in enumerate(entries)]

    def _prepare(self, decodes: list[ScheduledRequest], prefills: list[ScheduledRequest]):
        bs = self.block_size
        dev = self.device
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        sample_rows: list[tuple[int, int]] = []  # (row in hidden, index into decodes + prefills)
        step_reqs: list[StepRequest] = []
        max_blocks = 0
        for j, s in enumerate(decodes):
            req, p = s.request, s.num_computed_tokens
            ids.append(req.all_token_ids[p])
            pos.append(p)
            slots.append(req.block_ids[p // bs] * bs + p % bs)
            max_blocks = max(max_blocks, p // bs + 1)
            if s.samples:
                sample_rows.append((j, j))
        whole_step = bool(prefills) and self.step_kernel is not None  # one varlen call a layer attends it all
        decode_table = decode_mask = ctx = None
        kernel = self.decode_kernel
        if decodes and not whole_step:
            table = [s.request.block_ids[: s.num_computed_tokens // bs + 1] for s in decodes]
            decode_table = torch.tensor([t + [0] * (max_blocks - len(t)) for t in table], dtype=torch.long)
            ctx = torch.tensor([s.num_computed_tokens + 1 for s in decodes], dtype=torch.long)
            if kernel is None:
                decode_mask = (torch.arange(max_blocks * bs)[None, :] < ctx[:, None])[:, None, None, :].to(dev)
            decode_table = decode_table.to(dev)
            ctx = ctx.to(dev)
        segments: list[PrefillSegment] = []
        pos_parts = [torch.tensor(pos, dtype=torch.long)]  # decodes', then one arange per prefill chunk
        slot_parts = [torch.tensor(slots, dtype=torch.long)]
        for j, s in enumerate(prefills, start=len(decodes)):
            req, c, n = s.request, s.num_computed_tokens, s.num_new_tokens
            start = len(ids)
            ids.extend(req.all_token_ids[c : c + n])
            nblk = blocks_for(c + n, bs)
            table = torch.tensor(req.block_ids[:nblk], dtype=torch.long)
            p = torch.arange(c, c + n)
            pos_parts.append(p)
            slot_parts.append(table[p // bs] * bs + p % bs)  # tensor ops: no Python per token
            if not whole_step:
                segments.append(PrefillSegment(start, n, c + n, table.to(dev)))
            if s.samples:
                sample_rows.append((start + n - 1, j))
        slot_t = torch.cat(slot_parts).to(dev)
        offset = 0
        for s in decodes + prefills:
            step_reqs.append(
                StepRequest(
                    request_id=s.request.request_id,
                    num_computed_tokens=s.num_computed_tokens,
                    num_new_tokens=s.num_new_tokens,
                    slots=slot_t[offset : offset + s.num_new_tokens],
                    block_ids=list(s.request.block_ids),
                )
            )
            offset += s.num_new_tokens
        meta = AttentionMetadata(
            slot_mapping=slot_t,
            num_decodes=len(decodes),
            decode_block_table=decode_table,
            decode_ctx_lens=ctx,
            decode_mask=decode_mask,
            prefills=segments,
            decode_kernel=kernel,
            step=self._step_attention(decodes, prefills) if whole_step else None,
        )
        input_ids = torch.tensor(ids, dtype=torch.long, device=dev)
        positions = torch.cat(pos_parts).to(dev)
        return input_ids, positions, meta, ConnectorStep(self.step_id, step_reqs), sample_rows

    def _step_attention(self, decodes: list[ScheduledRequest], prefills: list[ScheduledRequest]) -> StepAttention:
        """The step's sequences, decodes then prompt chunks as ``_prepare`` lays out their tokens, for one kernel call:
        two host-to-device copies."""
        bs = self.block_size
        seqs = [(1, s.num_computed_tokens + 1, s.request.block_ids) for s in decodes]
        seqs += [(s.num_new_tokens, s.num_computed_tokens + s.num_new_tokens, s.request.block_ids) for s in prefills]
        tables = [list(blocks[: blocks_for(ctx, bs)]) for _, ctx, blocks in seqs]
        width = max(len(t) for t in tables)
        starts, row = [], 0
        for n, _, _ in seqs:
            starts.append(row)
            row += n
        lens = torch.tensor([starts, [n for n, _, _ in seqs], [c for _, c, _ in seqs]], dtype=torch.int32)
        table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
        lens, table = lens.to(self.device), table.to(self.device)
        return StepAttention(lens[0], lens[1], lens[2], table, max(n for n, _, _ in seqs), self.step_kernel)


@dataclass(slots=True)
class Sampled:
    """What one step sampled: a token per request at the end of its sequence, and the log-probabilities asked for."""

    tokens: dict[str, int]
    logprobs: dict[str, TokenLogprob]
    prompt_logprobs: dict[str, list[tuple[int, TokenLogprob]]] = field(default_factory=dict)  # (position, logprob)


@dataclass(slots=True)
class _Import:
    block_ids: list[int]
    external_kv: object  # [n, L, 2, bs, Hkv, D] tensor, or an ExternalKV
    first_block: int


class ExternalKV:
    """A lazy source of a request's leading KV blocks, read one layer at a time (e.g. pool slots in shared memory).

    ``shape`` is that of the equivalent tensor, [n, L, 2, block_size, Hkv, D];
    ``layer(l, start, end)`` returns layer ``l`` of blocks ``[start, end)`` as
    [end - start, 2, block_size, Hkv, D], blocking until those bytes are there.
    """

    shape: tuple[int, ...]

    def layer(self, layer: int, start: int, end: int) -> torch.Tensor:
        raise NotImplementedError

    def source(self, layer: int, start: int, end: int) -> tuple[torch.Tensor, Sequence[int]]:
        """Layer ``layer`` of blocks ``[start, end)`` as (a tensor [N, 2, block_size, Hkv, D], their indices in it),
        blocking until those bytes are there: a source that holds them in place (pool slots) saves the import a
        gather."""
        return self.layer(layer, start, end), range(end - start)


class _LayerImports(KVConnector):
    """Wraps the step's connector: before each layer runs, that layer of every import is copied in."""

    def __init__(self, runner: ModelRunner, inner: KVConnector, imports: list[_Import]) -> None:
        self.runner, self.inner, self.imports = runner, inner, imports

    def start_step(self, step: ConnectorStep) -> None:
        self.inner.start_step(step)

    def wait_for_layer_load(self, layer: int) -> None:
        self.inner.wait_for_layer_load(layer)
        for imp in self.imports:
            self.runner.import_layer(layer, imp)

    def save_layer(self, layer, k_cache, v_cache, step) -> None:
        self.inner.save_layer(layer, k_cache, v_cache, step)

    def wait_for_save(self) -> None:
        self.inner.wait_for_save()

    def request_finished(self, request_id: str, block_ids: list[int]) -> bool:
        return self.inner.request_finished(request_id, block_ids)

    def released_blocks(self) -> list[int]:
        return self.inner.released_blocks()


def _row_starts(ordered: list[ScheduledRequest]) -> list[int]:
    """Row of the step's hidden states where each scheduled request's tokens start (decodes first, then prefills)."""
    starts, row = [], 0
    for s in ordered:
        starts.append(row)
        row += s.num_new_tokens
    return starts
