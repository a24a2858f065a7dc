"""``mooncake up`` (the whole cluster on this machine) and ``mooncake serve COMPONENT`` (one component, as a pod runs
it)."""

from __future__ import annotations

import enum
import importlib
import inspect
import json
import logging
import os
import signal
import sys
import threading
import types
import typing
from pathlib import Path
from typing import Any, NoReturn, Optional

import pydantic
import typer
from rich.console import Console

from mooncake.cli.chat_cmd import CacheOpt, ModelOpt, _model_dir
from mooncake.cluster.components import COMPONENTS
from mooncake.cluster.config import ClusterConfig
from mooncake.cluster.launcher import ComponentRefused, LocalCluster
from mooncake.engine.hub import is_hub_id

console = Console(stderr=True)


def _opt(field: str, flag: str, **extra: Any) -> Any:
    """A `mooncake up` option whose default, help and range are ClusterConfig's: the one place they are written."""
    info = ClusterConfig.model_fields[field]
    default = info.get_default(call_default_factory=True)
    if _is_enum(info.annotation):  # passed on as text (_typer_type): the choices shown as typer shows an enum's
        extra = {"metavar": "[" + "|".join(m.value for m in info.annotation) + "]", **extra}
        default = default.value
    bounds = {}
    for rule in info.metadata:
        if getattr(rule, "ge", None) is not None:
            bounds["min"] = rule.ge
        if getattr(rule, "le", None) is not None:
            bounds["max"] = rule.le
    return typer.Option(default, flag, help=info.description, **bounds, **extra)


# ClusterConfig's fields by another flag than their own name's (--name-with-dashes); model and model_name come from
# --model (a name `mooncake model pull` knows, or a directory)
FLAGS = {
    "tenants_file": "--tenants",
    "ttft_slo_s": "--ttft-slo",
    "tbt_slo_s": "--tbt-slo",
    "hold_s": "--hold",
    "vllm_args": "--vllm-arg",
    "slo_classes": "--slo-class",
}
FROM_MODEL = ("model", "model_name")
_PATH_CHECKS = {"tenants_file": {"exists": True, "dir_okay": False}}  # --tenants names a file that exists


def _is_enum(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, enum.Enum)


def _typer_type(annotation: Any) -> Any:
    """``X | None`` as typer reads it (Optional[X]); an enum as text, which ClusterConfig checks, so that a bad value
    is its one-line error naming the choices (``error: policy: Input should be 'random', ...``), not typer's box."""
    if _is_enum(annotation):
        return str
    args = typing.get_args(annotation)
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        inner = [a for a in args if a is not type(None)]
        return Optional[inner[0]]  # noqa: UP045 - typer reads Optional
    return annotation


def _flag(name: str) -> str:
    """A field's flag: ``--name-with-dashes`` (or FLAGS's); a switch that is on by default also gets its ``--no-``."""
    flag = FLAGS.get(name, "--" + name.replace("_", "-"))
    return f"{flag}/--no-{flag[2:]}" if ClusterConfig.model_fields[name].default is True else flag


def _options() -> list[inspect.Parameter]:
    """One option per ClusterConfig field (but the model's): the flags are generated, so every field is settable."""
    return [
        inspect.Parameter(
            name,
            inspect.Parameter.KEYWORD_ONLY,
            default=_opt(name, _flag(name), **_PATH_CHECKS.get(name, {})),
            annotation=_typer_type(info.annotation),
        )
        for name, info in ClusterConfig.model_fields.items()
        if name not in FROM_MODEL
    ]


def _where(loc: tuple) -> str:
    """Where a ClusterConfig error is: the flag of its field (``--policy``), else the field's path, else ``config``."""
    if len(loc) == 1 and loc[0] in ClusterConfig.model_fields and loc[0] not in FROM_MODEL:
        return _flag(loc[0]).split("/")[0]
    return ".".join(str(p) for p in loc) or "config"


def _fail(e: Exception, code: int = 2) -> NoReturn:
    """Stop with one line on stderr (never a traceback): ``error: <why>``, and exit status ``code`` (2: the model or
    the configuration is refused)."""
    if isinstance(e, pydantic.ValidationError):
        why = "; ".join(f"{_where(err['loc'])}: {err['msg'].removeprefix('Value error, ')}" for err in e.errors())
    else:
        why = " ".join(str(e).split())
    typer.echo(f"error: {why}", err=True)  # not rich: it would wrap a long line at the terminal's width
    raise typer.Exit(code)


def up(model: str = ModelOpt, cache_dir: Optional[Path] = CacheOpt, **settings: Any) -> None:
    """Start the whole disaggregated system on this machine and serve the OpenAI API.

    Starts the Conductor, a pool node per prefill worker, the prefill and decode workers
    and the gateway as separate processes, waits until all are healthy, prints the
    endpoint, restarts a component that dies, and stops everything on Ctrl-C or SIGTERM.
    """
    try:
        model_dir = _model_dir(model, cache_dir)
        # served as the name it was asked by: a known model's, a hub id (org/name), else the directory's name
        name = model if "/" not in model or (is_hub_id(model) and not Path(model).exists()) else model_dir.name
        config = ClusterConfig(model=str(model_dir), model_name=name, **settings)
        # reads the model as the workers' engine will (the pool's block bytes): refuses what it cannot serve
        cluster = LocalCluster(config, on_event=lambda msg: console.print(f"[dim]{msg}[/dim]"))
    except (ValueError, RuntimeError) as e:  # pydantic's ValidationError is a ValueError
        _fail(e)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        with console.status(
            f"starting {config.prefill} prefill + {config.decode} decode workers for {config.model_name}"
        ):
            cluster.start()
    except ComponentRefused as e:  # a worker refused the model or the configuration at start
        _fail(e)
    except RuntimeError as e:
        console.print(f"[red]error:[/red] {e}")
        raise typer.Exit(1) from None
    console.print(f"logs: {cluster.run_dir / 'logs'}")
    console.print(
        f"OpenAI endpoint: [bold]{cluster.endpoint}[/bold]  (model: {config.model_name}); "
        f"Conductor {cluster.conductor_address} (`mooncake status`, `mooncake pool scale`)"
    )
    current = config.workdir / "current.json"
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


up.__signature__ = inspect.Signature(  # what typer reads: --model, --cache-dir, then ClusterConfig's fields
    [*list(inspect.signature(up).parameters.values())[:2], *_options()], return_annotation=None
)


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
