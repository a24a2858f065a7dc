"""``mooncake up`` (the whole cluster on this machine) and ``mooncake serve COMPONENT`` (one component, as a pod runs
it)."""

from __future__ import annotations

import importlib
import json
import logging
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any, Optional

import typer
from rich.console import Console

from mooncake.cli.chat_cmd import CacheOpt, ModelOpt, _model_dir
from mooncake.cluster.components import COMPONENTS
from mooncake.cluster.config import ClusterConfig
from mooncake.cluster.launcher import LocalCluster

console = Console(stderr=True)


def _opt(field: str, flag: str, **extra: Any) -> Any:
    """A `mooncake up` option whose default, help and range are ClusterConfig's: the one place they are written."""
    info = ClusterConfig.model_fields[field]
    bounds = {}
    for rule in info.metadata:
        if getattr(rule, "ge", None) is not None:
            bounds["min"] = rule.ge
        if getattr(rule, "le", None) is not None:
            bounds["max"] = rule.le
    return typer.Option(info.get_default(call_default_factory=True), flag, help=info.description, **bounds, **extra)


def up(
    model: str = ModelOpt,
    cache_dir: Optional[Path] = CacheOpt,
    prefill: int = _opt("prefill", "--prefill"),
    prefill_groups: int = _opt("prefill_groups", "--prefill-groups"),
    group_size: int = _opt("group_size", "--group-size"),
    decode: int = _opt("decode", "--decode"),
    port: int = _opt("port", "--port"),
    host: str = _opt("host", "--host"),
    redis_url: Optional[str] = _opt("redis_url", "--redis-url"),
    api_key: Optional[str] = _opt("api_key", "--api-key"),
    tenants: Optional[Path] = _opt("tenants_file", "--tenants", exists=True, dir_okay=False),
    pool_dram_mib: int = _opt("pool_dram_mib", "--pool-dram-mib"),
    pool_ssd_mib: int = _opt("pool_ssd_mib", "--pool-ssd-mib"),
    max_model_len: Optional[int] = _opt("max_model_len", "--max-model-len"),
    threads: Optional[int] = _opt("threads", "--threads"),
    policy: str = _opt("policy", "--policy"),
    admission: str = _opt("admission", "--admission"),
    ttft_slo: float = _opt("ttft_slo_s", "--ttft-slo"),
    tbt_slo: float = _opt("tbt_slo_s", "--tbt-slo"),
    workdir: Path = _opt("workdir", "--workdir"),
    engine: str = _opt("engine", "--engine"),
    vllm_arg: list[str] = _opt("vllm_args", "--vllm-arg"),
    device: str = _opt("device", "--device"),
    enforce_eager: bool = _opt("enforce_eager", "--enforce-eager"),
    block_size: Optional[int] = _opt("block_size", "--block-size"),
    conductors: int = _opt("conductors", "--conductors"),
    hold: float = _opt("hold_s", "--hold"),
    worker_nice: int = _opt("worker_nice", "--worker-nice"),
    control_nice: int = _opt("control_nice", "--control-nice"),
    insecure: bool = _opt("insecure", "--insecure"),
) -> None:
    """Start the whole disaggregated system on this machine and serve the OpenAI API.

    Starts the Conductor, a pool node per prefill worker, the prefill and decode workers
    and the gateway as separate processes, waits until all are healthy, prints the
    endpoint, restarts a component that dies, and stops everything on Ctrl-C or SIGTERM.
    """
    if engine not in ("native", "vllm"):
        console.print(f"[red]error:[/red] --engine must be native or vllm, got {engine!r}")
        raise typer.Exit(2)
    try:
        model_dir = _model_dir(model, cache_dir)
    except (ValueError, RuntimeError) as e:
        console.print(f"[red]error:[/red] {e}")
        raise typer.Exit(2) from None
    try:
        config = ClusterConfig(
            model=str(model_dir),
            model_name=model if "/" not in model else model_dir.name,
            prefill=prefill,
            decode=decode,
            prefill_groups=prefill_groups,
            group_size=group_size,
            host=host,
            port=port,
            api_key=api_key,
            tenants_file=tenants,
            redis_url=redis_url,
            workdir=workdir,
            pool_dram_mib=pool_dram_mib,
            pool_ssd_mib=pool_ssd_mib,
            max_model_len=max_model_len,
            threads=threads,
            policy=policy,
            admission=admission,
            ttft_slo_s=ttft_slo,
            tbt_slo_s=tbt_slo,
            engine=engine,
            vllm_args=vllm_arg,
            block_size=block_size,
            device=device,
            enforce_eager=enforce_eager,
            conductors=conductors,
            hold_s=hold,
            worker_nice=worker_nice,
            control_nice=control_nice,
            insecure=insecure,
        )
    except ValueError as e:  # pydantic's ValidationError is one
        console.print(f"[red]error:[/red] {e}")
        raise typer.Exit(2) from None
    cluster = LocalCluster(config, on_event=lambda msg: console.print(f"[dim]{msg}[/dim]"))
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        with console.status(f"starting {prefill} prefill + {decode} decode workers for {config.model_name}"):
            cluster.start()
    except RuntimeError as e:
        console.print(f"[red]error:[/red] {e}")
        raise typer.Exit(1) from None
    console.print(f"logs: {cluster.run_dir / 'logs'}")
    console.print(
        f"OpenAI endpoint: [bold]{cluster.endpoint}[/bold]  (model: {config.model_name}); "
        f"Conductor {cluster.conductor_address} (`mooncake status`, `mooncake pool scale`)"
    )
    current = workdir / "current.json"
    current.write_text(
        json.dumps(
            {
                "conductor": cluster.conductor_address,
                "endpoint": cluster.endpoint,
                "pid": os.getpid(),
                "operator_token_file": str(cluster.operator_token_file),
                "tls_dir": str(cluster.tls_dir) if cluster.tls_dir else None,
            }
        )
    )
    print(f"mooncake is ready at {cluster.endpoint}", flush=True)
    stop.wait()
    console.print("stopping every component")
    current.unlink(missing_ok=True)
    cluster.stop()


def serve(ctx: typer.Context, component: str = typer.Argument(..., help=" | ".join(COMPONENTS))) -> None:
    """Run one component in this process (what a Kubernetes pod runs); the rest of the arguments are its own.

    `mooncake serve prefill --help` lists a component's flags.
    """
    if component not in COMPONENTS:
        console.print(f"[red]error:[/red] unknown component {component!r}; choose from {', '.join(COMPONENTS)}")
        raise typer.Exit(2)
    for handler in logging.root.handlers[:]:  # the component configures logging itself (its --log-level)
        logging.root.removeHandler(handler)
    sys.exit(importlib.import_module(COMPONENTS[component][1]).main(list(ctx.args)))
