"""The flags the prefill and the decode worker share, and the engine's configuration read from them."""

from __future__ import annotations

import argparse
from typing import Any

from mooncake.cliargs import field_arg
from transfer import add_transport_args


def worker_parser(
    prog: str, description: str, default_id: str, engine_defaults: dict[str, Any]
) -> argparse.ArgumentParser:
    """The flags prefill and decode workers share (the engine's read off EngineConfig, over the worker's
    ``engine_defaults``); each adds its own."""
    from mooncake.engine.config import EngineConfig  # the engine (torch) only where a worker starts

    p = argparse.ArgumentParser(
        prog=prog, description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--id", default=default_id, help="instance id, unique in the cluster")
    p.add_argument("--model", required=True, help="model directory (mooncake model pull prints it)")
    p.add_argument("--conductor", help="the Conductor's gRPC address (register, heartbeat, report); none: standalone")
    p.add_argument("--host", default="127.0.0.1", help="address the gRPC service binds and advertises to the Conductor")
    p.add_argument("--port", type=int, default=0, help="gRPC port (0: any free port)")
    p.add_argument("--metrics-port", type=int, default=0, help="/metrics and /health port (0: any free port)")
    field_arg(p, EngineConfig, "dtype")
    field_arg(p, EngineConfig, "kv_cache_dtype")
    field_arg(p, EngineConfig, "pool_kv_dtype")
    add_engine_kind_args(p)
    field_arg(p, EngineConfig, "block_size", default=None)  # default_block_size(engine) once the engine is known
    field_arg(p, EngineConfig, "num_kv_blocks", default=engine_defaults.get("num_kv_blocks"))
    field_arg(p, EngineConfig, "kv_cache_memory_gib", default=engine_defaults.get("kv_cache_memory_gib", 1.0))
    field_arg(p, EngineConfig, "gpu_memory_utilization")
    field_arg(p, EngineConfig, "max_num_seqs", default=engine_defaults["max_num_seqs"])
    field_arg(p, EngineConfig, "max_model_len")
    field_arg(p, EngineConfig, "max_num_batched_tokens")
    field_arg(p, EngineConfig, "num_threads", "--threads")
    field_arg(p, EngineConfig, "device")
    field_arg(p, EngineConfig, "enforce_eager")
    field_arg(p, EngineConfig, "tensor_parallel_size")
    add_transport_args(p)
    p.add_argument("--log-level", default="INFO")
    return p


def add_engine_kind_args(
    p: argparse.ArgumentParser,
    engine_help: str = "native: our engine; vllm: stock vLLM (v1) hosted in this process, KV through our pool "
    "connector",
    vllm_scope: str = "--engine vllm",
) -> None:
    """``--engine`` and ``--vllm-arg``, as workers and the gateway take them."""
    p.add_argument("--engine", default="native", choices=["native", "vllm"], help=engine_help)
    p.add_argument(
        "--vllm-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help=f"a vLLM EngineArgs keyword for {vllm_scope}, repeatable; values parse as JSON when they can "
        "(tensor_parallel_size=1, gpu_memory_utilization=0.9, enforce_eager=true)",
    )


def engine_fields(args: argparse.Namespace) -> dict[str, Any]:
    """The EngineConfig keywords :func:`worker_parser`'s flags gave, for a worker config's ``engine_config``."""
    return dict(
        model=args.model,
        dtype=args.dtype,
        kv_cache_dtype=args.kv_cache_dtype,
        pool_kv_dtype=args.pool_kv_dtype,
        device=args.device,
        block_size=args.block_size or default_block_size(args.engine),
        num_kv_blocks=args.num_kv_blocks,
        kv_cache_memory_gib=args.kv_cache_memory_gib,
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens,
        num_threads=args.threads,
        enforce_eager=args.enforce_eager,
        tensor_parallel_size=_tensor_parallel_size(args),
    )


def _tensor_parallel_size(args: argparse.Namespace) -> int:
    """--tensor-parallel-size, or for vLLM --vllm-arg tensor_parallel_size where the flag is not given: the size the
    worker runs at and registers."""
    if args.tensor_parallel_size == 1 and getattr(args, "engine", "native") == "vllm":
        from mooncake.engine.interface import parse_vllm_args

        return int(parse_vllm_args(getattr(args, "vllm_arg", None) or []).get("tensor_parallel_size", 1))
    return args.tensor_parallel_size


def default_block_size(engine: str) -> int:
    """The block size a component uses when none is given: 16 for ours, 32 for vLLM (its CPU attention needs a multiple
    of 32)."""
    return 32 if engine == "vllm" else 16
