"""Run the Conductor: ``python -m conductor --help``.

Prints one line ``READY {json}`` on stdout (gRPC and metrics addresses, the policy and
admission in force, instances recovered from Redis) when it serves, and stops cleanly on
SIGTERM or Ctrl-C.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import signal
import sys
import threading

import pydantic
from prometheus_client import start_http_server

from conductor.audit import PredictionLog
from conductor.auth import TOKEN_FILE_ENV, read_token_file
from conductor.config import ConductorConfig
from conductor.fastpath import start_fast_path
from conductor.leader import LeaderLease
from conductor.persistence import RedisStore, make_store
from conductor.planner.planner import PlannerConfig
from conductor.policies import PolicyConfig
from conductor.pool import make_provider
from conductor.predictors import PredictorConfig
from conductor.service import ConductorService
from conductor.servicer import ConductorServicer, start_server
from conductor.types import DEFAULT_SLO, Role, Slo
from mooncake.cliargs import field_arg
from mooncake.runtime.process import print_ready

SWITCH_INTERVAL_S = 0.0005  # the thread answering a Schedule gets the GIL this soon (Python's default: 5 ms)

log = logging.getLogger("conductor")


def parser() -> argparse.ArgumentParser:
    """This component's flags (the launcher renders its argv from them: mooncake.cliargs.to_argv)."""
    p = argparse.ArgumentParser(
        prog="python -m conductor",
        description="The Conductor: registry, global KV index, KVCache-centric scheduling and early rejection (gRPC).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--host", default="127.0.0.1", help="address the gRPC service binds")
    p.add_argument("--port", type=int, default=0, help="gRPC port (0: any free port, printed in the READY line)")
    p.add_argument("--metrics-port", type=int, default=0, help="Prometheus /metrics port (0: any free port; -1: none)")
    p.add_argument(
        "--control-port",
        type=int,
        default=0,
        help="Schedule's fast path, framed protobuf without gRPC (what "
        "gateways use; conductor/fastpath.py): tcp port (0: any free port; -1: none, gRPC only)",
    )
    p.add_argument(
        "--redis-url",
        help="persist the registry and settings here, and recover them at start; several "
        "Conductors on one Redis elect a leader (the others stand by and take over when its lease lapses)",
    )
    p.add_argument(
        "--leader-lease",
        type=float,
        default=3.0,
        help="with --redis-url: seconds a leader's lease lasts unrenewed (a standby takes it within 0.25 s of its end)",
    )
    field_arg(p, ConductorConfig, "policy")
    field_arg(p, ConductorConfig, "admission")
    field_arg(p, ConductorConfig, "local_prefill")
    field_arg(p, ConductorConfig, "narrow_handoff")
    field_arg(p, ConductorConfig, "local_max_load")
    field_arg(p, ConductorConfig, "local_chunk_tokens")
    field_arg(p, ConductorConfig, "decode_forecast")
    field_arg(p, ConductorConfig, "tbt_headroom")
    field_arg(p, ConductorConfig, "wait_queue")
    p.add_argument(
        "--ttft-slo",
        type=float,
        default=DEFAULT_SLO.ttft_s,
        help="the default SLO class's time to first token, seconds",
    )
    p.add_argument(
        "--tbt-slo",
        type=float,
        default=DEFAULT_SLO.tbt_s,
        help="the default SLO class's time between tokens, seconds",
    )
    p.add_argument(
        "--slo-class",
        action="append",
        default=[],
        metavar="NAME=TTFT,TBT",
        help="another SLO class, e.g. batch=120,0.5 (repeatable)",
    )
    field_arg(p, ConductorConfig, "block_bytes")
    field_arg(p, ConductorConfig, "heartbeat_timeout_s", "--heartbeat-timeout")
    field_arg(p, ConductorConfig, "suspect_hold_s", "--suspect-hold")
    field_arg(p, PolicyConfig, "kvcache_balancing_threshold", "--balancing-threshold")
    field_arg(p, PolicyConfig, "tier_aware")
    field_arg(p, PredictorConfig, "prefill_tokens_per_s")
    p.add_argument(
        "--pool-provider",
        choices=["none", "local", "kubernetes"],
        default="none",
        help="how `mooncake pool scale` adds and removes workers: local (the processes of `mooncake up`), "
        "kubernetes (the pools' Deployments), none (refused)",
    )
    p.add_argument("--pool-control", help="local: the launcher's control URL")
    g = p.add_argument_group(
        "capacity planner (conductor.planner)",
        "every interval it forecasts the load, sizes both pools to the SLOs from the learnt predictors, checks the "
        "counts on its twin, and scales through the pool provider (`mooncake plan` shows its reasoning)",
    )
    g.add_argument(
        "--planner",
        choices=["off", "act", "advise"],
        default="off",
        help="act: scale the pools to the plans (needs --pool-provider); advise: plan and export "
        "mooncake_planner_desired_instances for KEDA or an HPA, scaling nothing; off: plan only when asked",
    )
    for name in ("interval_s", "start_s", "cooldown_s", "min_prefill", "max_prefill", "min_decode", "max_decode"):
        field_arg(g, PlannerConfig, name, "--planner-" + name.removesuffix("_s").replace("_", "-"))
    p.add_argument("--namespace", default="default", help="kubernetes: the pools' namespace")
    p.add_argument("--prefill-deployment", default="mooncake-prefill", help="kubernetes: the prefill pool's Deployment")
    p.add_argument("--decode-deployment", default="mooncake-decode", help="kubernetes: the decode pool's Deployment")
    p.add_argument(
        "--operator-token-file",
        default=os.environ.get(TOKEN_FILE_ENV),
        metavar="FILE",
        help="the admin calls (Drain, SetPolicy, ScalePool, Deregister of another instance) need this file's token "
        f"as 'authorization: Bearer <token>' (default ${TOKEN_FILE_ENV}); without one they are open to "
        "anyone who reaches the port",
    )
    p.add_argument(
        "--prediction-log",
        metavar="FILE",
        help="append one JSON line per admitted request whose TTFT came out: its predicted and measured queue, prefill "
        "and transfer, and the load it was placed under (conductor/audit.py; rolls over at 64 MiB)",
    )
    p.add_argument("--log-level", default="INFO")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return parser().parse_args(argv)


def build_config(args: argparse.Namespace) -> ConductorConfig:
    classes = {"default": Slo(args.ttft_slo, args.tbt_slo)}
    for spec in args.slo_class:
        name, _, values = spec.partition("=")
        try:
            ttft, tbt = (float(v) for v in values.split(","))
        except ValueError:
            raise ValueError(f"bad --slo-class {spec!r}; expected NAME=TTFT,TBT such as batch=120,0.5") from None
        if not name or ttft <= 0 or tbt <= 0:
            raise ValueError(f"bad --slo-class {spec!r}: a name and two positive numbers")
        classes[name] = Slo(ttft, tbt)
    return ConductorConfig(
        policy=args.policy,
        admission=args.admission,
        slo_classes=classes,
        block_bytes=args.block_bytes,
        heartbeat_timeout_s=args.heartbeat_timeout,
        suspect_hold_s=args.suspect_hold,
        decode_forecast=args.decode_forecast,
        tbt_headroom=args.tbt_headroom,
        wait_queue=args.wait_queue,
        local_prefill=args.local_prefill,
        narrow_handoff=args.narrow_handoff,
        local_chunk_tokens=args.local_chunk_tokens,
        local_max_load=args.local_max_load,
        predictors=PredictorConfig(prefill_tokens_per_s=args.prefill_tokens_per_s),
        policy_config=PolicyConfig(kvcache_balancing_threshold=args.balancing_threshold, tier_aware=args.tier_aware),
    )


def planner_config(args: argparse.Namespace) -> PlannerConfig:
    try:
        config = PlannerConfig(
            interval_s=args.planner_interval,
            start_s=args.planner_start,
            cooldown_s=args.planner_cooldown,
            min_prefill=args.planner_min_prefill,
            max_prefill=args.planner_max_prefill,
            min_decode=args.planner_min_decode,
            max_decode=args.planner_max_decode,
        )
    except pydantic.ValidationError as e:
        raise ValueError(f"bad planner setting: {e.errors()[0]['loc'][0]}: {e.errors()[0]['msg']}") from None
    for role in ("prefill", "decode"):
        if getattr(config, f"min_{role}") > getattr(config, f"max_{role}"):
            raise ValueError(f"--planner-min-{role} is above --planner-max-{role}")
    return config


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s conductor[%(process)d] %(message)s")
    try:
        config = build_config(args)
        operator_token = read_token_file(args.operator_token_file) if args.operator_token_file else None
        store = make_store(args.redis_url)
        provider = make_provider(
            args.pool_provider,
            args.pool_control,
            args.namespace,
            {Role.PREFILL: args.prefill_deployment, Role.DECODE: args.decode_deployment},
        )
        planner = None if args.planner == "off" else planner_config(args)
        if args.planner == "act" and args.pool_provider == "none":
            raise ValueError("--planner act scales the pools: it needs --pool-provider local or kubernetes")
    except (ValueError, ConnectionError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    elected = isinstance(store, RedisStore)  # on Redis: whoever holds the leader lease serves
    service = ConductorService(
        config,
        store,
        provider=provider,
        standby=elected,
        prediction_log=PredictionLog(args.prediction_log) if args.prediction_log else None,
        planner=planner,
        planner_acts=args.planner == "act",
    )
    try:
        server, port = start_server(service, args.host, args.port, operator_token=operator_token)
        fast = (
            start_fast_path(ConductorServicer(service), args.host, args.control_port)
            if args.control_port >= 0
            else None
        )
    except (ValueError, RuntimeError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if operator_token is None:
        log.warning(
            "no operator token (--operator-token-file): Drain, SetPolicy, ScalePool and Deregister are open to "
            "anyone who reaches %s:%d",
            args.host,
            port,
        )
    lease = None
    if elected:
        lease = LeaderLease(store.client, f"{args.host}:{port}", args.leader_lease, service.on_leadership).start()
        # a lone Conductor leads at once; a restarted one once its predecessor's lease lapses; a standby says so below
        service.leading.wait(args.leader_lease * 1.5)
    metrics = None
    if args.metrics_port >= 0:
        metrics_server, _ = start_http_server(args.metrics_port, addr=args.host, registry=service.metrics.registry)
        metrics = f"{args.host}:{metrics_server.server_port}"
    c = service.conductor
    if fast is not None:
        service.control_port = fast.port
    ready = {
        "grpc": f"{args.host}:{port}",
        "control": f"{args.host}:{fast.port}" if fast else None,
        "metrics": metrics,
        "policy": c.policy.kind.value,
        "admission": c.admission.value,
        "local_prefill": c.local_prefill.value,
        "recovered_instances": len(c.instances),
        "leading": service.leading.is_set(),
        "planner": args.planner,
    }
    gc.freeze()  # what start-up made stays out of every full collection (a pause there delays every decision)
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    print_ready(ready)
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    done.wait()
    n = c.counters
    log.info(
        "stopping: %d placed (%d computed on their decode worker), %d refused; hand-off learnt %.3f s",
        n.scheduled,
        n.local,
        sum(n.rejected.values()),
        c.handoff_s,
    )
    if lease is not None:
        lease.close()  # hand the lease over at once
    server.stop(grace=2).wait()
    if fast is not None:
        fast.close()
    service.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
