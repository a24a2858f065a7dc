"""The bytes of one KV block, worked out from the model by a pool node that starts with it (``python -m kvstore
--model DIR --block-size N --dtype D --engine E``, as the helm chart starts one): what it sizes its slots by.

A pool node stores blocks of one size, and it must be the workers' (their engines compute it again at start, and a
prefill worker refuses a pool node whose size differs). The figure is the one ``mooncake up`` sizes its pool nodes by:
mooncake.serving.model_support.kv_layout, the layout the workers' engine will give the model (ours from config.json,
vLLM's from its own reading of the model), times the block size:

    [layers][2 (K, V)][block_size][kv_heads][head_dim] x dtype bytes

Reading the model imports torch, and for ``--engine vllm`` vLLM, which the pool node never needs again: it is done in
a child interpreter, once, at start (``python -m mooncake.serving.kvsize ENGINE MODEL DTYPE BLOCK_SIZE [KEY=VALUE
...]`` prints the figure), so the node's memory, counted against its pod's limit beside the DRAM tier, stays what it
was with the figure given as ``--block-bytes``.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Sequence


def kv_block_bytes(
    engine: str,
    model: str,
    dtype: str,
    block_size: int,
    vllm_args: Sequence[str] = (),
    timeout_s: float = 600.0,
    kv_cache_dtype: str = "auto",
) -> int:
    """Bytes of one block of ``model`` under ``engine`` (native or vllm; ``vllm_args`` as --vllm-arg KEY=VALUE
    strings) with ``block_size``-token blocks in ``dtype``, worked out in a child interpreter (seconds; for vLLM,
    the seconds of its import). Raises ValueError, one line naming the model, for a model the engine cannot serve or
    whose KV the pool cannot carry, for a missing directory or config.json, and for a child that gave no figure."""
    if block_size < 1:
        raise ValueError(f"block size must be at least 1 token, got {block_size}")
    kept = [f"kv_cache_dtype={kv_cache_dtype}"] if kv_cache_dtype != "auto" else []  # (its own flag in the workers)
    argv = [sys.executable, "-m", __name__, engine, str(model), dtype, str(block_size), *vllm_args, *kept]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise ValueError(f"model {model}: its block bytes took over {timeout_s:.0f} s to work out") from None
    if done.returncode != 0 or not done.stdout.strip().isdigit():
        lines = done.stderr.strip().splitlines() or [f"exit status {done.returncode}"]
        raise ValueError(lines[-1].removeprefix("error: "))
    return int(done.stdout.strip())


def main(argv: Sequence[str] | None = None) -> int:
    """Print the block bytes of ``ENGINE MODEL DTYPE BLOCK_SIZE [KEY=VALUE ...]``; ``error: ...`` and status 2 for a
    model the engine cannot serve."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) < 4 or not args[3].isdigit():
        print("usage: python -m mooncake.serving.kvsize ENGINE MODEL DTYPE BLOCK_SIZE [KEY=VALUE ...]", file=sys.stderr)
        return 2
    engine, model, dtype, block_size, *vllm_args = args
    from mooncake.engine.interface import parse_vllm_args
    from mooncake.serving.model_support import kv_layout

    try:
        given = parse_vllm_args(vllm_args)
        kv = str(given.pop("kv_cache_dtype", "auto"))
        print(kv_layout(engine, model, dtype, given, kv_cache_dtype=kv).block_bytes(int(block_size)))
    except (ValueError, FileNotFoundError) as e:  # FileNotFoundError: a volume not mounted, a download unfinished
        print(f"error: model {model}: {e}" if isinstance(e, FileNotFoundError) else f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
