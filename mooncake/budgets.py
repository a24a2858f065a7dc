"""Per-step token budgets when none is given (no torch here: the Conductor reads them too).

On the CPU a step's time grows with its tokens and 512 keeps decode steps beside a prefill chunk short
(benchmarks/README.md). On a GPU a step of a few thousand tokens costs about what 512 do, so a 4,096-token prompt is
one step (benchmarks/gpu_bench.py measures 512 to 8,192).
"""

from __future__ import annotations

CPU_BATCHED_TOKENS = 512
CUDA_BATCHED_TOKENS = 4096


def default_batched_tokens(device: str) -> int:
    """The per-step token budget an engine on ``device`` gets when its configuration names none."""
    return CUDA_BATCHED_TOKENS if device.startswith("cuda") else CPU_BATCHED_TOKENS
