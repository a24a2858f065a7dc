"""A model's own sampling defaults, from ``generation_config.json``, for what a request leaves unset.

vLLM does this with ``--generation-config auto`` (its default): the file's ``temperature``,
``top_p``, ``top_k``, ``min_p`` and ``repetition_penalty`` replace the neutral defaults
(1.0, 1.0, off, off, 1.0) of a request that does not set them, and ``max_new_tokens``
caps the ``max_tokens`` a request leaves out. What a request sets always wins. The
file's ``eos_token_id`` list is the engines' already (loader.generation_eos_ids): every
id in it ends a request.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

GENERATION_CONFIG = "generation_config.json"


@dataclass(frozen=True, slots=True)
class GenerationDefaults:
    """Defaults for unset sampling fields; None: the neutral default."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    max_tokens: int | None = None  # generation_config's max_new_tokens

    @classmethod
    def from_dict(cls, config: dict) -> GenerationDefaults:
        """The defaults in a generation config; ValueError for a value of the wrong type."""

        def number(key: str, kind: type) -> float | int | None:
            value = config.get(key)
            if value is None:
                return None
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"{GENERATION_CONFIG}: {key} must be a number, got {value!r}")
            return kind(value)

        return cls(
            temperature=number("temperature", float),
            top_p=number("top_p", float),
            top_k=number("top_k", int),
            min_p=number("min_p", float),
            repetition_penalty=number("repetition_penalty", float),
            max_tokens=number("max_new_tokens", int),
        )

    @classmethod
    def from_dir(cls, model_dir: str | Path | None) -> GenerationDefaults:
        """The defaults of the model in ``model_dir`` (none when it has no generation_config.json, or is None).
        Called once, when the gateway starts. ValueError for an unreadable file."""
        if model_dir is None:
            return cls()
        path = Path(model_dir) / GENERATION_CONFIG
        if not path.is_file():
            return cls()
        try:
            config = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"cannot read {path}: {e}") from None
        if not isinstance(config, dict):
            raise ValueError(f"{path} is not a JSON object")
        return cls.from_dict(config)
