"""Converting a llama.cpp GGUF file into a Hugging Face model directory.

GGUF stores a model as metadata (``llama.block_count``, ``tokenizer.ggml.tokens``,
...) plus tensors under llama.cpp names, most of them quantised. Conversion:

1. read the file with ``gguf.GGUFReader`` (memory-mapped; nothing is copied yet);
2. map the metadata to an HF ``config.json`` (:func:`hf_config_from_gguf`);
3. for every tensor: dequantise (:mod:`mooncake.engine.ggml_quants`), rename to its HF
   name, and for the ``llama`` architecture undo llama.cpp's row permutation of the
   Q and K projections (below);
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
Qwen2/Qwen3 use NeoX-style RoPE in ggml and are stored unpermuted.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGUFReader, GGUFValueType
from gguf.gguf_reader import ReaderField, ReaderTensor
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from mooncake.engine.ggml_quants import dequantize
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

SUPPORTED_GGUF_ARCHS = ("llama", "qwen2", "qwen3")

_HF_CLASSES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}

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
_LAYER_NAME = re.compile(r"^blk\.(\d+)\.(.+)$")


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


def _hf_model_type(metadata: dict[str, Any]) -> str:
    arch = metadata.get("general.architecture")
    if arch not in SUPPORTED_GGUF_ARCHS:
        raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: {', '.join(SUPPORTED_GGUF_ARCHS)}")
    # llama.cpp files Mistral under "llama"; transformers tells them apart by name.
    if arch == "llama" and "mistral" in str(metadata.get("general.name", "")).lower():
        return "mistral"
    return arch


def _rope_scaling(metadata: dict[str, Any], arch: str) -> dict[str, Any] | None:
    kind = metadata.get(f"{arch}.rope.scaling.type")
    if kind in (None, "none"):
        return None
    factor = metadata.get(f"{arch}.rope.scaling.factor")
    if kind not in ("linear", "yarn") or factor is None:
        raise ValueError(f"unsupported GGUF rope scaling {kind!r} (factor {factor!r}); supported: linear, yarn")
    scaling: dict[str, Any] = {"rope_type": kind, "factor": float(factor)}
    original = metadata.get(f"{arch}.rope.scaling.original_context_length")
    if original is not None:
        scaling["original_max_position_embeddings"] = int(original)
    return scaling


def hf_config_from_gguf(
    metadata: dict[str, Any], tensor_names: list[str], dtype: torch.dtype = torch.float32
) -> dict[str, Any]:
    """The HF ``config.json`` dict for a GGUF file with this metadata and these tensors.

    Raises ``ValueError`` for an unsupported architecture, missing required keys, or a
    ``rope_freqs`` tensor (Llama 3.1-style RoPE scaling, whose parameters the file does
    not state).
    """
    model_type = _hf_model_type(metadata)
    arch = str(metadata["general.architecture"])
    if "rope_freqs.weight" in tensor_names:
        raise ValueError(
            "this GGUF stores precomputed RoPE frequency factors (rope_freqs, Llama 3.1-style scaling); "
            "their HF rope_scaling parameters cannot be recovered from the file"
        )

    def key(name: str) -> Any:
        value = metadata.get(f"{arch}.{name}")
        if value is None:
            raise ValueError(f"GGUF metadata lacks required key {arch}.{name}")
        return value

    hidden = int(key("embedding_length"))
    num_heads = int(key("attention.head_count"))
    num_kv_heads = int(metadata.get(f"{arch}.attention.head_count_kv") or num_heads)
    head_dim = metadata.get(f"{arch}.attention.key_length")
    if head_dim is None and model_type in ("llama", "mistral"):
        head_dim = metadata.get(f"{arch}.rope.dimension_count")
    head_dim = int(head_dim or hidden // num_heads)
    tokens = metadata.get("tokenizer.ggml.tokens") or []
    vocab_size = int(metadata.get(f"{arch}.vocab_size") or len(tokens))
    if vocab_size <= 0:
        raise ValueError("GGUF metadata states no vocabulary size and holds no tokens")
    context = int(key("context_length"))
    generation = gguf_generation_config(metadata)

    config: dict[str, Any] = {
        "architectures": [_HF_CLASSES[model_type]],
        "model_type": model_type,
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "intermediate_size": int(key("feed_forward_length")),
        "num_hidden_layers": int(key("block_count")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": context,
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(metadata.get(f"{arch}.rope.freq_base", 10000.0)),
        "rope_scaling": _rope_scaling(metadata, arch),
        "attention_bias": model_type == "qwen2",
        "attention_dropout": 0.0,
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": generation.get("bos_token_id"),
        "eos_token_id": generation.get("eos_token_id"),
        "torch_dtype": str(dtype).removeprefix("torch."),
        "use_cache": True,
    }
    if model_type in ("llama", "mistral"):
        config["mlp_bias"] = False
    if model_type == "mistral":
        config["sliding_window"] = None
    if model_type in ("qwen2", "qwen3"):
        config["use_sliding_window"] = False
        config["sliding_window"] = None
    if "pad_token_id" in generation:
        config["pad_token_id"] = generation["pad_token_id"]
    return config


def hf_tensor_name(gguf_name: str) -> str:
    """The HF parameter name for a llama.cpp tensor name; ``ValueError`` if it has none."""
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    match = _LAYER_NAME.match(gguf_name)
    if match and match.group(2) in _LAYER_TENSORS:
        return f"model.layers.{match.group(1)}.{_LAYER_TENSORS[match.group(2)]}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no Hugging Face equivalent in a llama/qwen2/qwen3 model")


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
    if config["model_type"] == "qwen3":
        per_layer += ["self_attn.q_norm.weight", "self_attn.k_norm.weight"]
    for i in range(config["num_hidden_layers"]):
        names.update(f"model.layers.{i}.{name}" for name in per_layer)
    return names


def _convert_tensor(tensor: ReaderTensor, config: dict[str, Any], dtype: torch.dtype) -> tuple[str, torch.Tensor]:
    hf_name = hf_tensor_name(tensor.name)
    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    values = dequantize(tensor.data, tensor.tensor_type, shape)
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
    """Convert a llama/qwen2/qwen3 GGUF file into a Hugging Face model directory.

    Writes ``config.json``, safetensors weights in ``dtype`` (sharded above
    ``max_shard_bytes`` when given), ``tokenizer.json``, ``tokenizer_config.json``,
    ``generation_config.json``, and ``extra_json`` (file name -> JSON value, e.g. a
    provenance record) so that they appear together. The directory appears atomically: it is built beside
    ``out_dir`` and renamed into place, replacing an existing one only on success.
    Shows a rich progress bar over tensors when ``progress``. Returns ``out_dir`` as an
    absolute path. Raises ``FileNotFoundError`` / ``ValueError`` for a missing or
    unreadable file, an unsupported architecture, tensor type or tokenizer, or missing
    tensors. Reads the whole file once; peak memory is about the converted model's size.
    """
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating-point torch.dtype, got {dtype!r}")
    reader, metadata = open_gguf(gguf_path)
    names = [tensor.name for tensor in reader.tensors]
    config = hf_config_from_gguf(metadata, names, dtype)
    tokenizer = build_gguf_tokenizer(metadata)
    tokenizer_config = gguf_tokenizer_config(metadata, config["max_position_embeddings"])
    generation_config = gguf_generation_config(metadata)

    tensors: dict[str, torch.Tensor] = {}
    label = f"converting {Path(gguf_path).name}"
    for tensor in _tracked(list(reader.tensors), progress, label):
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
