"""Converting a llama.cpp GGUF file into a Hugging Face model directory.

GGUF stores a model as metadata (``llama.block_count``, ``tokenizer.ggml.tokens``,
...) plus tensors under llama.cpp names, most of them quantised. Conversion:

1. read the file with ``gguf.GGUFReader`` (memory-mapped; nothing is copied yet);
2. map the metadata to an HF ``config.json`` (:mod:`mooncake.engine.gguf_config`);
3. for every tensor: dequantise with ``gguf.quants`` (llama.cpp's own Python
   reference), rename to its HF name, and for the ``llama`` architecture undo
   llama.cpp's row permutation of the Q and K projections (below); for Gemma take 1
   off every RMSNorm weight (llama.cpp's converter stores ``w + 1``, HF stores ``w``
   and multiplies by ``1 + w``);
4. rebuild the tokenizer and chat template (:mod:`mooncake.engine.gguf_vocab`);
5. write everything into a temporary directory beside the target and rename it into
   place (:func:`mooncake.engine.weights.atomic_model_dir`).

llama.cpp's ``convert_hf_to_gguf.py`` permutes the rows of ``q_proj`` / ``k_proj`` of
Llama models because ggml's RoPE rotates adjacent pairs (x0, x1), (x2, x3), ... while
HF rotates halves (x0, x_{d/2}), (x1, x_{d/2+1}), .... Per head of ``head_dim = 2h``
rows, llama.cpp stores HF row order::

    HF:    [r0, r1, ..., r_{h-1} | r_h, ..., r_{2h-1}]        (halves)
    GGUF:  [r0, r_h, r1, r_{h+1}, ..., r_{h-1}, r_{2h-1}]      (interleaved)

so undoing it views each head's rows as ``[h, 2]`` and transposes to ``[2, h]``.
Qwen2/Qwen3 and Gemma 3 use NeoX-style RoPE in ggml and are stored unpermuted.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType
from gguf import quants as gguf_quants
from gguf.gguf_reader import ReaderField, ReaderTensor
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from mooncake.engine.gguf_config import HF_CLASSES, ROPE_FREQS_TENSOR, SUPPORTED_GGUF_ARCHS, hf_config_from_gguf
from mooncake.engine.gguf_vocab import build_gguf_tokenizer, gguf_generation_config, gguf_tokenizer_config
from mooncake.engine.weights import (
    CONFIG_FILE,
    GENERATION_CONFIG_FILE,
    TOKENIZER_CONFIG_FILE,
    TOKENIZER_FILE,
    atomic_model_dir,
    save_hf_weights,
    write_json,
)

__all__ = [
    "HF_CLASSES",
    "SUPPORTED_GGUF_ARCHS",
    "SUPPORTED_TYPES",
    "convert_gguf_to_hf",
    "dequantize",
    "hf_config_from_gguf",
    "hf_tensor_name",
    "open_gguf",
    "unpermute_rope_rows",
]

_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
# Gemma's four norms a layer: llama.cpp's ffn_norm is the norm *before* the MLP there.
_GEMMA_LAYER_TENSORS = {
    **_LAYER_TENSORS,
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
_GEMMA = ("gemma3_text",)
_LAYER_NAME = re.compile(r"^blk\.(\d+)\.(.+)$")


def _decodable(qtype: GGMLQuantizationType) -> bool:
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    try:
        with np.errstate(all="ignore"):
            values = gguf_quants.dequantize(np.zeros((1, type_size), dtype=np.uint8), qtype)
    except (NotImplementedError, ValueError, TypeError):
        return False
    return values.size == block_size and np.issubdtype(values.dtype, np.floating)


# Every type gguf.quants (llama.cpp's own Python reference) decodes to floats, probed once on a zero block.
SUPPORTED_TYPES: frozenset[GGMLQuantizationType] = frozenset(filter(_decodable, GGML_QUANT_SIZES))
# Decode at most this many values per gguf.quants call, to bound its temporaries (~32 MiB of output).
_CHUNK_VALUES = 8 * 1024 * 1024


def dequantize(raw: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, ...]) -> np.ndarray:
    """Decode a GGML tensor payload into a float32 array of ``shape`` with ``gguf.quants``.

    ``raw`` is the tensor's data as ``gguf.GGUFReader`` exposes it (any dtype; its bytes
    are what count), ``qtype`` its GGML type, ``shape`` the logical shape in row-major
    (PyTorch) order, i.e. GGUF's ``ne`` reversed. Returns a new float32 array. Raises
    ``ValueError`` for a type gguf.quants cannot decode or a payload of the wrong size.
    Called once per tensor during conversion.
    """
    name = getattr(qtype, "name", str(qtype))
    if qtype not in SUPPORTED_TYPES:
        raise ValueError(f"unsupported GGML tensor type {name}; gguf.quants decodes none of its kind")
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    numel = int(np.prod(shape, dtype=np.int64)) if shape else 1
    if numel % block_size:
        raise ValueError(f"{numel} values are not a whole number of {name} blocks of {block_size}")
    data = np.ascontiguousarray(raw).reshape(-1).view(np.uint8)
    n_blocks = numel // block_size
    if data.size != n_blocks * type_size:
        raise ValueError(f"{name} payload has {data.size} bytes, expected {n_blocks * type_size} for shape {shape}")
    blocks = data.reshape(n_blocks, type_size)
    out = np.empty((n_blocks, block_size), dtype=np.float32)
    step = max(1, _CHUNK_VALUES // block_size)
    # A corrupt file can hold inf/NaN scales; decode them as ggml would, without warnings.
    with np.errstate(all="ignore"):
        for start in range(0, n_blocks, step):
            try:
                values = gguf_quants.dequantize(blocks[start : start + step], qtype)
            except NotImplementedError as exc:
                raise ValueError(f"unsupported GGML tensor type {name}: {exc}") from exc
            out[start : start + step] = values.reshape(-1, block_size)
    return out.reshape(shape)


def _field_value(field: ReaderField) -> Any:
    """A metadata field as a Python value (str, int, float, bool, or a list of those)."""
    types = field.types
    if not types:
        raise ValueError(f"GGUF metadata field {field.name!r} has no type")
    if types[0] == GGUFValueType.ARRAY:
        if len(types) > 1 and types[1] == GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8", errors="replace") for i in field.data]
        if len(types) > 1 and types[1] == GGUFValueType.ARRAY:
            raise ValueError(f"nested arrays in GGUF metadata field {field.name!r} are not supported")
        if not field.data:
            return []
        values = np.concatenate([np.asarray(field.parts[i]).reshape(-1) for i in field.data])
        return values.tolist()
    if types[0] == GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]).decode("utf-8", errors="replace")
    return np.asarray(field.parts[field.data[0]]).reshape(-1)[0].item()


def open_gguf(gguf_path: str | os.PathLike[str]) -> tuple[GGUFReader, dict[str, Any]]:
    """Memory-map a GGUF file and decode its metadata.

    Returns the reader (tensors are read lazily from the map) and a dict of metadata
    key -> Python value. Raises ``FileNotFoundError`` for a missing file and
    ``ValueError`` naming the file for anything that is not a readable GGUF.
    """
    path = Path(gguf_path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file {str(path)!r} does not exist")
    try:
        reader = GGUFReader(path, "r")
    except Exception as exc:  # the reader raises ValueError, IndexError, struct errors...
        raise ValueError(f"{str(path)!r} is not a readable GGUF file: {exc}") from exc
    metadata = {name: _field_value(field) for name, field in reader.fields.items() if not name.startswith("GGUF.")}
    return reader, metadata


def hf_tensor_name(gguf_name: str, model_type: str = "llama") -> str:
    """The HF parameter name for a llama.cpp tensor name in a ``model_type`` model; ``ValueError`` if it has none."""
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    layer_tensors = _GEMMA_LAYER_TENSORS if model_type in _GEMMA else _LAYER_TENSORS
    match = _LAYER_NAME.match(gguf_name)
    if match and match.group(2) in layer_tensors:
        return f"model.layers.{match.group(1)}.{layer_tensors[match.group(2)]}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no Hugging Face equivalent in a {model_type} model")


def unpermute_rope_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's interleaving of Q/K rows (weights [rows, cols] or biases [rows]).

    ``num_heads`` is the number of heads the rows are split into (query heads for
    ``q_proj``, key/value heads for ``k_proj``).
    """
    rows = weight.shape[0]
    if rows % (2 * num_heads):
        raise ValueError(f"{rows} rows cannot be split into {num_heads} heads of even size")
    half = rows // num_heads // 2
    # per head: [h, 2] (GGUF, pairs interleaved) -> [2, h] (HF, halves)
    return weight.reshape(num_heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _expected_tensors(config: dict[str, Any]) -> set[str]:
    names = {"model.embed_tokens.weight", "model.norm.weight"}
    if not config["tie_word_embeddings"]:
        names.add("lm_head.weight")
    per_layer = [
        "input_layernorm.weight",
        "post_attention_layernorm.weight",
        "mlp.gate_proj.weight",
        "mlp.up_proj.weight",
        "mlp.down_proj.weight",
        "self_attn.o_proj.weight",
    ]
    for proj in ("q", "k", "v"):
        per_layer.append(f"self_attn.{proj}_proj.weight")
        if config["attention_bias"]:
            per_layer.append(f"self_attn.{proj}_proj.bias")
    if config["model_type"] in ("qwen3", "gemma3_text"):
        per_layer += ["self_attn.q_norm.weight", "self_attn.k_norm.weight"]
    if config["model_type"] in _GEMMA:
        per_layer += ["pre_feedforward_layernorm.weight", "post_feedforward_layernorm.weight"]
    for i in range(config["num_hidden_layers"]):
        names.update(f"model.layers.{i}.{name}" for name in per_layer)
    return names


def _convert_tensor(tensor: ReaderTensor, config: dict[str, Any], dtype: torch.dtype) -> tuple[str, torch.Tensor]:
    hf_name = hf_tensor_name(tensor.name, config["model_type"])
    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    values = dequantize(tensor.data, tensor.tensor_type, shape)
    if config["model_type"] in _GEMMA and tensor.name.endswith("norm.weight"):
        values = values - np.float32(1.0)  # llama.cpp stores Gemma's RMSNorm weight as w + 1
    if config["model_type"] in ("llama", "mistral"):
        if ".self_attn.q_proj." in hf_name:
            values = unpermute_rope_rows(values, config["num_attention_heads"])
        elif ".self_attn.k_proj." in hf_name:
            values = unpermute_rope_rows(values, config["num_key_value_heads"])
    return hf_name, torch.from_numpy(np.ascontiguousarray(values)).to(dtype)


def _tracked(tensors: list[ReaderTensor], progress: bool, label: str) -> Iterator[ReaderTensor]:
    if not progress:
        yield from tensors
        return
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    # stderr, so that commands printing a result on stdout stay pipeable
    with Progress(*columns, console=Console(stderr=True), transient=False) as bar:
        task = bar.add_task(label, total=len(tensors))
        for tensor in tensors:
            yield tensor
            bar.advance(task)


def convert_gguf_to_hf(
    gguf_path: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    progress: bool = True,
    dtype: torch.dtype = torch.float32,
    max_shard_bytes: int | None = None,
    extra_json: Mapping[str, object] | None = None,
) -> Path:
    """Convert a llama/mistral/qwen2/qwen3/gemma3 GGUF file into a Hugging Face model directory.

    Writes ``config.json``, safetensors weights in ``dtype`` (sharded above
    ``max_shard_bytes`` when given), ``tokenizer.json``, ``tokenizer_config.json``,
    ``generation_config.json``, and ``extra_json`` (file name -> JSON value, e.g. a
    provenance record) so that they appear together. The directory appears atomically: it is built beside
    ``out_dir`` and renamed into place, replacing an existing one only on success.
    Shows a rich progress bar over tensors when ``progress``. Returns ``out_dir`` as an
    absolute path. Raises ``FileNotFoundError`` / ``ValueError`` for a missing or
    unreadable file, an unsupported architecture, tensor type or tokenizer, missing
    tensors, or a ``rope_freqs`` tensor no Llama 3.1 rope scaling reproduces (one that
    does becomes ``rope_scaling`` and is not written as a weight). Reads the whole file
    once; peak memory is about the converted model's size.
    """
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating-point torch.dtype, got {dtype!r}")
    reader, metadata = open_gguf(gguf_path)
    names = [tensor.name for tensor in reader.tensors]
    rope_freqs = None
    weights = []
    for tensor in reader.tensors:
        if tensor.name == ROPE_FREQS_TENSOR:
            shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
            rope_freqs = dequantize(tensor.data, tensor.tensor_type, shape)
        else:
            weights.append(tensor)
    config = hf_config_from_gguf(metadata, names, dtype, rope_freqs=rope_freqs)
    tokenizer = build_gguf_tokenizer(metadata)
    tokenizer_config = gguf_tokenizer_config(metadata, config["max_position_embeddings"])
    generation_config = gguf_generation_config(metadata)

    tensors: dict[str, torch.Tensor] = {}
    label = f"converting {Path(gguf_path).name}"
    for tensor in _tracked(weights, progress, label):
        try:
            name, value = _convert_tensor(tensor, config, dtype)
        except ValueError as exc:
            raise ValueError(f"{str(gguf_path)!r}: tensor {tensor.name!r}: {exc}") from exc
        tensors[name] = value
    missing = sorted(_expected_tensors(config) - set(tensors))
    if missing:
        raise ValueError(f"{str(gguf_path)!r} lacks tensors the model needs: {missing[:8]}")

    with atomic_model_dir(out_dir) as staging:
        write_json(staging / CONFIG_FILE, config)
        write_json(staging / GENERATION_CONFIG_FILE, generation_config)
        write_json(staging / TOKENIZER_CONFIG_FILE, tokenizer_config)
        tokenizer.save(str(staging / TOKENIZER_FILE))
        kwargs = {} if max_shard_bytes is None else {"max_shard_bytes": max_shard_bytes}
        save_hf_weights(staging, tensors, **kwargs)
        for file_name, value in (extra_json or {}).items():
            if Path(file_name).name != file_name:
                raise ValueError(f"extra_json names must be plain file names, got {file_name!r}")
            write_json(staging / file_name, value)
    return Path(out_dir).expanduser().absolute()
