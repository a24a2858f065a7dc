"""A decoder in plain torch, over a paged KV cache.

One module serves every architecture of model_args.py; ModelArgs says which parts exist (qkv bias, q/k norms,
Gemma's norms around attention and the MLP, soft-capping, each layer's sliding window and rope, a mixture of experts
in moe.py). Parameter names follow Hugging Face (``model.layers.N...``), except that q/k/v and gate/up are fused into
one matmul each (``load_hf_state_dict`` concatenates them, as Phi-3's checkpoints already are), because on CPU one wide
matmul beats three narrow ones, and that a layer's experts are stacked.

Tokens arrive flattened: ``input_ids`` and ``positions`` are [T] over every request in
the step; attention.py knows which token belongs to whom.

Under tensor parallelism (``tp``, parallel.py) each rank builds its shard: its heads' rows of qkv_proj and columns of
o_proj, its slice of the MLP's (and each expert's) intermediate, its rows of the vocabulary; a layer's attention and MLP
outputs are all-reduced, the logits all-gathered. The loader cuts each checkpoint tensor to the rank's part.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mooncake.engine.attention import AttentionMetadata, KVScales, paged_attention, write_kv
from mooncake.engine.connector import ConnectorStep, KVConnector
from mooncake.engine.model_args import ModelArgs
from mooncake.engine.moe import SparseMoE, activation
from mooncake.engine.parallel import SINGLE, TensorParallel
from mooncake.engine.quant import linear, read_quantized, units

FUSED_MIN_TOKENS = 256  # eager steps of fewer tokens keep torch's kernels


def fused(x: torch.Tensor, name: str):
    """The Triton kernel ``name`` of kernels/triton_mlp.py or triton_fused.py where it pays for activations x: on CUDA,
    in a graph being captured or a step of at least FUSED_MIN_TOKENS tokens. Launched from Python, one such kernel
    costs more host time than the few torch kernels it replaces, which only a graph or a step of many tokens repays.
    None otherwise, and where Triton is missing: the caller then runs torch's kernels."""
    if not x.is_cuda or not (x.shape[0] >= FUSED_MIN_TOKENS or torch.cuda.is_current_stream_capturing()):
        return None
    return _triton_kernels().get(name)


@functools.cache
def _triton_kernels() -> dict:
    try:
        from mooncake.engine.kernels.triton_fused import add_rms_norm, rope
        from mooncake.engine.kernels.triton_mlp import silu_mul
    except ImportError:
        return {}
    return {"add_rms_norm": add_rms_norm, "rope": rope, "silu_mul": silu_mul}


class RMSNorm(nn.Module):
    """RMSNorm times ``weight``; a ``gemma`` norm stores w - 1 and scales by (1 + w), all in float32 (Gemma's order)."""

    def __init__(self, dim: int, eps: float, gemma: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.gemma = gemma

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gemma:
            xf = x.float()
            xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
            return (xf * (1.0 + self.weight.float())).to(x.dtype)
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)  # one fused kernel
        if x.is_cuda:
            # Normalised in float32 and rounded to x's dtype, then times the weight in x's dtype: transformers' order,
            # in two kernels instead of eight (a decode step on a GPU is bound by how many kernels it runs).
            return self.weight * F.rms_norm(x, self.weight.shape, None, self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)

    def add_norm(self, delta: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(this norm of x + delta, x + delta): the residual add and the norm after it, in one kernel where that
        pays (``fused``)."""
        kernel = None if self.gemma else fused(x, "add_rms_norm")
        if kernel is not None:
            return kernel(delta, x, self.weight, self.eps)
        x = x + delta
        return self(x), x


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE: x * cos + cat(-x2, x1) * sin, without building the rotated copy (in one kernel where that
    pays: ``fused``).

    x: [T, heads, D]; cos, sin: [T, 1, R] where the first R <= D dimensions rotate (partial rotary: the rest pass
    through). Returns a new tensor.
    """
    r = cos.shape[-1]
    if r < x.shape[-1]:
        return torch.cat((_rotate(x[..., :r], cos, sin), x[..., r:]), dim=-1)
    kernel = fused(x, "rope")
    if kernel is not None:
        return kernel(x, cos, sin)
    return _rotate(x, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    out = x * cos
    out[..., :half].addcmul_(x2, sin[..., :half], value=-1.0)
    out[..., half:].addcmul_(x1, sin[..., half:])
    return out


class Attention(nn.Module):
    """One layer's attention (of this rank's heads: its output is a partial sum under tensor parallelism)."""

    def __init__(self, args: ModelArgs, layer: int, tp: TensorParallel = SINGLE):
        super().__init__()
        self.layer = layer
        q_heads, kv_heads = tp.q_heads(args), tp.kv_heads(args)
        self.num_heads = q_heads.stop - q_heads.start
        self.num_kv_heads = kv_heads.stop - kv_heads.start
        self.head_dim = args.head_dim
        self.q_size = self.num_heads * args.head_dim
        self.kv_size = self.num_kv_heads * args.head_dim
        self.scale = args.scale
        self.window = args.window(layer) or 0  # 0: the whole context
        self.softcap = args.attn_softcap or 0.0  # 0: none
        self.kv_scales = KVScales()  # an FP8 cache's (the checkpoint's k_scale and v_scale, else 1.0)
        p = f"model.layers.{layer}.self_attn."
        fused = ("qkv_proj",) if args.arch == "phi3" else ("q_proj", "k_proj", "v_proj")
        self.qkv_proj = linear(
            args.quant, args.hidden_size, self.q_size + 2 * self.kv_size, args.qkv_bias, tuple(p + n for n in fused)
        )
        self.o_proj = linear(args.quant, self.q_size, args.hidden_size, False, (p + "o_proj",))
        if args.qk_norm:
            self.q_norm = RMSNorm(args.head_dim, args.rms_norm_eps, args.gemma_norms)
            self.k_norm = RMSNorm(args.head_dim, args.rms_norm_eps, args.gemma_norms)
        else:
            self.q_norm = self.k_norm = None

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        cos: torch.Tensor,  # [T, 1, R]
        sin: torch.Tensor,
        kv_cache: torch.Tensor,  # [2, num_blocks, bs, Hkv, D]
        meta: AttentionMetadata,
        connector: KVConnector,
        step: ConnectorStep,
    ) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        v = qkv[:, self.q_size + self.kv_size :].view(t, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        if self.q_norm is not None:
            q, k = qkv[:, : self.q_size + self.kv_size].split([self.q_size, self.kv_size], dim=-1)
            q = apply_rope(self.q_norm(q.reshape(t, self.num_heads, self.head_dim)), cos, sin)  # [T, H, D]
            k = apply_rope(self.k_norm(k.reshape(t, self.num_kv_heads, self.head_dim)), cos, sin)  # [T, Hkv, D]
        else:  # q and k rotated together: one set of kernels for both
            qk = qkv[:, : self.q_size + self.kv_size].view(t, self.num_heads + self.num_kv_heads, self.head_dim)
            qk = apply_rope(qk, cos, sin)  # [T, H + Hkv, D]
            q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]  # [T, H, D], [T, Hkv, D]
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        connector.wait_for_layer_load(self.layer)
        write_kv(k_cache, v_cache, k, v, meta.slot_mapping, self.kv_scales)
        o = paged_attention(
            q, k, v, k_cache, v_cache, meta, self.scale, self.window, self.softcap, self.kv_scales
        )  # [T, H, D]
        connector.save_layer(self.layer, k_cache, v_cache, step)
        return self.o_proj(o.view(t, self.q_size))


class MLP(nn.Module):
    """A gated MLP (of this rank's slice of the intermediate: a partial sum under tensor parallelism)."""

    def __init__(self, args: ModelArgs, layer: int, tp: TensorParallel = SINGLE):
        super().__init__()
        self.intermediate = args.intermediate_size // tp.size
        self.silu = args.hidden_act == "silu"
        self.act = activation(args.hidden_act)
        p = f"model.layers.{layer}.mlp."
        fused = ("gate_up_proj",) if args.arch == "phi3" else ("gate_proj", "up_proj")
        self.gate_up_proj = linear(
            args.quant, args.hidden_size, 2 * self.intermediate, False, tuple(p + n for n in fused)
        )
        self.down_proj = linear(args.quant, self.intermediate, args.hidden_size, False, (p + "down_proj",))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # [T, 2I]
        kernel = fused(x, "silu_mul") if self.silu else None
        if kernel is not None:
            return self.down_proj(kernel(gate_up))
        gate, up = gate_up.split(self.intermediate, dim=-1)  # [T, I] each
        if self.silu:
            return self.down_proj(F.silu(gate, inplace=True).mul_(up))
        return self.down_proj(self.act(gate).mul_(up))


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, layer: int, tp: TensorParallel = SINGLE):
        super().__init__()
        eps, gemma = args.rms_norm_eps, args.gemma_norms
        self.tp = tp
        self.rope_local = args.rope_local is not None and args.window(layer) is not None  # Gemma 3's local layers
        self.self_attn = Attention(args, layer, tp)
        if args.is_moe(layer):
            self.mlp = SparseMoE(
                args.hidden_size,
                args.moe_intermediate_size // tp.size,
                args.num_experts,
                args.num_experts_per_tok,
                args.norm_topk_prob,
                args.hidden_act,
            )
        else:
            self.mlp = MLP(args, layer, tp)
        self.input_layernorm = RMSNorm(args.hidden_size, eps, gemma)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, eps, gemma)
        if args.sandwich_norms:  # Gemma: post_attention_layernorm normalises the attention's output instead
            self.pre_feedforward_layernorm = RMSNorm(args.hidden_size, eps, gemma)
            self.post_feedforward_layernorm = RMSNorm(args.hidden_size, eps, gemma)
        else:
            self.pre_feedforward_layernorm = self.post_feedforward_layernorm = None

    def forward(self, x, delta, ropes, kv_cache, meta, connector, step) -> tuple[torch.Tensor, torch.Tensor]:
        """(the residual stream, the MLP's output not yet added to it): the add is left to the next norm, which does
        it in its own kernel where that pays. ``delta`` is the previous layer's MLP output, None before the first;
        ``ropes`` the step's (cos, sin) of the global layers, then of the local ones."""
        cos, sin = ropes[1] if self.rope_local else ropes[0]
        h, x = (self.input_layernorm(x), x) if delta is None else self.input_layernorm.add_norm(delta, x)
        a = self.tp.all_reduce(self.self_attn(h, cos, sin, kv_cache, meta, connector, step))
        if self.pre_feedforward_layernorm is None:
            h, x = self.post_attention_layernorm.add_norm(a, x)
            return x, self.tp.all_reduce(self.mlp(h))
        h, x = self.pre_feedforward_layernorm.add_norm(self.post_attention_layernorm(a), x)
        return x, self.post_feedforward_layernorm(self.tp.all_reduce(self.mlp(h)))


class Backbone(nn.Module):
    """The decoder layers of ``layers`` (keyed by their global index, so parameter names stay Hugging Face's), the
    embedding where the first layer is (or the last, when the head is tied to it) and the final norm where the last
    is."""

    def __init__(self, args: ModelArgs, layers: range, tp: TensorParallel = SINGLE):
        super().__init__()
        first, last = layers.start == 0, layers.stop == args.num_layers
        vocab = tp.vocab(args)
        # its weight given (uninitialised: the checkpoint's is copied in): Embedding's own random init would import
        # torch._dynamo, about 2 s of every worker's start on a CPU
        rows = vocab.stop - vocab.start
        self.embed_tokens = (
            nn.Embedding(rows, args.hidden_size, _weight=torch.empty(rows, args.hidden_size))
            if first or (last and args.tie_word_embeddings)
            else None
        )
        self.layers = nn.ModuleDict({str(i): DecoderLayer(args, i, tp) for i in layers})
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps, args.gemma_norms) if last else None


class CausalLM(nn.Module):
    """The model, or one pipeline stage of it (``layers``, a contiguous range of decoder layers): ``forward`` gives
    hidden states (the last stage's normed), ``compute_logits`` the logits (last stage only)."""

    def __init__(self, args: ModelArgs, layers: range | None = None, tp: TensorParallel = SINGLE):
        super().__init__()
        tp.check(args)
        self.args = args
        self.tp = tp
        kv_heads = tp.kv_heads(args)
        self.num_kv_heads = kv_heads.stop - kv_heads.start  # this rank's: its KV cache's heads
        self.layer_range = range(args.num_layers) if layers is None else layers
        if not (0 <= self.layer_range.start < self.layer_range.stop <= args.num_layers and self.layer_range.step == 1):
            raise ValueError(
                f"layers {self.layer_range} are not a contiguous range within the model's {args.num_layers}"
            )
        self.is_first = self.layer_range.start == 0
        self.is_last = self.layer_range.stop == args.num_layers
        self.model = Backbone(args, self.layer_range, tp)
        vocab = tp.vocab(args)
        self.lm_head = (
            nn.Linear(args.hidden_size, vocab.stop - vocab.start, bias=False)
            if self.is_last and not args.tie_word_embeddings
            else None
        )
        self._rope_cache: tuple[tuple[torch.Tensor, torch.Tensor], ...] | None = None

    def rope_tables(self, max_len: int) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
        """(cos, sin) tables [max_len, R] in the model dtype, of the global layers' rope and then the local layers'
        where they have their own (built once, then cached)."""
        if self._rope_cache is None or self._rope_cache[0][0].shape[0] < max_len:
            p = next(self.parameters())
            ropes = [self.args.rope] + ([self.args.rope_local] if self.args.rope_local is not None else [])
            self._rope_cache = tuple(r.tables(max_len, p.dtype, p.device) for r in ropes)
        return self._rope_cache

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: torch.Tensor,  # [L, 2, num_blocks, bs, Hkv, D]
        meta: AttentionMetadata,
        connector: KVConnector,
        step: ConnectorStep,
        hidden: torch.Tensor | None = None,  # [T, hidden]: a later pipeline stage's input, instead of input_ids
    ) -> torch.Tensor:
        """Hidden states [T, hidden] after this model's layers (``kv_caches[j]`` is its j-th layer's cache); normed
        on the last stage."""
        ropes = [(c[positions].unsqueeze(1), s[positions].unsqueeze(1)) for c, s in self._rope_cache]  # [T, 1, R]
        if len(ropes) == 1:
            ropes.append(ropes[0])
        if hidden is None:
            if not self.is_first:
                raise ValueError(
                    f"a stage starting at layer {self.layer_range.start} takes hidden states, not token ids"
                )
            hidden = self.embed(input_ids)  # [T, hidden]
            if self.args.embed_scale is not None:
                hidden = hidden * torch.tensor(self.args.embed_scale, dtype=hidden.dtype)
        x, delta = hidden, None
        for j, layer in enumerate(self.model.layers.values()):
            x, delta = layer(x, delta, ropes, kv_caches[j], meta, connector, step)
        return self.model.norm.add_norm(delta, x)[0] if self.is_last else x + delta  # [T, hidden]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The token embeddings [T, hidden]; under tensor parallelism each rank looks up the ids in its rows of the
        vocabulary (zero for the others) and the ranks' rows are summed."""
        if self.tp.size == 1:
            return self.model.embed_tokens(input_ids)
        vocab = self.tp.vocab(self.args)
        local = input_ids - vocab.start
        outside = (local < 0) | (local >= vocab.stop - vocab.start)
        rows = self.model.embed_tokens(local.masked_fill(outside, 0))
        return self.tp.all_reduce(rows.masked_fill_(outside.unsqueeze(-1), 0))

    def owns(self, name: str) -> bool:
        """Whether the Hugging Face-named parameter ``name`` belongs to this model (or stage)."""
        if name.startswith("model.layers."):
            return int(name.split(".")[2]) in self.layer_range
        if name.startswith("model.embed_tokens."):
            return self.model.embed_tokens is not None
        if name.startswith("model.norm."):
            return self.is_last
        if name.startswith("lm_head."):
            return self.lm_head is not None
        return True

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [N, vocab] in float32 for the given hidden rows [N, hidden] (soft-capped where the model is)."""
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        # W @ h^T rather than h @ W^T: with few rows and a 50k-row vocabulary MKL runs
        # this order faster on CPU (benchmarks/matmul_shapes.py). The result is a transposed view.
        logits = (weight @ hidden.t()).t()  # [N, V] (this rank's rows of V under tensor parallelism)
        if self.tp.size > 1:
            logits = self.tp.all_gather(logits)[:, : self.args.vocab_size]
        cap = self.args.final_softcap
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits.float()

    def load_hf_state_dict(self, weights: dict[str, torch.Tensor]) -> None:
        """Load Hugging Face-named tensors (see ``load_hf_tensors``). Raises ValueError on a mismatch."""
        self.load_hf_tensors(weights.items())

    @torch.no_grad()
    def load_hf_tensors(self, tensors: Iterable[tuple[str, Any]]) -> None:
        """Copy Hugging Face-named tensors (torch tensors, or ``loader.FileTensor``s read in place), one at a time, into
        this model's parameters, converting dtype and device as each is copied: q/k/v into their rows of ``qkv_proj``,
        gate/up into ``gate_up_proj``, each expert into its slice of the stacked experts; under tensor parallelism,
        only this rank's part of each (``_slots``). A tensor is not kept after its copy, so loading takes the
        parameters' memory and at most one tensor's more. Tensors of other pipeline stages are skipped. Raises
        ValueError naming the tensors when a name is unknown, a shape does not fit, a tensor comes twice, or a
        parameter is left unfilled."""
        params = dict(self.named_parameters()) | dict(self.named_buffers())  # quantized layers' values are buffers
        filled = dict.fromkeys(params, 0)
        if self.args.quant is not None:
            tensors = read_quantized(tensors, self.args.quant)
        for pname, pad in self._vocab_padding():  # rows past the vocabulary (the last rank's): zero, never read
            params[pname][pad].zero_()
            filled[pname] += params[pname][pad].numel()
        seen: set[str] = set()
        unexpected: list[str] = []
        for name, tensor in tensors:
            if "rotary_emb" in name or not self.owns(name) or (name == "lm_head.weight" and self.lm_head is None):
                continue
            if name in seen:
                raise ValueError(f"weight {name} appears twice")
            seen.add(name)
            scale = _KV_SCALE.fullmatch(name)
            if scale:  # an FP8 KV cache's scale of one layer (compressed-tensors' and ModelOpt's name)
                attention = self.model.layers[scale[1]].self_attn
                value = _scalar(name, tensor)
                kv = attention.kv_scales
                attention.kv_scales = KVScales(value, kv.v) if scale[2] == "k" else KVScales(kv.k, value)
                continue
            slots = self._slots(name, tensor.shape)
            if slots is None or any(pname not in params for pname, _, _ in slots):
                unexpected.append(name)
                continue
            for pname, index, part in slots:
                dest = params[pname][index]
                shape = tuple(torch.empty(tensor.shape, device="meta")[part].shape)
                if shape != tuple(dest.shape):
                    whole = f" (its part {shape} for this rank)" if part else ""
                    raise ValueError(
                        f"weight {name} has shape {tuple(tensor.shape)}{whole}, expected {tuple(dest.shape)}"
                    )
                _copy_part(tensor, part, dest)
                filled[pname] += dest.numel()
        missing = sorted(n for n, p in params.items() if filled[n] != p.numel())
        if missing or unexpected:
            raise ValueError(
                f"weights do not match the {self.args.arch} architecture: "
                f"missing {missing[:5]}{'...' if len(missing) > 5 else ''}, "
                f"unexpected {sorted(unexpected)[:5]}{'...' if len(unexpected) > 5 else ''}"
            )

    def _vocab_padding(self) -> list[tuple[str, slice]]:
        """(parameter, rows) of the embedding and LM head past the vocabulary's end on this rank."""
        vocab = self.tp.vocab(self.args)
        real = max(0, min(vocab.stop, self.args.vocab_size) - vocab.start)
        if real == vocab.stop - vocab.start:
            return []
        held = (("model.embed_tokens.weight", self.model.embed_tokens), ("lm_head.weight", self.lm_head))
        return [(name, slice(real, None)) for name, module in held if module is not None]

    def _slots(self, name: str, shape: torch.Size) -> list[tuple[str, tuple, tuple]] | None:
        """Where the Hugging Face tensor ``name`` goes: (our parameter, the index of the part of it,
        the index of the tensor's part that fills it) for each part; () where whole. None: no parameter takes it."""
        a, tp = self.args, self.tp
        d = a.head_dim
        q_heads, kv_heads = tp.q_heads(a), tp.kv_heads(a)
        q_rows = slice(q_heads.start * d, q_heads.stop * d)
        kv_rows = slice(kv_heads.start * d, kv_heads.stop * d)
        nq, nkv = q_rows.stop - q_rows.start, kv_rows.stop - kv_rows.start
        inter = tp.part(a.intermediate_size, "the MLP's intermediate size")
        ni = inter.stop - inter.start
        whole = tp.size == 1
        m = _FUSED.fullmatch(name)
        if m is None:
            if whole:
                return [(name, (), ())]
            return self._split(name, shape, q_rows, kv_rows, inter)
        p = f"model.layers.{m['layer']}."
        part = m["part"]
        if part is not None:
            total_q, total_kv = a.num_heads * d, a.num_kv_heads * d
            start = {"q": 0, "k": nq, "v": nq + nkv}[part]
            rows = q_rows if part == "q" else kv_rows
            if whole:
                rows = slice(0, total_q if part == "q" else total_kv)
            size = rows.stop - rows.start
            return [(f"{p}self_attn.qkv_proj.{m['kind']}", (slice(start, start + size),), () if whole else (rows,))]
        if m["mlp"] is not None:
            dest = slice(0, ni) if m["mlp"] == "gate" else slice(ni, 2 * ni)
            return [(f"{p}mlp.gate_up_proj.{m['mkind']}", (dest,), () if whole else (inter,))]
        if m["router"] is not None:
            return [(f"{p}mlp.gate.weight", (), ())]
        e, proj = int(m["expert"]), m["proj"]
        moe = tp.part(a.moe_intermediate_size, "the experts' intermediate size")
        i = moe.stop - moe.start
        if proj in ("down_proj", "w2"):
            return [(f"{p}mlp.experts_down", (e,), () if whole else (slice(None), moe))]
        dest = slice(0, i) if proj in ("gate_proj", "w1") else slice(i, 2 * i)
        return [(f"{p}mlp.experts_gate_up", (e, dest), () if whole else (moe,))]

    def _split(
        self, name: str, shape: torch.Size, q_rows: slice, kv_rows: slice, inter: slice
    ) -> list[tuple[str, tuple, tuple]]:
        """``_slots`` of a tensor whose name is our parameter's, under tensor parallelism: the vocabulary's rows,
        o_proj's and down_proj's input columns (a quantized layer's: its values' and scales' columns, quant.units), the
        already-fused qkv_proj's and gate_up_proj's rows (Phi-3)."""
        a = self.args
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            vocab = self.tp.vocab(a)
            real = slice(vocab.start, min(vocab.stop, a.vocab_size))
            return [(name, (slice(0, max(0, real.stop - real.start)),), (real,))]
        module, kind = name.rsplit(".", 1)
        if module.endswith("self_attn.o_proj") and kind != "bias":
            return [(name, (), (slice(None), units(q_rows, shape[1], a.num_heads * a.head_dim, name)))]
        if module.endswith("mlp.down_proj"):
            return [(name, (), (slice(None), units(inter, shape[1], a.intermediate_size, name)))]
        if module.endswith("self_attn.qkv_proj"):
            q, kv = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
            nq, nkv = q_rows.stop - q_rows.start, kv_rows.stop - kv_rows.start
            return [
                (name, (slice(0, nq),), (q_rows,)),
                (name, (slice(nq, nq + nkv),), (slice(q + kv_rows.start, q + kv_rows.stop),)),
                (name, (slice(nq + nkv, nq + 2 * nkv),), (slice(q + kv + kv_rows.start, q + kv + kv_rows.stop),)),
            ]
        if module.endswith("mlp.gate_up_proj"):
            i, ni = a.intermediate_size, inter.stop - inter.start
            return [
                (name, (slice(0, ni),), (inter,)),
                (name, (slice(ni, 2 * ni),), (slice(i + inter.start, i + inter.stop),)),
            ]
        return [(name, (), ())]  # norms and the like: every rank whole


def _copy_part(tensor: Any, part: tuple, dest: torch.Tensor) -> None:
    """Copy ``tensor[part]`` (a torch tensor, or a ``loader.FileTensor``: its leading rows read in place, any other
    part through one staging copy) into ``dest``."""
    if isinstance(tensor, torch.Tensor):
        dest.copy_(tensor[part] if part else tensor)
    elif not part:
        tensor.read_into(dest)
    elif len(part) == 1 and part[0].step is None:
        tensor.rows(part[0]).read_into(dest)
    else:
        staged = torch.empty(tensor.shape, dtype=tensor.dtype)
        tensor.read_into(staged)
        dest.copy_(staged[part])


_KV_SCALE = re.compile(r"model\.layers\.(\d+)\.self_attn\.([kv])_scale")


def _scalar(name: str, tensor: Any) -> float:
    """The one value of a checkpoint's scalar tensor (a torch tensor or a ``loader.FileTensor``)."""
    if tensor.shape.numel() != 1:
        raise ValueError(f"weight {name} has shape {tuple(tensor.shape)}: a KV cache scale is one value a layer")
    if not isinstance(tensor, torch.Tensor):
        value = torch.empty(tensor.shape, dtype=torch.float32)
        tensor.read_into(value)
        tensor = value
    return float(tensor.float().reshape(-1)[0])


# Hugging Face tensors that fill part of one of our parameters: q/k/v, a dense MLP's gate/up, an expert's projections
# (Qwen3-MoE's and Mixtral's names), Mixtral's router.
_FUSED = re.compile(
    r"model\.layers\.(?P<layer>\d+)\.(?:"
    r"self_attn\.(?P<part>q|k|v)_proj\.(?P<kind>weight|bias|qweight|scales|zeros)"
    r"|mlp\.(?P<mlp>gate|up)_proj\.(?P<mkind>weight|qweight|scales|zeros)"
    r"|(?:mlp|block_sparse_moe)\.experts\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj|w1|w2|w3)\.weight"
    r"|block_sparse_moe\.(?P<router>gate)\.weight)"
)
