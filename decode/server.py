"""The decode worker's gRPC service (protos/worker.proto ``Decode``), its metrics, and its process."""

from __future__ import annotations

import argparse
import logging
import sys
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from decode.config import DECODE_ENGINE_DEFAULTS, DecodeConfig
from decode.handoff import Failed
from decode.worker import DecodeWorker
from mooncake.cliargs import field_arg
from mooncake.engine.interface import parse_vllm_args
from mooncake.faults import message
from mooncake.runtime.process import WorkerProcess, run_worker
from mooncake.serving.status import FAILED_INSTANCE_KEY, RETRY_AFTER_KEY, WORKER_STATUS, Busy
from mooncake.serving.worker_args import engine_fields, worker_parser
from protos import conductor_pb2 as cpb
from protos import worker_pb2_grpc as wpb_grpc
from transfer import TransportChoice
from transfer.metrics import TransferCollector

log = logging.getLogger(__name__)


class DecodeMetrics:
    def __init__(self, worker: DecodeWorker) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter("mooncake_decode_requests", "requests by outcome", ["outcome"], registry=r)
        self.rejections = Counter(
            "mooncake_decode_rejections", "requests turned away, by reason", ["reason"], registry=r
        )
        self.ttft = Histogram(
            "mooncake_decode_ttft_seconds",
            "Generate call to first token (prefill included)",
            buckets=(0.01, 0.03, 0.1, 0.3, 1, 3, 10, 30, 100),
            registry=r,
        )
        self.tbt = Histogram(
            "mooncake_decode_tbt_seconds",
            "time between a request's streamed chunks",
            buckets=(0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2),
            registry=r,
        )
        self.kv_bytes = Counter("mooncake_kv_bytes", "KV bytes moved by this worker", ["direction"], registry=r)
        self.cached = Counter(
            "mooncake_decode_cached_prompt_tokens", "prompt tokens whose KV was reused, by tier", ["tier"], registry=r
        )
        Gauge(
            "mooncake_decode_running_requests", "requests in the engine (running or waiting)", registry=r
        ).set_function(lambda: worker.loop.num_running)
        Gauge("mooncake_decode_in_prefill", "requests waiting for their prefill", registry=r).set_function(
            lambda: worker.num_in_prefill
        )
        Gauge("mooncake_decode_batch_cap", "the running batch's current cap", registry=r).set_function(
            lambda: worker.batch_cap
        )
        Gauge("mooncake_decode_landing_free_slots", "free landing slots", registry=r).set_function(
            lambda: worker.slots.num_free
        )
        narrow = Gauge(
            "mooncake_decode_narrow_handoffs",
            "hand-offs the Conductor moved in the pool's narrower dtype, by how they landed: narrow, or full width "
            "where every narrow landing slot was held",
            ["landed"],
            registry=r,
        )
        for landed in ("narrow", "full"):
            narrow.labels(landed).set_function(lambda landed=landed: worker.handoff.narrow_landings[landed])
        Gauge(
            "mooncake_decode_reserved_cache_blocks",
            "engine cache blocks held for prompts a prefill writes in place (and for prefills that may still write)",
            registry=r,
        ).set_function(lambda: worker.engine.num_landing_blocks + worker.fence.quarantined_blocks)
        Gauge(
            "mooncake_decode_quarantined_cache_blocks",
            "engine cache blocks of requests that ended while their prefill may still write them: held until it says "
            "its writes are over or its process is gone (decode/fence.py)",
            registry=r,
        ).set_function(lambda: worker.fence.quarantined_blocks)
        Gauge(
            "mooncake_decode_blocks_written",
            "generated blocks put into the pool (write-behind; written, or there already)",
            registry=r,
        ).set_function(lambda: worker.writer.blocks_written if worker.writer is not None else 0)


class DecodeServicer(wpb_grpc.DecodeServicer):
    def __init__(self, worker: DecodeWorker, metrics: DecodeMetrics) -> None:
        self.worker, self.metrics = worker, metrics

    def Generate(self, request, context):
        m = self.metrics
        start = last = time.perf_counter()
        first = True
        outcome = "cancelled"  # unless the stream ends otherwise: a client that leaves closes this generator
        try:
            for chunk in self.worker.generate(request, context):
                now = time.perf_counter()
                if first:
                    m.ttft.observe(now - start)
                    for tier, n in chunk.cached_tokens_by_tier.items():
                        m.cached.labels(tier).inc(n)
                    m.kv_bytes.labels("landed").inc(
                        -(
                            -(len(request.prompt_token_ids) + len(request.output_token_ids))
                            // self.worker.config.engine_config.block_size
                        )
                        * self.worker.block_bytes
                    )
                    first = False
                else:
                    m.tbt.observe(now - last)
                last = now
                yield chunk
            outcome = "ok" if context.is_active() else "cancelled"
        except Busy as e:
            outcome = "rejected"
            m.rejections.labels(e.reason).inc()
            context.set_trailing_metadata(((RETRY_AFTER_KEY, f"{e.retry_after_s:g}"),))
            context.abort(WORKER_STATUS.code_of(e), f"{e.reason}: {e}")
        except Failed as e:
            outcome = e.code.name.lower()
            if e.failed_instance:
                context.set_trailing_metadata(((FAILED_INSTANCE_KEY, e.failed_instance),))
            context.abort(e.code, str(e))
        except Exception as e:  # what the worker raised: answered with the status table's code; a bug propagates
            code = WORKER_STATUS.code_of(e)
            if code is None:
                raise
            outcome = code.name.lower()
            context.abort(code, message(e))
        finally:
            m.requests.labels(outcome).inc()


def parser() -> argparse.ArgumentParser:
    """This component's flags (the launcher renders its argv from them: mooncake.cliargs.to_argv)."""
    p = worker_parser(
        "python -m decode",
        "A decode worker: reserves blocks of its engine's cache for a prompt's KV (landing "
        "slots for stock vLLM, and for a prefill that cannot reach the cache), has the planned prefill worker "
        "write them, then decodes the request in its continuous batch and streams tokens. Prints READY {json}.",
        "decode-0",
        DECODE_ENGINE_DEFAULTS,
    )
    field_arg(p, DecodeConfig, "landing_slots")
    p.add_argument(
        "--staged-landing",
        action="store_true",
        help="native engine: prompts land in landing slots and are "
        "copied into the cache when they join (the path before prefills wrote the cache in place)",
    )
    field_arg(p, DecodeConfig, "tbt_slo_s", "--tbt-slo")
    field_arg(p, DecodeConfig, "detect_s")
    field_arg(p, DecodeConfig, "shm_dir")
    field_arg(p, DecodeConfig, "drain_timeout_s", "--drain-timeout")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return parser().parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s decode[%(process)d] %(message)s")
    try:
        config = DecodeConfig(
            id=args.id,
            engine=args.engine,
            vllm_args=parse_vllm_args(args.vllm_arg),
            host=args.host,
            engine_config=engine_fields(args),
            landing_slots=args.landing_slots,
            tbt_slo_s=args.tbt_slo,
            detect_s=args.detect_s,
            shm_dir=args.shm_dir,
            transport=TransportChoice.from_args(args),
            direct_landing=not args.staged_landing,
        )
        worker = DecodeWorker(config)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    metrics = DecodeMetrics(worker)
    metrics.registry.register(TransferCollector(worker.transfer))

    def load() -> cpb.Load:
        cap = worker.learn_step_times()
        step = worker.step_mean
        running_blocks, landing_held = worker.kv_held
        return cpb.Load(
            queued_requests=worker.num_in_prefill,
            running_requests=worker.loop.num_running,
            context_tokens=worker.loop.context_tokens,
            free_kv_blocks=worker.engine.num_free_blocks,
            step_s=step.seconds if step is not None else 0.0,
            step_batch=step.batch if step is not None else 0.0,
            step_context_tokens=step.context_tokens if step is not None else 0.0,
            batch_cap=cap,
            landing_blocks=worker.landing_room,
            running_blocks=running_blocks,
            landing_held_blocks=landing_held,
            waiting_requests=worker.num_waiting,
            waiting_s=worker.waiting_s,
        )

    spec = WorkerProcess(
        name="decode",
        add_servicer=lambda server: wpb_grpc.add_DecodeServicer_to_server(DecodeServicer(worker, metrics), server),
        registration=cpb.RegisterRequest(
            id=args.id,
            role=cpb.DECODE,
            node=args.id,
            model=args.model,
            fingerprint=worker.engine.fingerprint,
            engine=args.engine,
            block_bytes=worker.engine.pool_block_bytes,  # a block of the model it loaded, as the pool keeps it
            capacity=args.max_num_seqs,
            transport=worker.transfer.transport,
            step_tokens=worker.step_tokens,
            kv_blocks=worker.kv_blocks,
            kv_shared=worker.kv_shared,
            tensor_parallel_size=config.engine_config.tensor_parallel_size,
            block_size=config.engine_config.block_size,
            kv_dtype=config.engine_config.kv_dtype,
            pool_kv_dtype=config.engine_config.pool_dtype if config.engine_config.pool_kv_dtype != "auto" else "",
        ),
        load=load,
        on_heartbeat=lambda beat: worker.set_batch_cap(beat.batch_cap),
        ready={
            "landing": worker.landing_segment.name,
            "max_model_len": worker.max_model_len,
            "kv_blocks": worker.kv_blocks,  # its cache, as sized (--num-kv-blocks, else from memory)
            "engine": args.engine,
            "transport": worker.transfer.transport,
            "tcp": worker.transfer.tcp_addr,
        },
        health=lambda: (
            not worker.draining,
            {
                "id": args.id,
                "running": worker.loop.num_running,
                "streaming": worker.counts.streaming,
                # which requests, and how many tokens each has generated: an operator (and the chaos tests) can ask
                "streams": worker.counts.stream_tokens(),
            },
        ),
        busy=lambda: worker.loop.num_running + worker.num_in_prefill,
        drain_timeout_s=args.drain_timeout,
        max_rpc_threads=64,
    )
    return run_worker(args, worker, spec, metrics.registry)
