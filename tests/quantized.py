"""Quantized checkpoints made by maintained libraries from a float model, and those libraries' own dequantized models.

``compressed_tensors_checkpoint``: compressed-tensors quantizes (its ``calculate_qparams`` from each weight's minimum
and maximum, as its memoryless min-max observer) and writes its formats; ``library_model`` is transformers loading it
with compressed-tensors decompressing (``run_compressed=False``): the reference our engine must generate the tokens of.
``fp8_checkpoint`` renames a compressed-tensors FP8 checkpoint to vLLM's and transformers' ``fp8`` format (the same
values). ``awq_checkpoint`` / ``gptq_checkpoint``: vLLM's ``quantize_weights`` and its ``awq_pack`` / ``gptq_pack``
(what vLLM's kernel tests build their checkpoints with) write AutoAWQ's and AutoGPTQ's layouts, and the float model
with vLLM's dequantized reference weights is their reference.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _copy_side_files(src: Path, dst: Path) -> None:
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.name not in ("config.json", "model.safetensors.index.json"):
            shutil.copy(f, dst / f.name)


def compressed_tensors_checkpoint(
    src: Path,
    dst: Path,
    *,
    bits: int,
    kind: str,
    strategy: str,
    symmetric: bool = True,
    group: int | None = None,
    dynamic_activations: bool = False,
) -> Path:
    """``src`` quantized by compressed-tensors and written in the format it chooses for the scheme (weights only: FP8
    and 8-bit integers naive-quantized, 4-bit pack-quantized); ``kind`` "float" (FP8) or "int"; ``group``: the group
    size, or a block's side for strategy "block"; ``dynamic_activations``: FP8 activations too (W8A8)."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        QuantizationStatus,
        apply_quantization_config,
    )
    from compressed_tensors.quantization.utils import calculate_qparams
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    args = QuantizationArgs(
        num_bits=bits,
        type=kind,
        strategy=strategy,
        symmetric=symmetric,
        group_size=group if strategy == "group" else None,
        block_structure=[group, group] if strategy == "block" else None,
    )
    activations = None
    if dynamic_activations:  # W8A8: each token's activations rounded at run time (FP8_DYNAMIC: float-quantized)
        activations = QuantizationArgs(num_bits=8, type=kind, strategy="token", symmetric=True, dynamic=True)
    scheme = QuantizationScheme(targets=["Linear"], weights=args, input_activations=activations)
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"]))
    for module in model.modules():
        if getattr(module, "quantization_scheme", None) is None:
            continue
        w = module.weight.data
        if strategy == "tensor":
            lo, hi = w.min(), w.max()
        elif strategy == "channel":
            lo, hi = w.amin(1, keepdim=True), w.amax(1, keepdim=True)
        elif strategy == "group":
            lo, hi = w.unflatten(-1, (-1, group)).amin(-1), w.unflatten(-1, (-1, group)).amax(-1)
        else:
            blocks = w.unflatten(0, (-1, group)).unflatten(-1, (-1, group))
            lo, hi = blocks.amin((1, 3)), blocks.amax((1, 3))
        scale, zero = calculate_qparams(lo, hi, args)
        module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))
        if hasattr(module, "weight_zero_point"):
            module.weight_zero_point.data.copy_(zero.reshape(module.weight_zero_point.shape))
        module.quantization_status = QuantizationStatus.FROZEN
    compressor = ModelCompressor.from_pretrained_model(model)  # the format the library chooses for the scheme
    compressor.compress_model(model)
    shutil.rmtree(dst, ignore_errors=True)
    model.save_pretrained(dst)
    compressor.update_config(dst)
    _copy_side_files(Path(src), dst)
    return dst


def library_model(path: Path):
    """transformers' model of a compressed-tensors checkpoint, decompressed by compressed-tensors (eager attention:
    Gemma 2's soft-capping has no other)."""
    from transformers import AutoModelForCausalLM
    from transformers.utils.quantization_config import CompressedTensorsConfig

    config = CompressedTensorsConfig(run_compressed=False)
    return AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, quantization_config=config, attn_implementation="eager"
    ).eval()


def fp8_checkpoint(ct: Path, dst: Path, block: int | None = None) -> Path:
    """A compressed-tensors FP8 checkpoint (per tensor, or blocks of ``block``) as the ``fp8`` format: the same float8
    weights, blocks' scales named ``weight_scale_inv``."""
    shutil.copytree(ct, dst)
    (weights,) = dst.glob("*.safetensors")
    tensors = load_file(weights)
    if block:
        tensors = {k.replace(".weight_scale", ".weight_scale_inv"): v for k, v in tensors.items()}
    save_file(tensors, weights, metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    quant = {"quant_method": "fp8", "activation_scheme": "dynamic", "ignored_layers": ["lm_head"]}
    if block:
        quant["weight_block_size"] = [block, block]
    config["quantization_config"] = quant
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def _vllm_layouts(src: Path, dst: Path, method: str, group: int) -> Path:
    """``src``'s decoder linears quantized to 4 bits in groups by vLLM (AWQ: zero points; GPTQ: symmetric, uint4b8)
    and packed in ``method``'s layout into ``dst``; ``dst / "reference"``: the float model of vLLM's dequantized
    weights."""
    from vllm.model_executor.layers.quantization.utils.quant_utils import (
        awq_pack,
        gptq_pack,
        pack_cols,
        quantize_weights,
    )
    from vllm.scalar_type import scalar_types

    src = Path(src)
    (file,) = src.glob("*.safetensors")
    tensors = load_file(file)
    quantized, reference = {}, dict(tensors)
    for name, w in tensors.items():
        if not name.endswith(".weight") or name.split(".")[-2] not in LINEARS:
            quantized[name] = w
            continue
        module = name[: -len(".weight")]
        size_k, size_n = w.shape[1], w.shape[0]
        qtype = scalar_types.uint4 if method == "awq" else scalar_types.uint4b8
        w_ref, w_q, w_s, w_zp = quantize_weights(w.t().half(), qtype, group, zero_points=method == "awq")
        reference[name] = w_ref.t().float().contiguous()
        quantized[f"{module}.scales"] = w_s
        if method == "awq":
            quantized[f"{module}.qweight"] = awq_pack(w_q, 4, size_k, size_n)
            quantized[f"{module}.qzeros"] = awq_pack(w_zp, 4, size_k // group, size_n)
        else:
            quantized[f"{module}.qweight"] = gptq_pack(w_q, 4, size_k, size_n)
            zeros = torch.full((size_k // group, size_n), 8 - 1, dtype=torch.int32)  # stored less one (v1)
            quantized[f"{module}.qzeros"] = pack_cols(zeros, 4, size_k // group, size_n)
            quantized[f"{module}.g_idx"] = torch.arange(size_k, dtype=torch.int32) // group
    shutil.rmtree(dst, ignore_errors=True)
    dst.mkdir(parents=True)
    save_file(quantized, dst / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    _copy_side_files(src, dst)
    ref = dst / "reference"
    ref.mkdir()
    save_file(reference, ref / "model.safetensors", metadata={"format": "pt"})
    (ref / "config.json").write_text(json.dumps(config))
    _copy_side_files(src, ref)
    if method == "awq":
        config["quantization_config"] = {
            "quant_method": "awq",
            "bits": 4,
            "group_size": group,
            "zero_point": True,
            "version": "gemm",
            "modules_to_not_convert": None,
        }
    else:
        config["quantization_config"] = {
            "quant_method": "gptq",
            "bits": 4,
            "group_size": group,
            "desc_act": False,
            "sym": True,
            "checkpoint_format": "gptq",
        }
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def awq_checkpoint(src: Path, dst: Path, group: int = 16) -> Path:
    return _vllm_layouts(src, dst, "awq", group)


def gptq_checkpoint(src: Path, dst: Path, group: int = 16) -> Path:
    return _vllm_layouts(src, dst, "gptq", group)
