"""The prefill worker's gRPC service (protos/worker.proto ``Prefill``), its metrics, and its process."""

from __future__ import annotations

import argparse
import logging
import sys
import threading
import time

import grpc
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily

from conductor.types import PREFILL_BUSY_BEAT_S
from kvstore.client import KVStoreUnavailable
from mooncake.cliargs import field_arg
from mooncake.engine.interface import parse_vllm_args
from mooncake.faults import message
from mooncake.runtime.process import WRITER_METADATA, WorkerProcess, process_identity, run_worker, when_gone
from mooncake.serving import reports
from mooncake.serving.status import WORKER_STATUS
from mooncake.serving.worker_args import engine_fields, worker_parser
from prefill.config import PREFILL_ENGINE_DEFAULTS, PrefillConfig
from prefill.stage import read_key
from prefill.worker import PrefillWorker
from protos import conductor_pb2 as cpb
from protos import worker_pb2 as wpb
from protos import worker_pb2_grpc as wpb_grpc
from transfer import TransportChoice
from transfer.metrics import TransferCollector

log = logging.getLogger(__name__)

ABORT_WAIT_S = 2.0  # longest an Abort waits for its call's writes to end (then the caller keeps its blocks a while)
ABORTED_KEPT_S = 60.0  # how long a call aborted before it arrived is remembered (and refused, should it come)

OUTCOME = {
    grpc.StatusCode.INVALID_ARGUMENT: "invalid",
    grpc.StatusCode.CANCELLED: "cancelled",
    grpc.StatusCode.UNAVAILABLE: "failed",
    grpc.StatusCode.FAILED_PRECONDITION: "unreachable",
}


class PrefillMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter("mooncake_prefill_requests", "prefills by outcome", ["outcome"], registry=r)
        self.seconds = Histogram(
            "mooncake_prefill_seconds",
            "engine time of a prefill (first step to first token)",
            buckets=(0.01, 0.03, 0.1, 0.3, 1, 3, 10, 30, 100),
            registry=r,
        )
        self.queue = Histogram(
            "mooncake_prefill_queue_seconds",
            "time a prefill waited for the engine",
            buckets=(0.001, 0.01, 0.1, 0.3, 1, 3, 10, 30),
            registry=r,
        )
        self.tokens = Counter(
            "mooncake_prefill_prompt_tokens", "prompt tokens by where their KV came from", ["source"], registry=r
        )
        self.kv_bytes = Counter("mooncake_kv_bytes", "KV bytes moved by this worker", ["direction"], registry=r)
        self.handoff = Counter(
            "mooncake_prefill_handoff_bytes",
            "prompt KV bytes handed to decode workers, by path: "
            "slots (landing slots, copied again when the request joins), cache (written into the "
            "decode engine's cache through its segment), cuda_ipc (device copies into it)",
            ["path"],
            registry=r,
        )
        self.inflight = Gauge("mooncake_prefill_inflight", "prefills in this worker (queued or running)", registry=r)
        self.ahead = Counter(
            "mooncake_prefill_ahead",
            "prefills taken before those waiting in the engine: requests placed again after a failure",
            registry=r,
        )


class PushRetries:
    """``mooncake_prefill_push_retries_total``: pushes of this worker's engine sent again after a transfer fault
    (prefill/connector.py ``PUSH_ATTEMPTS``); a pipelined group's stages count their own."""

    def __init__(self, connector) -> None:
        self._connector = connector

    def collect(self):
        yield CounterMetricFamily(
            "mooncake_prefill_push_retries",
            "KV pushes to decode workers and the pool sent again after a transfer fault",
            value=self._connector.push_retries,
        )


class PrefillServicer(wpb_grpc.PrefillServicer):
    def __init__(self, worker: PrefillWorker, metrics: PrefillMetrics) -> None:
        self.worker, self.metrics = worker, metrics
        self._calls: dict[str, tuple[threading.Event, threading.Event]] = {}  # landing token -> (cancel it, it ended)
        self._aborted: dict[str, float] = {}  # tokens of calls aborted before they arrived -> when
        self._lock = threading.Lock()
        self.identity = process_identity()

    def Prefill(self, request, context):
        token = request.landing.token
        cancelled, ended = threading.Event(), threading.Event()
        with self._lock:
            late = bool(token) and self._aborted.pop(token, None) is not None
            if token and not late:
                self._calls[token] = (cancelled, ended)
        try:
            if late:  # its caller gave up before it came: it writes nothing
                self.metrics.requests.labels("cancelled").inc()
                context.abort(grpc.StatusCode.CANCELLED, f"prefill {request.request_id} was aborted before it arrived")
            # who writes: before any write, so a caller that gives up can tell this process's death from its silence.
            # A caller already gone makes this raise (grpc's RpcError): the call ends here, having written nothing
            context.send_initial_metadata(((WRITER_METADATA, self.identity),))
            when_gone(context, cancelled.set)  # a caller already gone: no work at all
            return self._prefill(request, context, cancelled)
        finally:
            # its writes are over (the worker returns or raises only after they settle; or it never began): an Abort
            # says so from now on. Whatever ended it, even a raise before the worker was called: an entry left here
            # would have every Abort of it wait and answer "not stopped", its caller's blocks held for good
            ended.set()
            with self._lock:
                self._calls.pop(token, None)

    def _prefill(self, request, context, cancelled: threading.Event):
        m = self.metrics
        m.inflight.inc()
        if request.ahead:
            m.ahead.inc()
        try:
            resp = self.worker.prefill(request, cancelled)
        except Exception as e:
            code = WORKER_STATUS.code_of(e)
            if code is None:
                raise
            m.requests.labels(OUTCOME[code]).inc()
            context.abort(code, f"prefill {request.request_id} failed: {message(e)}")
        finally:
            m.inflight.dec()
        m.requests.labels("ok").inc()
        m.seconds.observe(resp.prefill_s)
        m.queue.observe(resp.queue_s)
        m.tokens.labels("computed").inc(resp.computed_tokens)
        m.tokens.labels("pool_dram").inc(max(0, resp.local_tokens - resp.ssd_tokens))
        m.tokens.labels("pool_ssd").inc(resp.ssd_tokens)
        m.tokens.labels("remote").inc(resp.fetched_tokens)
        landing = request.landing
        pushed = (len(landing.cache_blocks) or len(landing.offsets)) * landing.block_bytes  # (narrow: fewer)
        m.kv_bytes.labels("pushed").inc(pushed)
        m.handoff.labels("cuda_ipc" if landing.cuda_ipc else "cache" if landing.cache_blocks else "slots").inc(pushed)
        m.kv_bytes.labels("pulled").inc(
            resp.fetched_tokens // self.worker.config.engine_config.block_size * self.worker.block_bytes
        )
        return resp

    def Abort(self, request, context):
        """End the Prefill call of ``landing_token`` and answer once its writes are over (``stopped``), or after
        ``ABORT_WAIT_S`` without (a group's prefill runs to its end). A call not here yet is refused when it comes."""
        token = request.landing_token
        if not token:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "Abort needs the call's landing token")
        now = time.monotonic()
        with self._lock:
            call = self._calls.get(token)
            if call is None:
                self._aborted = {t: at for t, at in self._aborted.items() if now - at < ABORTED_KEPT_S}
                self._aborted[token] = now
                return wpb.AbortResponse(stopped=True, writer=self.identity)
        cancel, ended = call
        cancel.set()
        return wpb.AbortResponse(stopped=ended.wait(ABORT_WAIT_S), writer=self.identity)


def _health(worker_id: str, worker: PrefillWorker) -> tuple[bool, dict]:
    """Ready unless draining (or, for a group, while its stages restart); a group lists its stages."""
    body = {"id": worker_id, "inflight": worker.num_inflight}
    ok = not worker.draining
    if worker.group is not None:
        body["stages"] = worker.group.stages()
        ok = ok and worker.group.ready
    return ok, body


def _address(text: str) -> tuple[str, int]:
    host, sep, port = text.strip().rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"a stage address is HOST:PORT, got {text!r}")
    return host, int(port)


def parser() -> argparse.ArgumentParser:
    """This component's flags (the launcher renders its argv from them: mooncake.cliargs.to_argv)."""
    p = worker_parser(
        "python -m prefill",
        "A prefill worker: loads reusable prefix KV from the pool, computes the rest of each "
        "prompt layer by layer, and streams the KV to the decode worker and into its pool node. Prints READY {json}.",
        "prefill-0",
        PREFILL_ENGINE_DEFAULTS,
    )
    p.add_argument("--kvstore", required=True, help="gRPC address of this worker's pool node, on this host")
    p.add_argument("--no-store", action="store_true", help="do not write new blocks into the pool")
    field_arg(p, PrefillConfig, "reservation_ttl_s", "--reservation-ttl")
    field_arg(p, PrefillConfig, "pipeline_stages")
    p.add_argument(
        "--stage-addresses",
        default="",
        help="HOST:PORT,... of the group's stage servers (python -m prefill.stage, one per stage, in layer "
        "order) instead of spawning the stages here; --pipeline-stages defaults to their number",
    )
    p.add_argument(
        "--stage-key-file", help="the group's key, which its stage servers hold too (default: $MOONCAKE_STAGE_KEY)"
    )
    field_arg(p, PrefillConfig, "drain_timeout_s", "--drain-timeout")
    p.add_argument(
        "--no-calibrate",
        action="store_true",
        help="skip the timed prefills of made-up prompts (1/8, 1/2 and 1 step budget long) run before READY, "
        "which the Conductor's TTFT predictions start from",
    )
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return parser().parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s prefill[%(process)d] %(message)s")
    try:
        addresses = [_address(a) for a in args.stage_addresses.split(",") if a.strip()]
        stages = len(addresses) or args.pipeline_stages
        key = read_key(args.stage_key_file) if addresses else None
        config = PrefillConfig(
            id=args.id,
            engine=args.engine,
            vllm_args=parse_vllm_args(args.vllm_arg),
            kvstore=args.kvstore,
            engine_config=engine_fields(args),
            store_new_blocks=not args.no_store,
            reservation_ttl_s=args.reservation_ttl,
            pipeline_stages=stages,
            stage_addresses=addresses,
            stage_key=key,
            transport=TransportChoice.from_args(args),
        )
        worker = PrefillWorker(config)
        if not args.no_calibrate:
            worker.calibrate()
    except (ValueError, KVStoreUnavailable, OSError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    metrics = PrefillMetrics()
    metrics.registry.register(TransferCollector(worker.transfer))
    metrics.registry.register(PushRetries(worker.connector))

    def load() -> cpb.Load:
        prompts = worker.in_flight()  # the Conductor prices them with its predictor (queued_s stays 0)
        return cpb.Load(
            queued_requests=worker.num_inflight,
            queued_tokens=reports.queued_tokens(prompts),
            prompts=[
                cpb.InFlightPrompt(prompt_tokens=p.prompt_tokens, computed_tokens=p.computed_tokens) for p in prompts
            ],
            received_requests=worker.received,
            running_requests=worker.num_running,
            free_kv_blocks=worker.engine.num_free_blocks,
        )

    spec = WorkerProcess(
        name="prefill",
        add_servicer=lambda server: wpb_grpc.add_PrefillServicer_to_server(PrefillServicer(worker, metrics), server),
        registration=cpb.RegisterRequest(
            id=args.id,
            role=cpb.PREFILL,
            node=worker.node,
            model=args.model,
            fingerprint=worker.engine.fingerprint,
            engine=args.engine,
            block_bytes=worker.engine.pool_block_bytes,  # a block of the model it loaded, as the pool keeps it
            capacity=config.engine_config.max_num_batched_tokens,
            pipeline_stages=stages,
            pipeline_chunk=config.engine_config.max_num_batched_tokens if stages > 1 else 0,
            transport=worker.transfer.transport,
            tensor_parallel_size=config.engine_config.tensor_parallel_size,
            block_size=config.engine_config.block_size,
            kv_dtype=config.engine_config.kv_dtype,
            pool_kv_dtype=config.engine_config.pool_dtype if config.engine_config.pool_kv_dtype != "auto" else "",
        ),
        load=load,
        ready={
            "node": worker.node,
            "block_bytes": worker.block_bytes,
            "kv_blocks": worker.engine.num_free_blocks,  # its cache, as sized (--num-kv-blocks, else from memory)
            "engine": args.engine,
            "transport": worker.transfer.transport,
            **({"stages": worker.group.stages()} if worker.group is not None else {}),
        },
        health=lambda: _health(args.id, worker),
        busy=lambda: worker.num_inflight,
        # each queued Prefill holds a thread while it waits for the engine, and the Abort calls that end cancelled ones
        # need threads too: a storm of 100 (benchmarks/abort_storm.py) queues more than the default 32
        max_rpc_threads=128,
        busy_beat_s=PREFILL_BUSY_BEAT_S,  # and at once when a prompt ends (PrefillWorker: beat_soon)
        drain_timeout_s=args.drain_timeout,
    )
    return run_worker(args, worker, spec, metrics.registry)
