"""Models named by a Hugging Face hub id (``org/name``), through ``huggingface_hub``'s cache.

A hub id resolves to a snapshot directory of the hub cache (``HF_HUB_CACHE``, by
default ``~/.cache/huggingface/hub``)::

    models--org--name/
      refs/main                 the commit hash "main" points at
      snapshots/<commit>/       config.json, tokenizer.json, *.safetensors, ...
      blobs/                    the files' contents (snapshots hold links to them)

The cache is looked at first, without network; a model missing from it is downloaded
(only the files serving needs: config, tokenizer, generation config, safetensors
weights) unless ``download`` is off or ``huggingface_hub`` is in offline mode
(``HF_HUB_OFFLINE=1``, which huggingface_hub itself reads). Every failure is one
``ValueError`` line naming the id.
"""

from __future__ import annotations

import re
from pathlib import Path

# What a served model needs from a repository; weights only as safetensors (no pickles).
SERVING_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
    "*.safetensors",
    "*.safetensors.index.json",
)

_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")


def is_hub_id(name: str) -> bool:
    """Whether ``name`` has the shape of a hub model id, ``org/name`` (no path may exist by that name)."""
    return bool(_HUB_ID.match(name)) and ".." not in name


def hub_snapshot(
    repo_id: str, *, download: bool = True, hub_cache: str | Path | None = None, revision: str | None = None
) -> Path:
    """The local snapshot directory of hub model ``repo_id``, downloading it if allowed and needed.

    Looks in ``hub_cache`` (None: huggingface_hub's own, ``HF_HUB_CACHE``) without
    network first. If the model is not there and ``download`` is on, downloads
    :data:`SERVING_FILES` with ``snapshot_download`` (which honours ``HF_HUB_OFFLINE``).
    Returns the snapshot path. Raises ``ValueError`` (one line naming ``repo_id``) for
    an id that is not ``org/name``, a model neither cached nor downloadable, or a
    snapshot without ``config.json``. Called once per process start.
    """
    if not is_hub_id(repo_id):
        raise ValueError(f"{repo_id!r} is not a Hugging Face hub id (org/name)")
    from huggingface_hub import snapshot_download  # imported here: only hub ids need it

    kwargs = {"repo_id": repo_id, "revision": revision, "cache_dir": hub_cache, "allow_patterns": list(SERVING_FILES)}
    try:
        path = Path(snapshot_download(local_files_only=True, **kwargs))
    except Exception as cached_error:  # LocalEntryNotFoundError, IncompleteSnapshotError, ...
        if not download:
            raise ValueError(
                f"hub model {repo_id!r} is not in the Hugging Face cache ({_cache_name(hub_cache)}); "
                f"run `mooncake model pull {repo_id}` where the hub is reachable"
            ) from cached_error
        try:
            path = Path(snapshot_download(**kwargs))
        except Exception as error:  # offline, unreachable, not found, gated: all end the same way for a user
            raise ValueError(
                f"hub model {repo_id!r} is not in the Hugging Face cache ({_cache_name(hub_cache)}) and could not be "
                f"downloaded: {_one_line(error)}"
            ) from error
    if not (path / "config.json").is_file():
        raise ValueError(f"hub model {repo_id!r} (snapshot {path}) has no config.json; it is not a transformers model")
    return path


def _cache_name(hub_cache: str | Path | None) -> str:
    if hub_cache is not None:
        return str(hub_cache)
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)


def _one_line(error: BaseException) -> str:
    text = " ".join(str(error).split()) or type(error).__name__
    return f"{type(error).__name__}: {text[:300]}"
