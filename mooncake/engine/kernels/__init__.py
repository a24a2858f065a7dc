"""Optional compiled CPU kernels, built once per machine with torch's C++ extension loader.

``load_paged_decode(build_dir)`` returns the compiled decode-attention function, or None
when it cannot be built (no compiler, no ninja): callers then fall back to the pure-torch
path in attention.py, which gives the same results, only slower. The build (~1 minute on
2 cores) is cached in ``build_dir`` keyed by the source's hash, the CPU's flags and the
Python environment (torch's loader rebuilds when its include paths change, so two virtual
environments sharing one directory would rebuild each other's kernel forever).

Processes that start together (a cluster's workers) build it once: an ``flock`` (freed by
the kernel if its holder dies) serialises the loads, and under it a ``lock`` file that
torch's loader left behind (its builder was killed mid-build) is removed, since no live
builder can hold it; torch would otherwise wait on it forever.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import logging
import platform
import sys
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("paged_attention.cpp")
_loaded: dict[Path, Callable | None] = {}


def _cpu_flags() -> list[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    return [f"-m{f}" for f in ("avx2", "fma", "f16c") if f in flags]


def load_paged_decode(build_dir: str | Path) -> Callable | None:
    """Compile (or reuse) the paged decode-attention kernel; None if unavailable."""
    build_dir = Path(build_dir).expanduser()
    if build_dir in _loaded:
        return _loaded[build_dir]
    fn = None
    try:
        from torch.utils import cpp_extension

        flags = ["-O3", "-fopenmp-simd", *_cpu_flags()]
        key = hashlib.sha256(
            _SOURCE.read_bytes() + " ".join(flags).encode() + platform.machine().encode() + sys.prefix.encode()
        )
        name = f"mooncake_paged_attn_{key.hexdigest()[:12]}"
        target = build_dir / name
        target.mkdir(parents=True, exist_ok=True)
        log.info("loading the paged attention kernel (first build takes about a minute): %s", target)
        with open(target / "mooncake.flock", "w") as guard:
            fcntl.flock(guard, fcntl.LOCK_EX)  # one loader at a time; released when this process ends, however
            (target / "lock").unlink(missing_ok=True)  # torch's, left by a builder that died: no live one holds it
            mod = cpp_extension.load(
                name=name, sources=[str(_SOURCE)], extra_cflags=flags, build_directory=str(target), verbose=False
            )
        compiled = mod.paged_decode_attention
        import torch

        none = torch.empty(0)

        def fn(q, k_cache, v_cache, block_table, ctx_lens, scale, window=0, softcap=0.0, k_scale=None, v_scale=None):
            # it reads q densely; an FP8 cache (its scales given) as bytes, through each scale's table
            if k_scale is None:
                return compiled(
                    q.contiguous(), k_cache, v_cache, block_table, ctx_lens, scale, window, softcap, none, none
                )
            k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
            k_lut, v_lut = fp8_table(k_scale), fp8_table(v_scale)
            return compiled(
                q.contiguous(), k_cache, v_cache, block_table, ctx_lens, scale, window, softcap, k_lut, v_lut
            )
    except Exception as e:  # noqa: BLE001 - any build failure means "use the torch path"
        log.warning("paged attention kernel unavailable, using the torch path: %s", e)
    _loaded[build_dir] = fn
    return fn


@functools.cache
def fp8_table(scale: float):
    """Each float8 e4m3 byte's value times ``scale``, in float32 (torch's own conversion: the torch path's values)."""
    import torch

    return torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float() * scale


def load_triton_attention() -> tuple[Callable | None, Callable | None]:
    """The Triton attention of CUDA engines: (triton_decode.paged_decode, for decode-only steps and their graphs;
    triton_varlen.paged_varlen, for a whole step with prompt chunks); (None, None) without Triton."""
    try:
        from mooncake.engine.kernels.triton_decode import paged_decode
        from mooncake.engine.kernels.triton_varlen import paged_varlen
    except ImportError as e:
        log.warning("Triton is not installed, attention on CUDA uses the torch paths: %s", e)
        return None, None
    return paged_decode, paged_varlen
