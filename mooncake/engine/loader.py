"""Build a ready-to-run CausalLM from a model directory, and fingerprint that directory."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import xxhash

from mooncake.engine.model import CausalLM
from mooncake.engine.model_args import ModelArgs
from mooncake.engine.weights import load_hf_config, load_hf_weights, read_json_object

_SAMPLE = 1 << 20  # bytes hashed from each end and the middle of a weight file


def model_identity(model_dir: str | Path, dtype: torch.dtype) -> str:
    """A content-derived identity string for block keys (mooncake.blocks.model_fingerprint).

    Equal on every node that holds the same files, whatever their paths or mtimes:
    config.json, the dtype the KV is computed in, and for each weight file its name,
    size, and an xxh3 of its first, middle and last MiB (the safetensors header, which
    names every tensor with its offsets, is in the first). Reads ~3 MiB per file.
    """
    root = Path(model_dir)
    h = xxhash.xxh3_128()
    h.update(json.dumps(load_hf_config(root), sort_keys=True).encode())
    h.update(str(dtype).encode())
    for f in sorted(root.glob("*.safetensors")):
        size = f.stat().st_size
        h.update(f"{f.name}:{size}".encode())
        with f.open("rb") as fh:
            for off in (0, max(0, size // 2 - _SAMPLE // 2), max(0, size - _SAMPLE)):
                fh.seek(off)
                h.update(fh.read(_SAMPLE))
    return h.hexdigest()


def load_model(
    model_dir: str | Path, dtype: torch.dtype, device: torch.device, layers: range | None = None
) -> CausalLM:
    """Read config and weights, build the model (or, with ``layers``, one pipeline stage of it: only those layers'
    weights are read) in ``dtype`` on ``device``, eval mode.

    Raises FileNotFoundError / ValueError (from weights.py and ModelArgs) for a missing
    directory, an unsupported architecture, or weights that do not fit it.
    """
    args = ModelArgs.from_hf_config(load_hf_config(model_dir))
    with torch.device("meta"):
        model = CausalLM(args, layers)
    model = model.to_empty(device=device).to(dtype)
    model.load_hf_state_dict(load_hf_weights(model_dir, dtype=dtype, device=str(device), only=model.owns))
    return model.eval()


def generation_eos_ids(model_dir: str | Path) -> frozenset[int]:
    """EOS ids from generation_config.json (some models list extra stop ids only there)."""
    eos = read_json_object(Path(model_dir) / "generation_config.json").get("eos_token_id")
    if eos is None:
        return frozenset()
    return frozenset(int(t) for t in (eos if isinstance(eos, list) else [eos]))
