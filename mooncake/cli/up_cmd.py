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
from typing import Optional

import typer
from rich.console import Console

from mooncake.cli.chat_cmd import CacheOpt, ModelOpt, _model_dir
from mooncake.cluster.launcher import ClusterConfig, LocalCluster

console = Console(stderr=True)

COMPONENTS = {
    "conductor": "conductor.__main__",
    "kvstore": "kvstore.__main__",
    "prefill": "prefill.server",
    "decode": "decode.server",
    "gateway": "mooncake.gateway.__main__",
}


def up(
    model: str = ModelOpt,
    cache_dir: Optional[Path] = CacheOpt,
    prefill: int = typer.Option(1, "--prefill", min=1, help="Prefill workers (each gets its own pool node)"),
    prefill_groups: int = typer.Option(
        0,
        "--prefill-groups",
        min=0,
        help="Of the prefill workers, this many run as "
        "pipelined groups (chunked pipeline parallelism): the model's layers split over "
        "--group-size stage processes, one core each; long prompts go there",
    ),
    group_size: int = typer.Option(2, "--group-size", min=2, help="Stage processes per pipelined prefill group"),
    decode: int = typer.Option(1, "--decode", min=1, help="Decode workers"),
    port: int = typer.Option(8000, "--port", help="The gateway's HTTP port"),
    host: str = typer.Option("127.0.0.1", "--host", help="Address every component binds"),
    redis_url: Optional[str] = typer.Option(
        None, "--redis-url", help="Persist the Conductor's registry and settings here"
    ),
    api_key: Optional[str] = typer.Option(None, "--api-key", help="Require `Authorization: Bearer <key>` on /v1/*"),
    tenants: Optional[Path] = typer.Option(
        None,
        "--tenants",
        exists=True,
        dir_okay=False,
        help="API keys by tenant (YAML or "
        "JSON), instead of --api-key: each tenant gets a KV cache of its own and its own "
        "rate limit and cap on requests in flight",
    ),
    pool_dram_mib: int = typer.Option(1024, "--pool-dram-mib", min=1, help="DRAM tier of each pool node (MiB)"),
    pool_ssd_mib: int = typer.Option(0, "--pool-ssd-mib", min=0, help="SSD tier of each pool node (MiB; 0: none)"),
    max_model_len: Optional[int] = typer.Option(None, "--max-model-len", help="Context limit [default: the model's]"),
    threads: Optional[int] = typer.Option(None, "--threads", help="torch threads per worker [default: torch's]"),
    policy: str = typer.Option("kvcache_centric", "--policy", help="Prefill placement policy"),
    admission: str = typer.Option("early_predictive", "--admission", help="none | baseline | early | early_predictive"),
    ttft_slo: float = typer.Option(30.0, "--ttft-slo", help="TTFT SLO in seconds"),
    tbt_slo: float = typer.Option(0.5, "--tbt-slo", help="TBT SLO in seconds (CPU decode steps are tens of ms)"),
    workdir: Path = typer.Option(
        Path.home() / ".cache" / "mooncake" / "run", "--workdir", help="Logs (and SSD files) go here"
    ),
    engine: str = typer.Option(
        "native",
        "--engine",
        help="Workers' engine: native (ours) or vllm (stock vLLM, installed with the project's `vllm` extra)",
    ),
    vllm_arg: list[str] = typer.Option(
        [],
        "--vllm-arg",
        help="KEY=VALUE vLLM engine argument for every worker, repeatable "
        "(e.g. enforce_eager=true, gpu_memory_utilization=0.85)",
    ),
    device: str = typer.Option(
        "cpu",
        "--device",
        help="Native workers' device: cpu, or cuda[:N] (every worker on that "
        "GPU; a pipelined group's stages spread over the GPUs with plain `cuda`)",
    ),
    enforce_eager: bool = typer.Option(
        False,
        "--enforce-eager",
        help="Native workers on CUDA: run every step eagerly, without capturing decode steps as CUDA graphs",
    ),
    block_size: Optional[int] = typer.Option(
        None, "--block-size", help="Tokens per KV block [default: 16 native, 32 vllm]"
    ),
    conductors: int = typer.Option(
        1,
        "--conductors",
        min=1,
        max=5,
        help="Conductors; more than one needs --redis-url: one leads, the others stand by and take over when it dies",
    ),
    hold: float = typer.Option(
        10.0,
        "--hold",
        min=0,
        help="Seconds the gateway holds a request while the Conductor (or "
        "every worker of a role) is away, before answering 503",
    ),
    worker_nice: int = typer.Option(
        10,
        "--worker-nice",
        min=0,
        max=19,
        help="Run the workers and pool nodes this much below "
        "the Conductor and the gateway in CPU priority (nice, and the same for the session each runs in, "
        "which the kernel's autogroups schedule as one), so refusals and decisions stay fast "
        "however busy the workers are; 0: the same priority, for a client on the same cores "
        "(at nice 10, a load generator such as aiperf starves them)",
    ),
    insecure: bool = typer.Option(
        False,
        "--insecure",
        help="No TLS between the components (development only). By default "
        "they present certificates from a CA made in the run directory (or $MOONCAKE_TLS_DIR's) "
        "and refuse any peer without one",
    ),
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
    module = COMPONENTS.get(component)
    if module is None:
        console.print(f"[red]error:[/red] unknown component {component!r}; choose from {', '.join(COMPONENTS)}")
        raise typer.Exit(2)
    for handler in logging.root.handlers[:]:  # the component configures logging itself (its --log-level)
        logging.root.removeHandler(handler)
    sys.exit(importlib.import_module(module).main(list(ctx.args)))
