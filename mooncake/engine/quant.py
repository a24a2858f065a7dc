"""Quantized checkpoints: the weight formats our engine reads (config.json's ``quantization_config``) and the linear
layer that computes with them.

    compressed-tensors  FP8 e4m3 weights (float- or naive-quantized), a scale per tensor, output channel, group or
                        block; integers of 4 or 8 bits (pack-quantized: int32-packed; naive- and int-quantized: a
                        byte each), a scale and, asymmetric, a zero point per channel or group
    fp8                 vLLM's and transformers' FP8: ``weight_scale`` per tensor or channel, or 2-D blocks
                        (``weight_block_size``) with ``weight_scale_inv``
    awq                 AutoAWQ's GEMM layout: ``qweight`` [in, out/8] in AWQ's nibble order, ``qzeros``, ``scales``
    gptq                AutoGPTQ's: ``qweight`` [in/8, out], ``qzeros`` (stored less one in its first format),
                        ``scales``; ``g_idx`` without act-order

Every format is put in one form as it is read (``read_quantized``), the form ``QuantLinear`` keeps: the values [out, in]
(FP8 as float8; integers unsigned, 8 bits a byte, 4 bits two to a byte), a float32 scale [out, groups] and, for
integers, a float32 zero point [out, groups]: ``w = (q - zero) * scale`` over each group of input columns (a tensor's or
a channel's scale is one group a row; a block's, its rows' groups). Rows concatenate, so q/k/v and gate/up are rows of
one layer as our float layers are, and a tensor-parallel rank cuts its rows, or its groups of columns, as a float
weight's. Activations stay in the model's dtype, except where a compressed-tensors scheme rounds each token's to 8 bits
as it runs (FP8_DYNAMIC, W8A8 int8): they are rounded so, as its own model does (``quantized_tokens``); the ``fp8``
format's are computed weight-only, as transformers' model of it is on a CPU. On CUDA a Triton kernel dequantizes each
tile of a weight as the matmul loads it (kernels/triton_quant.py); on the CPU a layer is dequantized as it runs (what
measured fastest there), never the whole model at once.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

READ = "compressed-tensors (float-, naive-, int- and pack-quantized), fp8, awq (gemm), gptq"
_CT_FORMATS = ("float-quantized", "pack-quantized", "naive-quantized", "int-quantized")
_ACTIVATION_PARTS = ("input_scale", "input_zero_point", "input_global_scale", "output_scale")


@dataclass(frozen=True)
class WeightQuant:
    """One checkpoint's weight quantization (``weight_quant`` reads it from the config)."""

    method: str  # quantization_config.quant_method
    fmt: str  # compressed-tensors' format; else the method
    kind: str  # "fp8" or "int"
    bits: int  # 8 (fp8, int8) or 4
    group: int | None = None  # input columns per scale; None: one scale a row (per tensor or channel)
    block_rows: int = 1  # rows per scale (FP8 blocks)
    symmetric: bool = True
    ignore: tuple[str, ...] = ()  # modules left in float: names, or "re:" patterns
    ignore_substrings: bool = False  # transformers' modules_to_not_convert: a name containing one is left
    targets: tuple[str, ...] = ("Linear",)
    gptq_v1: bool = False  # GPTQ's first format: zero points stored less one
    activations: str | None = None  # "fp8" or "int8": each token's activations rounded so at run time (W8A8)

    def describe(self) -> str:
        """As ``mooncake status`` and errors say it: "compressed-tensors int4, groups of 128, asymmetric"."""
        what = "fp8 e4m3" if self.kind == "fp8" else f"int{self.bits}"
        per = f"groups of {self.group}" if self.group else "a scale per row"
        if self.block_rows > 1:
            per = f"{self.block_rows}x{self.group} blocks"
        sym = "" if self.kind == "fp8" else (", symmetric" if self.symmetric else ", asymmetric")
        return f"{self.method} {what}, {per}{sym}"

    def quantizes(self, module: str) -> bool:
        """Whether the checkpoint keeps the linear layer ``module`` (a Hugging Face name) quantized."""
        for entry in self.ignore:
            if entry.startswith("re:"):
                if re.match(entry[3:], module):
                    return False
            elif module == entry or (self.ignore_substrings and entry in module):
                return False
        return any(
            t == "Linear" or (t.startswith("re:") and re.match(t[3:], module)) or t == module for t in self.targets
        )

    def groups(self, in_features: int, module: str) -> int:
        """Scales a row of ``module`` (``in_features`` columns) has; ValueError where its columns do not divide."""
        if self.group is None:
            return 1
        if in_features % self.group:
            raise ValueError(f"{module} has {in_features} input columns, not a multiple of the groups of {self.group}")
        return in_features // self.group


def weight_quant(cfg: dict[str, Any]) -> WeightQuant | None:
    """The config's weight quantization, None for float weights; ValueError naming what we do not read."""
    q = cfg.get("quantization_config")
    if not q:
        return None
    if not isinstance(q, dict):
        raise ValueError(f"quantization_config {q!r} is not an object")
    method = q.get("quant_method")
    readers = {"compressed-tensors": _compressed_tensors, "fp8": _fp8, "awq": _awq, "gptq": _gptq}
    if method not in readers:
        raise ValueError(
            f"quantization_config.quant_method {method!r}: not a format the mooncake engine reads (it reads {READ}; "
            "--engine vllm serves what vLLM serves)"
        )
    return readers[method](q)


def _refuse(what: str) -> ValueError:
    return ValueError(f"{what}: not read by the mooncake engine (it reads {READ})")


def _compressed_tensors(q: dict[str, Any]) -> WeightQuant:
    if q.get("sparsity_config") or q.get("transform_config"):
        raise _refuse("a compressed-tensors checkpoint with a sparsity or transform config")
    schemes = {}
    for name, group in (q.get("config_groups") or {}).items():
        weights = group.get("weights")
        if weights:
            fmt = group.get("format") or q.get("format")
            args = {k: tuple(v) if isinstance(v := weights.get(k), list) else v for k in _CT_ARGS}
            schemes[name] = (fmt, tuple(group.get("targets") or ()), args)
    if not schemes:
        raise _refuse("a compressed-tensors checkpoint without quantized weights")
    if len({(f, tuple(sorted(w.items()))) for f, _, w in schemes.values()}) > 1:
        raise _refuse(f"compressed-tensors with several weight schemes ({', '.join(schemes)})")
    fmt, _, w = next(iter(schemes.values()))
    targets = tuple(t for _, ts, _ in schemes.values() for t in ts) or ("Linear",)
    kind, bits, strategy = w["type"] or "int", int(w["num_bits"] or 8), w["strategy"] or "tensor"
    if fmt not in _CT_FORMATS:
        raise _refuse(f"compressed-tensors format {fmt!r}")
    if w["dynamic"]:
        raise _refuse("compressed-tensors weights quantized dynamically")
    if kind == "float" and bits != 8 or kind == "int" and bits not in (4, 8) or kind not in ("float", "int"):
        raise _refuse(f"compressed-tensors {kind} weights of {bits} bits")
    if (
        kind == "float"
        and fmt not in ("float-quantized", "naive-quantized")
        or kind == "int"
        and fmt == "float-quantized"
    ):
        raise _refuse(f"compressed-tensors {kind} weights in format {fmt!r}")
    group, rows = None, 1
    if strategy == "group":
        group = int(w["group_size"])
    elif strategy == "block":
        rows, group = (int(x) for x in w["block_structure"])
    elif strategy not in ("tensor", "channel"):
        raise _refuse(f"compressed-tensors weight strategy {strategy!r}")
    if kind == "float" and not w["symmetric"]:
        raise _refuse("compressed-tensors asymmetric FP8 weights")
    activations = _ct_activations(next(iter(schemes)), q["config_groups"])
    return WeightQuant(
        "compressed-tensors",
        fmt,
        "fp8" if kind == "float" else "int",
        bits,
        group,
        rows,
        bool(w["symmetric"]),
        tuple(q.get("ignore") or ()),
        targets=targets,
        activations=activations,
    )


def _ct_activations(name: str, groups: dict[str, Any]) -> str | None:
    """The activations' quantization of a compressed-tensors scheme: None, or "fp8" / "int8" for symmetric 8-bit
    scales computed for each token as it runs (FP8_DYNAMIC, W8A8); other kinds refused."""
    a = groups[name].get("input_activations")
    if not a:
        return None
    kind = "fp8" if a.get("type") == "float" else "int8"
    if a.get("dynamic") is not True or a.get("strategy") != "token" or int(a.get("num_bits") or 8) != 8:
        raise _refuse(
            f"compressed-tensors input activations {a.get('type')}{a.get('num_bits')} {a.get('strategy')} "
            f"{'dynamic' if a.get('dynamic') else 'static (input_scale)'} (dynamic per-token 8-bit ones are read)"
        )
    if not a.get("symmetric", True):
        raise _refuse("compressed-tensors asymmetric input activations")
    return kind


_CT_ARGS = ("num_bits", "type", "symmetric", "group_size", "strategy", "block_structure", "dynamic")


def _fp8(q: dict[str, Any]) -> WeightQuant:
    block = q.get("weight_block_size")
    ignore = tuple(q.get("ignored_layers") or ()) + tuple(q.get("modules_to_not_convert") or ())
    if block:
        rows, cols = (int(x) for x in block)
        return WeightQuant("fp8", "fp8", "fp8", 8, cols, rows, ignore=ignore, ignore_substrings=True)
    return WeightQuant("fp8", "fp8", "fp8", 8, ignore=ignore, ignore_substrings=True)


def _awq(q: dict[str, Any]) -> WeightQuant:
    version = str(q.get("version", "gemm")).lower()
    bits = int(q.get("bits", q.get("w_bit", 4)))
    if version != "gemm" or bits != 4:
        raise _refuse(f"awq version {version!r} of {bits} bits (AutoAWQ's 4-bit gemm layout is read)")
    if not q.get("zero_point", True):
        raise _refuse("awq without zero points")
    group = int(q.get("group_size", q.get("q_group_size", 128)))
    return WeightQuant(
        "awq",
        "awq",
        "int",
        4,
        None if group <= 0 else group,
        symmetric=False,
        ignore=tuple(q.get("modules_to_not_convert") or ()),
        ignore_substrings=True,
    )


def _gptq(q: dict[str, Any]) -> WeightQuant:
    bits, fmt = int(q.get("bits", 4)), str(q.get("checkpoint_format", "gptq"))
    if bits not in (4, 8) or fmt not in ("gptq", "gptq_v2"):
        raise _refuse(f"gptq checkpoint_format {fmt!r} of {bits} bits")
    if q.get("desc_act"):
        raise _refuse("gptq with desc_act (act-order: a column order of its own in each layer)")
    if q.get("lm_head") or q.get("dynamic"):
        raise _refuse("gptq with a quantized lm_head or per-module settings (dynamic)")
    group = int(q.get("group_size", 128))
    return WeightQuant(
        "gptq",
        fmt,
        "int",
        bits,
        None if group <= 0 else group,
        symmetric=bool(q.get("sym", True)),
        ignore=tuple(q.get("modules_to_not_convert") or ()),
        ignore_substrings=True,
        gptq_v1=fmt == "gptq",
    )


class QuantLinear(nn.Module):
    """A linear layer over quantized weights (the module's form above): ``forward`` dequantizes them into the
    activations' dtype for its one matmul. Its buffers keep their dtypes when the model is given memory
    (``keeps_dtypes``: loader._materialize)."""

    keeps_dtypes = True

    def __init__(self, in_features: int, out_features: int, bias: bool, quant: WeightQuant, module: str):
        super().__init__()
        groups = quant.groups(in_features, module)
        self.in_features, self.out_features = in_features, out_features
        self.packed = quant.bits == 4
        if self.packed and in_features % 2:
            raise ValueError(f"{module} has an odd number of input columns ({in_features}) for 4-bit weights")
        dtype = torch.float8_e4m3fn if quant.kind == "fp8" else torch.uint8
        self.register_buffer(
            "qweight", torch.empty(out_features, in_features // (2 if self.packed else 1), dtype=dtype)
        )
        self.register_buffer("scales", torch.empty(out_features, groups, dtype=torch.float32))
        self.register_buffer("zeros", torch.empty(out_features, groups) if quant.kind == "int" else None)
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.activations = quant.activations

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight [out, in] in ``dtype`` (computed in float32: the value times its group's scale)."""
        q, scales = self.qweight, self.scales
        if self.packed:
            q = torch.stack((q & 15, q >> 4), dim=-1).view(q.shape[0], -1)
        if q.dtype == torch.float8_e4m3fn and not q.is_cuda:
            # torch converts float8 on the CPU five times slower than this: e4m3's bits shifted into a float16's are
            # its value over 256 (normal and subnormal alike), and float16 converts fast; the 256 joins the scale
            b = q.view(torch.uint8).to(torch.int16)
            q = (((b & 0x7F) << 7) | ((b & 0x80) << 8)).view(torch.float16)
            scales = scales * 256.0
        rows, cols = q.shape
        w = q.to(torch.float32).view(rows, scales.shape[1], -1)
        if self.zeros is not None:
            w.sub_(self.zeros.unsqueeze(-1))
        return w.mul_(scales.unsqueeze(-1)).view(rows, cols).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.activations is not None:
            x = quantized_tokens(x, self.activations)
        kernel = quant_kernel(x)
        if kernel is not None:
            return kernel(x, self.qweight, self.scales, self.zeros, self.bias)
        return F.linear(x, self.dequantized(x.dtype), self.bias)


def quantized_tokens(x: torch.Tensor, kind: str) -> torch.Tensor:
    """Each row of ``x`` as a W8A8 layer's input sees it (compressed-tensors' dynamic per-token rounding, in x's
    dtype): a scale of its largest magnitude over 448 (FP8) or 127.5 (int8), the row over it clamped and rounded to
    e4m3 or to an integer of [-128, 127], times the scale."""
    amax = x.abs().amax(dim=-1, keepdim=True)
    scale = amax / (448.0 if kind == "fp8" else 127.5)
    scale = torch.where(scale == 0, torch.finfo(x.dtype).eps, scale)
    if kind == "fp8":
        rounded = (x / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).to(x.dtype)
    else:
        rounded = (x / scale).clamp(-128.0, 127.0).round()
    return rounded * scale


def quant_kernel(x: torch.Tensor):
    """kernels/triton_quant.py's matmul for activations ``x`` on CUDA (dequantizing in the kernel); None on the CPU,
    where dequantizing the layer and torch's matmul measured fastest (docs/models.md), and where Triton is missing."""
    if not x.is_cuda or x.dim() != 2 or x.stride(-1) != 1:
        return None
    return _triton_quant()


@functools.cache
def _triton_quant():
    try:
        from mooncake.engine.kernels.triton_quant import quant_matmul
    except ImportError:
        return None
    return quant_matmul


def linear(
    quant: WeightQuant | None, in_features: int, out_features: int, bias: bool, modules: tuple[str, ...]
) -> nn.Module:
    """Our layer for the Hugging Face linear layers ``modules`` (rows of one fused layer): a QuantLinear where the
    checkpoint quantizes them, an ``nn.Linear`` where not; ValueError where it quantizes some and not others."""
    if quant is None:
        return nn.Linear(in_features, out_features, bias=bias)
    which = {m: quant.quantizes(m) for m in modules}
    if len(set(which.values())) > 1:
        raise ValueError(f"the checkpoint quantizes some of {', '.join(modules)} and not the others: {which}")
    if not next(iter(which.values())):
        return nn.Linear(in_features, out_features, bias=bias)
    return QuantLinear(in_features, out_features, bias, quant, modules[0])


_PART = re.compile(
    r"(?P<module>.+)\.(?P<part>weight|weight_packed|weight_scale|weight_scale_inv|weight_zero_point|weight_shape"
    r"|weight_g_idx|qweight|qzeros|scales|g_idx|input_scale|input_zero_point|input_global_scale|output_scale)"
)


def read_quantized(tensors: Iterable[tuple[str, Any]], quant: WeightQuant) -> Iterator[tuple[str, Any]]:
    """The checkpoint's tensors with each quantized layer's put in our form, as ``<module>.qweight``, ``.scales``
    and ``.zeros``; other tensors pass as they come. A layer's tensors are held (in memory) until it has them all,
    wherever they are in the files; ValueError naming the layer where some never come, or for a g_idx that
    reorders columns."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    needed = _needed(quant)
    for name, tensor in tensors:
        m = _PART.fullmatch(name)
        part = m["part"] if m else None
        if part is None or part == "weight" and tensor.dtype in (torch.float32, torch.float16, torch.bfloat16):
            yield name, tensor
            continue
        if part in _ACTIVATION_PARTS:
            continue  # activations are computed in the model's dtype
        if part in ("g_idx", "weight_g_idx"):
            _check_g_idx(name, _read(tensor), quant)
            continue
        held = pending.setdefault(m["module"], {})
        held[part] = _read(tensor)
        if needed <= held.keys():
            values, scales, zeros = _canonical(m["module"], pending.pop(m["module"]), quant)
            yield f"{m['module']}.qweight", values
            yield f"{m['module']}.scales", scales
            if zeros is not None:
                yield f"{m['module']}.zeros", zeros
    for module, held in pending.items():
        raise ValueError(
            f"the quantized layer {module} has {sorted(held)} in the checkpoint but not {sorted(needed - held.keys())}"
            f" ({quant.describe()})"
        )


def _needed(quant: WeightQuant) -> set[str]:
    if quant.method in ("awq", "gptq"):
        return {"qweight", "qzeros", "scales"}
    zero = set() if quant.symmetric else {"weight_zero_point"}
    if quant.fmt == "pack-quantized":
        return {"weight_packed", "weight_scale", "weight_shape"} | zero
    if quant.method == "fp8" and quant.block_rows > 1:
        return {"weight", "weight_scale_inv"}
    return {"weight", "weight_scale"} | zero


def _read(tensor: Any) -> torch.Tensor:
    """A torch tensor of a checkpoint tensor (a ``loader.FileTensor`` is read)."""
    if isinstance(tensor, torch.Tensor):
        return tensor
    out = torch.empty(tensor.shape, dtype=tensor.dtype)
    tensor.read_into(out)
    return out


def _check_g_idx(name: str, g_idx: torch.Tensor, quant: WeightQuant) -> None:
    group = quant.group or g_idx.numel()
    if not torch.equal(g_idx.long(), torch.arange(g_idx.numel()) // group):
        raise _refuse(f"{name} reorders the input columns (act-order)")


def _canonical(module: str, t: dict[str, torch.Tensor], quant: WeightQuant):
    """(values, scales, zeros) of one layer in our form from its checkpoint tensors."""
    offset = 1 << (quant.bits - 1)  # integers signed in compressed-tensors: stored plus this
    if quant.method == "awq":
        values = _unpack(t["qweight"], 4, dim=1, order=_AWQ_ORDER).t()
        zeros = _unpack(t["qzeros"], 4, dim=1, order=_AWQ_ORDER).t().float()
        return _pack(values, 4), t["scales"].t().float().contiguous(), zeros.contiguous()
    if quant.method == "gptq":
        values = _unpack(t["qweight"], quant.bits, dim=0).t()
        zeros = _unpack(t["qzeros"], quant.bits, dim=1).t().float() + (1 if quant.gptq_v1 else 0)
        return _pack(values, quant.bits), t["scales"].t().float().contiguous(), zeros.contiguous()
    if quant.fmt == "pack-quantized":
        rows, cols = (int(x) for x in t["weight_shape"])
        values = _unpack(t["weight_packed"], quant.bits, dim=1)[:, :cols]
        scales = t["weight_scale"].float()
        if quant.symmetric:
            zeros = torch.full(scales.shape, float(offset))
        else:
            zeros = _unpack(t["weight_zero_point"], quant.bits, dim=0)[:rows].float()
        return _pack(values, quant.bits), _per_row(module, scales, rows, cols, quant), zeros
    weight = t["weight"]
    rows, cols = weight.shape
    scale = t["weight_scale_inv" if "weight_scale_inv" in t else "weight_scale"].float()
    scales = _per_row(module, scale, rows, cols, quant)
    if quant.kind == "fp8":
        if weight.dtype != torch.float8_e4m3fn:
            raise ValueError(f"{module}.weight is {weight.dtype}, not float8_e4m3fn ({quant.describe()})")
        return weight, scales, None
    zero = t.get("weight_zero_point")
    zeros = torch.full(scales.shape, 0.0) if zero is None else _per_row(module, zero.float(), rows, cols, quant)
    return _pack((weight.to(torch.int16) + offset).to(torch.uint8), quant.bits), scales, zeros + offset


def _per_row(module: str, scale: torch.Tensor, rows: int, cols: int, quant: WeightQuant) -> torch.Tensor:
    """A scale (per tensor [1], channel [rows, 1], group [rows, G] or block [rows / b, G]) as [rows, G] float32."""
    if scale.numel() == 1:
        return scale.reshape(1, 1).expand(rows, 1).contiguous()
    scale = scale.reshape(scale.shape[0], -1)
    if quant.block_rows > 1:
        scale = scale.repeat_interleave(quant.block_rows, dim=0)[:rows]
    groups = quant.groups(cols, module)
    if tuple(scale.shape) != (rows, groups):
        raise ValueError(
            f"{module}'s scale has shape {tuple(scale.shape)}, expected ({rows}, {groups}) ({quant.describe()})"
        )
    return scale.contiguous()


_AWQ_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)  # the nibble of each of 8 consecutive output columns in an AWQ int32


def _unpack(packed: torch.Tensor, bits: int, dim: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """Unsigned ``bits``-bit integers (uint8) packed low bits first into the int32s of ``packed`` along ``dim``;
    ``order``: the position in the int32 of each consecutive value (AWQ's interleave), else in turn."""
    per = 32 // bits
    shifts = torch.arange(per, dtype=torch.int32) * bits
    if order is not None:
        shifts = shifts[list(order)]
    p = packed.to(torch.int32)
    if dim == 0:
        p = p.t()
    values = ((p.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)).reshape(p.shape[0], -1).to(torch.uint8)
    return values.t() if dim == 0 else values


def _pack(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Our form of unsigned integers [out, in]: a byte each (8 bits), two a byte low nibble first (4 bits)."""
    values = values.contiguous()
    if bits == 8:
        return values
    pairs = values.view(values.shape[0], -1, 2)
    return (pairs[..., 0] | (pairs[..., 1] << 4)).contiguous()


def units(columns: slice, n: int, total: int, name: str) -> slice:
    """Input ``columns`` of a layer ``total`` wide as the columns of its tensor ``name`` that is ``n`` wide: the same
    for a float weight, halved for 4-bit values, its groups for scales (all of a row's one); ValueError where a rank's
    share would cut a group."""
    if n == total:
        return columns
    if n == 1:
        return slice(None)
    per = total // n
    if columns.start % per or columns.stop % per:
        raise ValueError(f"{name}: a tensor-parallel rank's input columns {columns} cut its groups of {per}")
    return slice(columns.start // per, columns.stop // per)
