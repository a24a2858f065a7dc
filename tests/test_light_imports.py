"""The processes that run no model start without torch: the gateway (in front of a cluster), the launcher behind
`mooncake up`, the Conductor, a pool node, and the operator CLI (`mooncake status`, `plan`, `pool ...`).

torch is about 2 s of CPU and 300 MB to import here: a gateway pod, or an operator's `mooncake status`, that
imported it would start that much slower for nothing. Each is imported in a fresh interpreter, as its process does.
"""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.parametrize(
    "module",
    [
        "mooncake.gateway.__main__",
        "mooncake.cli.main",
        "mooncake.cluster.launcher",
        "conductor.__main__",
        "kvstore.__main__",
    ],
)
def test_a_process_that_runs_no_model_does_not_import_torch(module):
    code = f"import sys, {module}; print(sorted(m for m in ('torch', 'vllm', 'transformers') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", f"{module} imports {out.stdout.strip()}"


def test_the_cli_still_makes_a_tiny_model_when_asked(tmp_path):
    """What it no longer imports up front is imported by the command that needs it."""
    out = subprocess.run(
        [sys.executable, "-m", "mooncake.cli.main", "model", "make-tiny", str(tmp_path / "m"), "--arch", "qwen3"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "m" / "model.safetensors").stat().st_size > 0


@pytest.mark.parametrize("kind", ["native", "vllm"])
def test_the_gateways_block_keys_from_a_dtype_name_are_the_workers_from_the_torch_dtype(tiny_dir, kind):
    """The gateway names the dtype; the workers hold torch's: both must key a block alike, or nothing is a hit."""
    import torch

    from mooncake.engine.interface import EngineKind, engine_fingerprint

    for name in ("float32", "bfloat16", "float16"):
        by_name = engine_fingerprint(EngineKind(kind), str(tiny_dir), name)
        assert by_name == engine_fingerprint(EngineKind(kind), str(tiny_dir), getattr(torch, name))
    assert engine_fingerprint(EngineKind(kind), str(tiny_dir), "float32") != by_name  # the dtype is in the key
