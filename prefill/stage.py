"""A stage server of a pipelined prefill group: one contiguous range of a model's layers on this node.

    python -m prefill.stage --model DIR --stage I --stages X --chunk N --host ADDR --port P --key-file F

The group's prefill worker (``python -m prefill --pipeline-stages X --stage-addresses
A0,A1,..``) dials every stage server with the group's key (a shared secret: the same file
on each node, or ``MOONCAKE_STAGE_KEY``), tells each where the next stage is, and drives
prefills through them (prefill/stage_process.py). The server keeps its layers,
cache and inbox across sessions: when the worker goes away, or a prefill fails here, it
waits for the worker to dial again. Prints ``READY {json}`` once its layers are loaded.
Computes with one thread.
"""

from __future__ import annotations

import argparse
import logging
import os
import queue
import signal
import sys
import threading
from multiprocessing.connection import AuthenticationError, Listener
from pathlib import Path

from mooncake.cliargs import field_arg
from mooncake.engine.config import EngineConfig, dtype_of
from mooncake.engine.loader import load_hf_config
from mooncake.engine.model_args import ModelArgs
from mooncake.engine.stage import split_layers
from mooncake.runtime.process import print_ready
from prefill.stage_process import StageRuntime, StageSpec
from transfer import TransferConfig

log = logging.getLogger(__name__)


def read_key(path: str | None) -> bytes:
    """The group's key: the file's bytes, else $MOONCAKE_STAGE_KEY. ValueError when neither gives one."""
    key = Path(path).read_bytes().strip() if path else os.environ.get("MOONCAKE_STAGE_KEY", "").encode()
    if len(key) < 16:
        raise ValueError("the group's key (--key-file, or $MOONCAKE_STAGE_KEY) must be at least 16 bytes")
    return key


def parser() -> argparse.ArgumentParser:
    """This component's flags (the launcher renders its argv from them: mooncake.cliargs.to_argv)."""
    p = argparse.ArgumentParser(prog="python -m prefill.stage", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="model directory")
    p.add_argument("--stage", type=int, required=True, help="this stage's place, 0-based")
    p.add_argument("--stages", type=int, required=True, help="stages in the group (the layers are split evenly)")
    p.add_argument(
        "--host", default="127.0.0.1", help="address to bind and advertise (the worker and the previous stage dial it)"
    )
    p.add_argument("--port", type=int, default=0, help="the port the group's worker dials (0: any free port)")
    p.add_argument("--key-file", help="file holding the group's key (default: $MOONCAKE_STAGE_KEY)")
    field_arg(p, EngineConfig, "dtype")
    field_arg(p, EngineConfig, "device")
    field_arg(p, EngineConfig, "block_size")
    field_arg(p, EngineConfig, "num_kv_blocks", default=1024, help="this stage's cache, in blocks")
    field_arg(p, EngineConfig, "max_model_len")
    p.add_argument("--chunk", type=int, required=True, help="the group's chunk (its worker's --max-num-batched-tokens)")
    field_arg(p, TransferConfig, "shm_dir")
    p.add_argument("--log-level", default="INFO")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return parser().parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s stage[%(process)d] %(message)s")
    try:
        key = read_key(args.key_file)
        model = ModelArgs.from_hf_config(load_hf_config(args.model))
        if not 0 <= args.stage < args.stages:
            raise ValueError(f"--stage {args.stage} is not one of the {args.stages} stages")
        layers = split_layers(model.num_layers, args.stages)[args.stage]
        max_len = min(args.max_model_len or model.max_position_embeddings, model.max_position_embeddings)
        spec = StageSpec(
            args.model,
            layers,
            num_blocks=args.num_kv_blocks,
            block_size=args.block_size,
            max_model_len=max_len,
            max_chunk=args.chunk,
            shm_dir=args.shm_dir,
            dtype=dtype_of(args.dtype),
            device=args.device,
            host=args.host,
        )
        runtime = StageRuntime(spec, key)
        listener = Listener((args.host, args.port), authkey=key)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    sessions: queue.Queue = queue.Queue()
    threading.Thread(target=_accept, args=(listener, sessions), name="stage-accept", daemon=True).start()
    print_ready(
        {
            "stage": args.stage,
            "stages": args.stages,
            "layers": [layers.start, layers.stop],
            "address": f"{args.host}:{listener.address[1]}",
        }
    )
    try:
        while True:
            driver = sessions.get()
            log.info("session with the group's worker started")
            runtime.session(driver, (args.stage, args.stages))
            driver.close()
            log.info("session ended: waiting for the worker to dial again")
    finally:
        listener.close()
        runtime.close()


def _accept(listener: Listener, sessions: queue.Queue) -> None:
    """Authenticate every connection as it comes (a session in progress does not hold a stranger's handshake up), and
    queue the worker's: its sessions are served one after the other."""
    while True:
        try:
            sessions.put(listener.accept())
        except AuthenticationError:
            log.warning("a connection without the group's key was refused")
        except (OSError, EOFError) as e:  # a peer that hung up mid-handshake; or the listener closed
            if listener._listener is None:  # noqa: SLF001 - closed: the server is stopping
                return
            log.warning("a connection failed its handshake: %r", e)


if __name__ == "__main__":
    sys.exit(main())
