"""``python -m mooncake.gateway``: the OpenAI-compatible HTTP gateway as a process (``mooncake serve gateway``).

With ``--conductor`` it serves the disaggregated cluster (mooncake.gateway.cluster_backend); with
``--local`` it runs one engine in this process instead (prefill and decode coupled: the
baseline shape, no pool, no Conductor). Prints ``READY {json}`` once it listens.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import sys

import uvicorn

from mooncake.cliargs import field_arg
from mooncake.engine.config import EngineConfig
from mooncake.engine.interface import EngineKind, flags_fingerprint, parse_vllm_args
from mooncake.engine.tokenizer import Tokenizer
from mooncake.engine.weights import load_hf_config
from mooncake.gateway.app import GatewayConfig, create_app
from mooncake.gateway.recovery import RecoveryConfig
from mooncake.runtime.process import print_ready
from mooncake.serving.model_support import context_length
from mooncake.serving.worker_args import add_engine_kind_args, default_block_size

LOCAL_KV_BLOCKS = 2048  # --local: the engine's paged cache, in blocks
SWITCH_INTERVAL_S = 0.0005  # a thread holding the GIL hands it over this soon (Python's default: 5 ms)


def parser() -> argparse.ArgumentParser:
    """This component's flags (the launcher renders its argv from them: mooncake.cliargs.to_argv)."""
    p = argparse.ArgumentParser(
        prog="python -m mooncake.gateway",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="The OpenAI-compatible gateway: /v1/chat/completions, /v1/completions, /v1/models, /health, "
        "/metrics. Tokenizes with the model's tokenizer and chat template, computes the block keys once, asks the "
        "Conductor to schedule and streams from the decode worker it picks.",
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--conductor", help="the Conductor's gRPC address (the disaggregated cluster)")
    src.add_argument("--local", action="store_true", help="serve from one engine in this process (coupled; no cluster)")
    p.add_argument("--model", required=True, help="model directory: its tokenizer, chat template and config")
    p.add_argument(
        "--model-name", default=None, help="the name clients send as `model` (default: the directory's name)"
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    auth = p.add_mutually_exclusive_group()
    field_arg(auth, GatewayConfig, "api_key")
    field_arg(auth, GatewayConfig, "tenants_file", "--tenants", metavar="FILE")
    field_arg(p, GatewayConfig, "reasoning_parser")
    field_arg(p, GatewayConfig, "tool_call_parser")
    field_arg(p, EngineConfig, "dtype")
    field_arg(p, EngineConfig, "kv_cache_dtype")
    field_arg(p, EngineConfig, "pool_kv_dtype")
    add_engine_kind_args(
        p, "the workers' engine (part of the block keys: a cluster runs one kind)", "--local --engine vllm"
    )
    field_arg(p, EngineConfig, "block_size", default=None)  # default_block_size(engine) once the engine is known
    field_arg(p, EngineConfig, "max_model_len")
    local = p.add_argument_group("--local", "the engine served in this process")
    field_arg(local, EngineConfig, "num_kv_blocks", default=LOCAL_KV_BLOCKS)
    field_arg(local, EngineConfig, "num_threads", "--threads")
    field_arg(local, EngineConfig, "device")
    field_arg(local, EngineConfig, "max_num_batched_tokens")
    field_arg(local, EngineConfig, "tensor_parallel_size")
    recovery = p.add_argument_group("recovery", "the cluster's: how long a request waits for it (RecoveryConfig)")
    field_arg(recovery, RecoveryConfig, "hold_s")
    field_arg(recovery, RecoveryConfig, "retry_budget_s")
    field_arg(recovery, RecoveryConfig, "detect_s")
    p.add_argument("--log-level", default="INFO")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return parser().parse_args(argv)


def build_backend(args: argparse.Namespace):
    name = args.model_name or args.model.rstrip("/").rsplit("/", 1)[-1]
    args.block_size = args.block_size or default_block_size(args.engine)
    if args.local:
        from mooncake.gateway.local_backend import LocalBackend

        config = EngineConfig(
            model=args.model,
            dtype=args.dtype,
            kv_cache_dtype=args.kv_cache_dtype,
            block_size=args.block_size,
            num_kv_blocks=args.num_kv_blocks,
            max_model_len=args.max_model_len,
            num_threads=args.threads,
            max_num_batched_tokens=args.max_num_batched_tokens,
            device=args.device,
            tensor_parallel_size=args.tensor_parallel_size,
        )
        return LocalBackend(
            config, name, engine=EngineKind(args.engine), vllm_args=parse_vllm_args(args.vllm_arg)
        ), name
    from mooncake.gateway.cluster_backend import ClusterBackend

    # what it needs of the model besides the tokenizer: the context (any architecture: no engine reads it here)
    cfg = load_hf_config(args.model)
    try:
        model_len = context_length(cfg, args.model)
    except ValueError:
        if not args.max_model_len:
            raise
        model_len = args.max_model_len
    max_len = min(args.max_model_len or model_len, model_len)
    fingerprint = flags_fingerprint(
        EngineKind(args.engine), args.model, args.dtype, args.kv_cache_dtype, args.pool_kv_dtype
    )
    recovery = RecoveryConfig(hold_s=args.hold_s, retry_budget_s=args.retry_budget_s, detect_s=args.detect_s)
    return ClusterBackend(args.conductor, name, max_len, args.block_size, fingerprint, recovery=recovery), name


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s gateway[%(process)d] %(message)s")
    try:
        tokenizer = Tokenizer.from_dir(args.model)
        backend, name = build_backend(args)
        app = create_app(
            backend,
            tokenizer,
            GatewayConfig(
                served_model_name=name,
                api_key=args.api_key,
                tenants_file=args.tenants,
                reasoning_parser=args.reasoning_parser,
                tool_call_parser=args.tool_call_parser,
                generation_config=args.model,
            ),
        )
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level.lower(), access_log=False)
    server = uvicorn.Server(config)

    async def serve() -> None:
        task = asyncio.create_task(server.serve())
        while not server.started:
            if task.done():
                await task
                return
            await asyncio.sleep(0.05)
        port = server.servers[0].sockets[0].getsockname()[1]
        gc.freeze()  # what start-up made (tokenizer, app, models) stays out of every full collection: one took 0.3 s
        sys.setswitchinterval(SWITCH_INTERVAL_S)
        print_ready(
            {"http": f"http://{args.host}:{port}", "model": name, "backend": "local" if args.local else "cluster"}
        )
        await task
        await backend.close()

    try:
        asyncio.run(serve())
    except OSError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0 if server.started else 2


if __name__ == "__main__":
    sys.exit(main())
