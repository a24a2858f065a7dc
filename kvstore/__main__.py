"""Run one KV cache pool node: ``python -m kvstore --help``.

Prints one line ``READY {json}`` on stdout (gRPC address, DRAM segment, adopted SSD
blocks) when it serves, and stops cleanly on SIGTERM or Ctrl-C (its shared-memory
segment is removed; SSD blocks stay for the next start to re-adopt).
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from kvstore.config import StoreConfig
from kvstore.metrics import store_registry
from kvstore.service import KVStoreNode, start_server
from mooncake.cliargs import field_arg
from mooncake.runtime.conductor_link import ConductorLink
from mooncake.runtime.process import exit_process, print_ready, wait_for_signal
from mooncake.runtime.status_http import start_status_server
from mooncake.serving.worker_args import add_engine_kind_args
from protos import conductor_pb2 as cpb
from transfer import TransferConfig, TransportChoice, add_transport_args, make_registry
from transfer.metrics import TransferCollector

MIB = 1 << 20


def parser() -> argparse.ArgumentParser:
    """This component's flags (the launcher renders its argv from them: mooncake.cliargs.to_argv)."""
    p = argparse.ArgumentParser(
        prog="python -m kvstore",
        description="A KV cache pool node: a DRAM tier (shared memory, served to peers over shm and tcp), "
        "an optional SSD tier, and the gRPC control service workers and the Conductor talk to.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    field_arg(p, StoreConfig, "node")
    p.add_argument("--host", default="127.0.0.1", help="address the gRPC service and the transfer server bind")
    p.add_argument("--port", type=int, default=0, help="gRPC port (0: any free port, printed in the READY line)")
    p.add_argument(
        "--control-port",
        type=int,
        default=0,
        help="port of the control fast path (the hot calls without gRPC; 0: any free port)",
    )
    p.add_argument("--transfer-port", type=int, default=0, help="transfer (tcp) server port (0: any free port)")
    block = p.add_mutually_exclusive_group(required=True)
    block.add_argument(
        "--block-bytes",
        type=int,
        help="bytes of one block's KV: layers * 2 * block_size * kv_heads * head_dim * dtype bytes",
    )
    block.add_argument(
        "--model",
        help="the workers' model directory: the block bytes their engine gives it, with --block-size, --dtype, "
        "--engine and --vllm-arg as the workers have them (instead of --block-bytes; the helm chart starts pool "
        "nodes this way)",
    )
    p.add_argument("--block-size", type=int, help="with --model: tokens per block, the workers' --block-size")
    p.add_argument(
        "--dtype", choices=["float32", "bfloat16", "float16"], help="with --model: the workers' --dtype (their KV's)"
    )
    p.add_argument(
        "--kv-cache-dtype",
        choices=["auto", "fp8", "fp8_e4m3"],
        default="auto",
        help="with --model: the workers' --kv-cache-dtype (fp8: their blocks in float8, a byte an element)",
    )
    add_engine_kind_args(p, "with --model: the workers' engine (its reading of the model lays out the blocks)")
    size = p.add_mutually_exclusive_group(required=True)
    size.add_argument("--dram-blocks", type=int, help="DRAM tier size in blocks")
    size.add_argument("--dram-mib", type=int, help="DRAM tier size in MiB (rounded down to whole blocks)")
    field_arg(p, StoreConfig, "ssd_dir")
    p.add_argument("--ssd-blocks", type=int, default=0, help="SSD tier size in blocks")
    p.add_argument("--ssd-mib", type=int, default=0, help="SSD tier size in MiB (instead of --ssd-blocks)")
    field_arg(p, StoreConfig, "ssd_fsync")
    field_arg(p, StoreConfig, "eviction")
    field_arg(p, StoreConfig, "high_watermark")
    field_arg(p, StoreConfig, "low_watermark")
    field_arg(p, StoreConfig, "lease_ttl_s", "--lease-ttl")
    field_arg(p, StoreConfig, "reservation_ttl_s", "--reservation-ttl")
    p.add_argument("--redis-url", help="publish the DRAM segment in this Redis (none: an in-process registry)")
    field_arg(p, TransferConfig, "shm_dir", help="tmpfs directory for the DRAM segment")
    add_transport_args(p, "--backend")
    p.add_argument(
        "--conductor",
        help="the Conductor's gRPC address: register this node and heartbeat (its blocks "
        "enter the Conductor's index); none: standalone",
    )
    p.add_argument(
        "--hand-off-s",
        type=float,
        default=10.0,
        help="on SIGTERM, before it stops, have the Conductor get the other pool nodes to copy the chains this node "
        "holds, for up to this many seconds, while it still serves them (0: none; the helm chart's pods stop this "
        "way). `mooncake up` passes 0: it has the Conductor hand a node off before it stops one, and stops them all "
        "at once at the end",
    )
    p.add_argument(
        "--metrics-port", type=int, default=-1, help="/metrics and /health port (0: any free port; -1: none)"
    )
    p.add_argument("--log-level", default="INFO")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return parser().parse_args(argv)


def block_bytes(args: argparse.Namespace) -> int:
    """The block bytes the flags give: --block-bytes, or worked out from --model with the workers' --block-size,
    --dtype, --engine and --vllm-arg (mooncake.serving.kvsize: a child process, seconds). ValueError, one line, for
    a missing companion flag or a model the engine cannot serve (or no model there at all)."""
    if args.block_bytes is not None:
        return args.block_bytes
    if args.block_size is None or args.dtype is None:
        raise ValueError("--model needs --block-size and --dtype: the workers' own (their blocks are the pool's)")
    from mooncake.serving.kvsize import kv_block_bytes

    return kv_block_bytes(
        args.engine, args.model, args.dtype, args.block_size, args.vllm_arg, kv_cache_dtype=args.kv_cache_dtype
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s kvstore[%(process)d] %(message)s")
    try:
        bb = block_bytes(args)
        dram_blocks = args.dram_blocks or (args.dram_mib * MIB) // bb
        ssd_blocks = args.ssd_blocks or (args.ssd_mib * MIB) // bb
        config = StoreConfig(
            node=args.node,
            block_bytes=bb,
            dram_blocks=dram_blocks,
            ssd_dir=args.ssd_dir if ssd_blocks else None,
            ssd_blocks=ssd_blocks if args.ssd_dir else 0,
            ssd_fsync=args.ssd_fsync,
            eviction=args.eviction,
            high_watermark=args.high_watermark,
            low_watermark=args.low_watermark,
            lease_ttl_s=args.lease_ttl,
            reservation_ttl_s=args.reservation_ttl,
        )
        transfer = TransferConfig(
            node=args.node,
            listen_host=args.host,
            port=args.transfer_port,
            shm_dir=args.shm_dir,
            **TransportChoice.from_args(args).model_dump(),
        )
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        node = KVStoreNode(config, transfer, make_registry(args.redis_url))
    except ValueError as e:  # e.g. --backend rdma on a host without an active RDMA port: nothing was started
        print(f"error: {e}", file=sys.stderr)
        return 2
    uds = str(Path(args.shm_dir) / f"{args.node.replace('/', '--')}--control.sock")
    try:
        service = start_server(node, args.host, args.port, control_port=args.control_port, control_uds=uds)
    except (OSError, ValueError) as e:
        node.close()
        print(f"error: {e}", file=sys.stderr)
        return 2
    ready = {
        "grpc": f"{args.host}:{service.grpc_port}",
        "control": f"{args.host}:{service.control.port}",
        "control_uds": uds,
        "node": args.node,
        "segment": node.segment.name,
        "tcp": node.engine.tcp_addr,
        "transport": node.engine.transport,
        "dram_blocks": dram_blocks,
        "ssd_blocks": config.ssd_blocks,
        "adopted_blocks": node.store.adopted,
    }
    status = link = None
    if args.metrics_port >= 0:
        registry = store_registry(node.store)
        registry.register(
            TransferCollector(node.engine)
        )  # what its pulls from other nodes moved, and over which transport
        status = start_status_server(args.host, args.metrics_port, registry, lambda: (True, {"node": args.node}))
        ready["metrics"] = f"{args.host}:{status.server_port}"
    if args.conductor:
        registration = cpb.RegisterRequest(
            id=args.node,
            role=cpb.KVSTORE,
            address=ready["grpc"],
            node=args.node,
            capacity=dram_blocks,
            transport=node.engine.transport,
            block_bytes=bb,  # the Conductor prices transfers by it (never by a configured guess)
        )
        link = ConductorLink(args.conductor, registration, cpb.Load).start()
    print_ready(ready)
    wait_for_signal()
    if link is not None:
        link.close(hand_off_s=args.hand_off_s)  # the node serves its blocks until the copies are made
    if status is not None:
        status.shutdown()
    service.stop(grace=2)
    node.close()
    return 0


if __name__ == "__main__":
    exit_process(main())
