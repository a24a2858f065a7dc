"""Reading and writing model checkpoints in the Hugging Face directory layout.

This module owns the on-disk contract between the model-management layer and the
inference engine. A model is a directory::

    model_dir/
      config.json                       HF config (architectures, model_type, sizes, ...)
      model.safetensors                 all tensors, HF names
        or model-00001-of-0000N.safetensors ... + model.safetensors.index.json
      tokenizer.json                    `tokenizers` serialisation
      tokenizer_config.json             bos/eos tokens, add_bos_token, chat_template
      generation_config.json            bos/eos ids used when generating

Reading is strict: a missing directory, a directory that is not a model, or a
truncated / corrupt safetensors file raises ``FileNotFoundError`` or ``ValueError``
naming the path and what is wrong, never a raw library exception.

Writing is atomic: :func:`atomic_model_dir` builds the model in a temporary directory
beside the target and renames it into place only when every file is complete, so a
crash never leaves a half-written model that a later load would trust.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import xxhash
from safetensors import SafetensorError, safe_open

if TYPE_CHECKING:  # imported where tensors are read or written: the gateway and the CLI read this module
    import torch

CONFIG_FILE = "config.json"
SINGLE_WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX_FILE = "model.safetensors.index.json"
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
GENERATION_CONFIG_FILE = "generation_config.json"

DEFAULT_MAX_SHARD_BYTES = 4 * 1024**3


def _require_model_dir(model_dir: str | os.PathLike[str]) -> Path:
    path = Path(model_dir)
    if not path.exists():
        raise FileNotFoundError(f"model directory {str(path)!r} does not exist")
    if not path.is_dir():
        raise ValueError(f"{str(path)!r} is not a directory; a model is a Hugging Face layout directory")
    return path


def load_hf_config(model_dir: str | os.PathLike[str]) -> dict:
    """Read ``config.json`` from a Hugging Face model directory.

    Returns the parsed JSON object as a dict (keys as written by the checkpoint).
    Raises ``FileNotFoundError`` if the directory or its ``config.json`` is missing and
    ``ValueError`` if the file is not a JSON object. Called once per model load.
    """
    path = _require_model_dir(model_dir)
    config_path = path / CONFIG_FILE
    if not config_path.is_file():
        raise FileNotFoundError(
            f"{str(path)!r} is not a model directory: {CONFIG_FILE} is missing "
            f"(expected a Hugging Face layout with {CONFIG_FILE} and {SINGLE_WEIGHTS_FILE})"
        )
    return read_json_object(config_path)


def read_json_object(path: Path) -> dict:
    """Parse a JSON file that must hold an object; ``{}`` if the file does not exist.

    Raises ``ValueError`` naming the file when it is not valid JSON or not an object.
    """
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{str(path)!r} is not valid JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise ValueError(f"{str(path)!r} must hold a JSON object, got {type(value).__name__}")
    return value


def weight_files(model_dir: str | os.PathLike[str]) -> list[Path]:
    """The safetensors files of a model directory, in load order.

    A single ``model.safetensors`` wins; otherwise the shards listed by
    ``model.safetensors.index.json``. Raises ``FileNotFoundError`` naming what is missing.
    """
    path = _require_model_dir(model_dir)
    single = path / SINGLE_WEIGHTS_FILE
    if single.is_file():
        return [single]
    index_path = path / WEIGHTS_INDEX_FILE
    if not index_path.is_file():
        raise FileNotFoundError(
            f"{str(path)!r} has no weights: neither {SINGLE_WEIGHTS_FILE} nor {WEIGHTS_INDEX_FILE} exists"
        )
    try:
        index = json.loads(index_path.read_text(encoding="utf-8"))
        shard_names = sorted(set(index["weight_map"].values()))
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"{str(index_path)!r} is not a valid safetensors index: {exc}") from exc
    shards = [path / name for name in shard_names]
    missing = [str(shard) for shard in shards if not shard.is_file()]
    if missing:
        raise FileNotFoundError(f"shards listed in {str(index_path)!r} are missing: {missing}")
    return shards


def _check_safetensors_size(file: Path) -> None:
    """Reject a truncated file before safetensors maps it.

    safetensors validates the header against the file size, but reports it with its
    own exception type; checking here lets us name the file and the shortfall.
    """
    size = file.stat().st_size
    if size < 8:
        raise ValueError(f"safetensors file {str(file)!r} is truncated: {size} bytes, shorter than its header")
    with file.open("rb") as handle:
        header_len = int.from_bytes(handle.read(8), "little")
        if header_len > size - 8:
            raise ValueError(
                f"safetensors file {str(file)!r} is truncated or corrupt: header claims {header_len} bytes, "
                f"file has {size - 8} after the length prefix"
            )
        try:
            header = json.loads(handle.read(header_len))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"safetensors file {str(file)!r} has a corrupt header: {exc}") from exc
    if not isinstance(header, dict):
        raise ValueError(f"safetensors file {str(file)!r} has a corrupt header (not a JSON object)")
    try:
        data_len = max(
            (int(info["data_offsets"][1]) for key, info in header.items() if key != "__metadata__"),
            default=0,
        )
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        raise ValueError(f"safetensors file {str(file)!r} has a corrupt header: bad entry ({exc!r})") from exc
    if 8 + header_len + data_len > size:
        raise ValueError(
            f"safetensors file {str(file)!r} is truncated: tensors need {data_len} data bytes, "
            f"file holds {size - 8 - header_len}"
        )


def load_hf_weights(
    model_dir: str | os.PathLike[str],
    dtype: torch.dtype,
    device: str | torch.device = "cpu",
    only: Callable[[str], bool] | None = None,
) -> dict[str, torch.Tensor]:
    """Load every tensor of a Hugging Face model directory (with ``only``, those whose name it accepts: a pipeline
    stage reads only its own layers).

    Handles a single ``model.safetensors`` or an index plus shards. Each tensor is
    converted to ``dtype`` and placed on ``device``; names are the checkpoint's HF names.
    Raises ``FileNotFoundError`` for a missing directory or weight file and ``ValueError``
    naming the file for a truncated or corrupt safetensors file, or for a name that
    appears in two shards. Called once per model load.
    """
    import torch

    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"dtype must be a torch.dtype, got {dtype!r}")
    tensors: dict[str, torch.Tensor] = {}
    for file in weight_files(model_dir):
        _check_safetensors_size(file)
        try:
            with safe_open(str(file), framework="pt", device="cpu") as reader:
                for name in reader.keys():
                    if only is not None and not only(name):
                        continue
                    if name in tensors:
                        raise ValueError(f"tensor {name!r} appears twice (again in {str(file)!r})")
                    tensors[name] = reader.get_tensor(name).to(device=device, dtype=dtype)
        except SafetensorError as exc:
            raise ValueError(f"safetensors file {str(file)!r} is corrupt: {exc}") from exc
    return tensors


def count_parameters(model_dir: str | os.PathLike[str]) -> int:
    """Number of parameters stored in a model directory, read from the safetensors headers only."""
    total = 0
    for file in weight_files(model_dir):
        _check_safetensors_size(file)
        try:
            with safe_open(str(file), framework="pt", device="cpu") as reader:
                for name in reader.keys():
                    numel = 1
                    for dim in reader.get_slice(name).get_shape():
                        numel *= int(dim)
                    total += numel
        except SafetensorError as exc:
            raise ValueError(f"safetensors file {str(file)!r} is corrupt: {exc}") from exc
    return total


def write_json(path: Path, value: object) -> None:
    """Write ``value`` as indented, key-stable JSON (UTF-8, trailing newline)."""
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def save_hf_weights(
    out_dir: str | os.PathLike[str],
    tensors: Mapping[str, torch.Tensor],
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> list[Path]:
    """Write ``tensors`` as safetensors in HF layout, sharding above ``max_shard_bytes``.

    One file ``model.safetensors`` when everything fits; otherwise
    ``model-0000i-of-0000N.safetensors`` plus ``model.safetensors.index.json``. Tensors keep
    their insertion order within shards. Returns the files written.
    """
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    path = Path(out_dir)
    shards: list[dict[str, torch.Tensor]] = [{}]
    shard_bytes = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and shard_bytes + nbytes > max_shard_bytes:
            shards.append({})
            shard_bytes = 0
        shards[-1][name] = tensor.detach().contiguous().cpu()
        shard_bytes += nbytes
    from safetensors.torch import save_file

    metadata = {"format": "pt"}
    if len(shards) == 1:
        file = path / SINGLE_WEIGHTS_FILE
        save_file(shards[0], str(file), metadata=metadata)
        return [file]
    files: list[Path] = []
    weight_map: dict[str, str] = {}
    total = 0
    for i, shard in enumerate(shards, start=1):
        file = path / f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(file), metadata=metadata)
        files.append(file)
        for name, tensor in shard.items():
            weight_map[name] = file.name
            total += tensor.numel() * tensor.element_size()
    write_json(path / WEIGHTS_INDEX_FILE, {"metadata": {"total_size": total}, "weight_map": weight_map})
    return files


@contextlib.contextmanager
def atomic_model_dir(out_dir: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a fresh temporary directory that becomes ``out_dir`` on success.

    The temporary directory is created beside ``out_dir`` (same filesystem, so the final
    rename is atomic). On an exception it is removed and ``out_dir`` is untouched. An
    existing ``out_dir`` is replaced only after the new one is complete. Raises
    ``ValueError`` if ``out_dir`` exists and is a file.
    """
    target = Path(out_dir).expanduser().absolute()
    if target.exists() and not target.is_dir():
        raise ValueError(f"output path {str(target)!r} exists and is not a directory")
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        yield staging
        # mkdtemp makes the directory private and some writers make files 0600; a model
        # cache is meant to be shared like any installed data.
        os.chmod(staging, 0o755)
        for file in staging.rglob("*"):
            if file.is_file():
                os.chmod(file, 0o644)
        if target.exists():
            # Move the old one aside first: rename() cannot replace a non-empty directory.
            retired = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
            os.rename(target, retired / "model")
            os.rename(staging, target)
            shutil.rmtree(retired, ignore_errors=True)
        else:
            os.rename(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


_SAMPLE = 1 << 20  # bytes hashed from each end and the middle of a weight file


def model_identity(
    model_dir: str | Path,
    dtype: str | torch.dtype,
    kv_dtype: str | torch.dtype | None = None,
    pool_dtype: str | torch.dtype | None = None,
) -> str:
    """A content-derived identity string for block keys (mooncake.blocks.model_fingerprint).

    Equal on every node that holds the same files, whatever their paths or mtimes:
    config.json, the dtype the KV is computed in, the dtype it is kept in where that differs (``kv_dtype``: an FP8
    cache's blocks are other bytes, never mixed with the model dtype's), the dtype the pool keeps them in where that
    differs again (``pool_dtype``: converted at scale 1.0, apart from an FP8 cache's scaled blocks), and for each
    weight file its name,
    size, and an xxh3 of its first, middle and last MiB (the safetensors header, which
    names every tensor with its offsets, is in the first). Reads ~3 MiB per file. ``dtype``, ``kv_dtype``: torch
    dtypes or their names (mooncake.engine.config.DTYPE_NAMES, FP8_KV), the same identity either way.
    """
    root = Path(model_dir)
    h = xxhash.xxh3_128()
    h.update(json.dumps(load_hf_config(root), sort_keys=True).encode())
    named = [(f"torch.{d}" if isinstance(d, str) else str(d)) for d in (dtype, kv_dtype or dtype, pool_dtype)]
    h.update(named[0].encode())  # (names: torch-free too)
    if named[1] != named[0]:
        h.update(f"kv:{named[1]}".encode())
    if pool_dtype is not None and named[2] != named[1]:  # a pool narrower than the cache: its own blocks (scale 1.0)
        h.update(f"pool:{named[2]}".encode())
    for f in sorted(root.glob("*.safetensors")):
        size = f.stat().st_size
        h.update(f"{f.name}:{size}".encode())
        with f.open("rb") as fh:
            for off in (0, max(0, size // 2 - _SAMPLE // 2), max(0, size - _SAMPLE)):
                fh.seek(off)
                h.update(fh.read(_SAMPLE))
    return h.hexdigest()
