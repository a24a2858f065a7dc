"""The operator's commands: ``mooncake status``, ``mooncake plan``, ``mooncake pool scale``, ``mooncake pool drain``
(through the Conductor)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Optional

import grpc
import typer
from rich.console import Console
from rich.table import Table

from conductor.auth import TOKEN_FILE_ENV, bearer, read_token_file
from mooncake import tls
from protos import conductor_pb2 as pb
from protos import conductor_pb2_grpc as pb_grpc

console = Console()
if not console.is_terminal:  # a pipe or a log: wide enough for the status table
    console = Console(width=200)
err = Console(stderr=True)
app = typer.Typer(
    help="See and scale the prefill and decode pools (through the Conductor's admin API).", no_args_is_help=True
)

RUN_DIR = Path.home() / ".cache" / "mooncake" / "run"
CURRENT = RUN_DIR / "current.json"  # written by `mooncake up` while it runs
ConductorOpt = typer.Option(
    None,
    "--conductor",
    "-c",
    envvar="MOONCAKE_CONDUCTOR",
    help="The Conductor's gRPC address [default: the one `mooncake up` runs here]",
)
OperatorOpt = typer.Option(
    None,
    "--operator-token-file",
    envvar=TOKEN_FILE_ENV,
    exists=True,
    dir_okay=False,
    help="The operator credential for admin calls [default: the one `mooncake up` runs here wrote]",
)
ROLES = {"prefill": pb.PREFILL, "decode": pb.DECODE}


def conductor_address(given: str | None) -> str:
    if given:
        return given
    try:
        return json.loads(CURRENT.read_text())["conductor"]
    except (OSError, ValueError, KeyError):
        err.print("[red]error:[/red] no Conductor address: pass --conductor HOST:PORT (or run `mooncake up` here)")
        raise typer.Exit(2) from None


def operator_token(given: Path | None) -> str | None:
    """The operator token: from ``given`` (the option or its variable), else the file of the `mooncake up` running
    here."""
    path = given
    if path is None:
        try:
            path = json.loads(CURRENT.read_text()).get("operator_token_file")
        except (OSError, ValueError):
            path = None
    if not path:
        return None
    try:
        return read_token_file(path)
    except ValueError as e:
        err.print(f"[red]error:[/red] {e}")
        raise typer.Exit(2) from None


def _stub(address: str) -> pb_grpc.ConductorStub:
    """A stub with the cluster's certificate: $MOONCAKE_TLS_DIR, else that of the `mooncake up` running here."""
    if not os.environ.get(tls.ENV_DIR):
        try:
            given = json.loads(CURRENT.read_text()).get("tls_dir")
        except (OSError, ValueError):
            given = None
        if given:
            os.environ[tls.ENV_DIR] = given  # this CLI process's identity, as a component's
    return pb_grpc.ConductorStub(tls.grpc_channel(address))


def _call(fn, request, address: str, token: str | None = None):
    try:
        return fn(request, timeout=10, metadata=bearer(token))
    except grpc.RpcError as e:
        if e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            err.print(f"[red]error:[/red] the Conductor at {address} does not answer ({e.code().name})")
        else:
            err.print(f"[red]error:[/red] {e.details()}")
        raise typer.Exit(1) from None


def _ratio(n: int, d: int) -> str:
    return f"{n / d:.0%}" if d else "-"


def status_table(listing: pb.ListInstancesResponse) -> Table:
    t = Table(
        title=f"policy {listing.policy}, admission {listing.admission}: {listing.scheduled} scheduled, "
        f"{sum(listing.rejected.values())} rejected, {listing.index_blocks} blocks indexed"
        + (
            "\n[bold red]admin calls are open: the Conductor has no operator token[/bold red]"
            if listing.admin_open
            else ""
        )
        + (
            "\n[bold red]INSECURE: no TLS between the components; anyone who reaches their ports can call them"
            "[/bold red]"
            if listing.insecure
            else ""
        )
        + _kv_line(listing.instances)
        + _quote_line(listing)
        + _plan_line(listing.plan, listing.instances)
    )
    for c in ("instance", "role", "address", "state", "load", "running", "KV (DRAM / all)", "cache hit", "heartbeat"):
        t.add_column(c, justify="left" if c in ("instance", "role", "address", "state") else "right")
    nodes = {i.node: i for i in listing.instances if i.role == pb.KVSTORE}
    bs = max((i.block_size for i in listing.instances), default=0)  # a cluster's workers share one (0: none said)
    order = {pb.PREFILL: 0, pb.KVSTORE: 1, pb.DECODE: 2}
    for i in sorted(listing.instances, key=lambda i: (order.get(i.role, 3), i.id)):
        group = f", {i.pipeline_stages}-stage group, {i.pipeline_chunk}-token chunks" if i.pipeline_stages > 1 else ""
        group += f", TP {i.tensor_parallel_size}" if i.tensor_parallel_size > 1 else ""
        kv_over = f", KV over {i.transport.split(' ')[0].rstrip(':')}" if i.transport else ""  # rdma or tcp
        role = pb.Role.Name(i.role).lower() + (
            f" ({i.engine or 'pool'}{group}{kv_over})" if i.engine or group or kv_over else ""
        )
        state = pb.InstanceState.Name(i.state).lower() + (" (retiring)" if i.retiring else "")
        kv = "-"
        if i.role in (pb.PREFILL, pb.KVSTORE):
            node = nodes.get(i.node)
            if node is not None:
                kv = f"{node.dram_blocks} / {node.indexed_blocks}" + (f" of {node.capacity}" if node.capacity else "")
                kv += f" ({node.indexed_blocks * bs:,} tokens)" if bs else ""
        if i.role == pb.PREFILL:
            load = f"{i.load.queued_requests} queued, {i.load.queued_s:.2f} s"
            running, hit = (
                str(i.load.running_requests),
                f"{_ratio(i.reused_blocks, i.prompt_blocks)} of {i.decisions} req",
            )
        elif i.role == pb.DECODE:
            load = f"{i.load.queued_requests} in prefill"
            if i.kv_blocks:  # its KV capacity, and the blocks the Conductor counts held (landings and the batch)
                kv = f"{i.kv_held} of {i.kv_blocks} held" + (f" ({i.kv_blocks * bs:,} tokens)" if bs else "")
            running = str(i.load.running_requests) + (f" of {i.load.batch_cap}" if i.load.batch_cap else "")
            running += f" ({i.load.step_s * 1e3:.0f} ms/step)" if i.load.step_s else ""
            # the prompts it computed itself (the Conductor's local placement), and how much of them came from the pool
            hit = f"{_ratio(i.reused_blocks, i.prompt_blocks)} of {i.decisions} computed here" if i.decisions else "-"
        else:
            load = running = hit = "-"
        t.add_row(i.id, role, i.address, state, load, running, kv, hit, f"{i.heartbeat_age_s:.1f} s ago")
    return t


def _kv_line(instances) -> str:
    """What the workers keep KV in (and the pool, where narrower) and by how many tokens a block ("" before any
    said)."""
    said = sorted({(i.block_size, i.kv_dtype, i.pool_kv_dtype) for i in instances if i.block_size and i.kv_dtype})
    names = {"float8_e4m3fn": "fp8 (float8 e4m3)"}
    kept = ", ".join(
        f"{bs}-token blocks in {names.get(dtype, dtype)}" + (f", in the pool {names.get(pool, pool)}" if pool else "")
        for bs, dtype, pool in said
    )
    return f"\nKV: {kept}" if kept else ""


def _quote_line(listing: pb.ListInstancesResponse) -> str:
    """How often the Conductor's quotes held (within 25% of what came out), per part; "" before any came out."""
    parts = [
        f"{name} {listing.quote_held[part]:.0%} of {listing.quotes_measured[part]}"
        for part, name in (("ttft", "TTFT"), ("tbt", "TBT"))
        if listing.quotes_measured.get(part)
    ]
    return f"\nquotes held (within 25%): {', '.join(parts)}" if parts else ""


def _plan_line(plan: pb.PlanResponse, instances=()) -> str:
    if not plan.prefill:
        return ""
    mode = "scaling to it" if plan.acting else "advice only"
    # a role's instances share their size (mooncake up, the chart): the plan's count is that many devices each
    sizes = {i.role: max(i.tensor_parallel_size, 1) for i in instances if i.role in (pb.PREFILL, pb.DECODE)}
    devices = plan.prefill * sizes.get(pb.PREFILL, 1) + plan.decode * sizes.get(pb.DECODE, 1)
    counted = f" ({devices} devices at their TP sizes)" if any(n > 1 for n in sizes.values()) else ""
    return (
        f"\nplanner ({mode}): {plan.prefill} prefill, {plan.decode} decode{counted} for {plan.forecast_rate:.2f} "
        f"req/s, planned {plan.age_s:.0f} s ago (`mooncake plan` says why)"
    )


def plan(
    conductor: Optional[str] = ConductorOpt,
    last: bool = typer.Option(
        False, "--last", help="The plan the Conductor made last (what it acted on), not one made now"
    ),
) -> None:
    """The capacity planner's reasoning: the forecast load, each pool's count and what set it, the twin's runs.

    By default the Conductor makes a plan now from what it holds (its window of requests and its learnt predictors)
    on a copy of its planner: nothing is scaled and its next plan is unchanged. Started with --planner act, the
    Conductor scales the pools to its plans every interval; with --planner advise it only exports them."""
    address = conductor_address(conductor)
    r = _call(_stub(address).Plan, pb.PlanRequest(now=not last), address)
    if not r.reasoning:
        console.print("no plan yet: the planner has not planned (it plans every interval with --planner)")
        return
    mode = "acting: it scales the pools to its plans" if r.acting else "advising: it scales nothing"
    console.print(f"[bold]planner[/bold] ({mode}; every {r.interval_s:.0f} s)")
    console.print(r.reasoning, markup=False, highlight=False)


def status(
    conductor: Optional[str] = ConductorOpt,
    watch: float = typer.Option(0.0, "--watch", "-w", help="Refresh every N seconds"),
) -> None:
    """A table of every instance: role, address, state, load, running batch, KV per tier, cache hit ratio."""
    address = conductor_address(conductor)
    stub = _stub(address)
    while True:
        listing = _call(stub.ListInstances, pb.ListInstancesRequest(), address)
        if watch:
            console.clear()
        console.print(status_table(listing))
        if not watch:
            return
        time.sleep(watch)


@app.command("scale")
def scale(
    role: str = typer.Argument(..., help="prefill | decode"),
    replicas: int = typer.Argument(..., min=1, help="How many instances the pool should have"),
    conductor: Optional[str] = ConductorOpt,
    token_file: Optional[Path] = OperatorOpt,
    wait: bool = typer.Option(
        True,
        "--wait/--no-wait",
        help="Wait until the pool has exactly that many (started ones ready, drained ones gone)",
    ),
    timeout: float = typer.Option(300.0, "--timeout", help="Seconds to wait"),
) -> None:
    """Scale a pool: start instances through the pool provider, or drain the least busy and stop them once idle."""
    if role not in ROLES:
        err.print(f"[red]error:[/red] role must be prefill or decode, not {role!r}")
        raise typer.Exit(2)
    address = conductor_address(conductor)
    stub = _stub(address)
    r = _call(
        stub.ScalePool, pb.ScalePoolRequest(role=ROLES[role], replicas=replicas), address, operator_token(token_file)
    )
    console.print(
        f"{role}: {r.alive} -> {replicas} ({r.provider} provider)"
        + (f"; starting {', '.join(r.started)}" if r.started else "")
        + (f"; draining {', '.join(r.draining)}" if r.draining else "")
    )
    if not wait:
        return
    deadline = time.monotonic() + timeout
    with console.status(f"waiting for {replicas} {role} instances"):
        while True:
            listing = _call(stub.ListInstances, pb.ListInstancesRequest(role=ROLES[role]), address)
            alive = [i for i in listing.instances if i.state == pb.ALIVE]
            leaving = [i for i in listing.instances if i.state == pb.DRAINING]
            if len(alive) == replicas and not leaving:
                break
            if time.monotonic() > deadline:
                err.print(f"[red]error:[/red] after {timeout:.0f} s: {len(alive)} alive, {len(leaving)} still draining")
                raise typer.Exit(1)
            time.sleep(0.5)
    console.print(f"{role} pool: {replicas} alive ({', '.join(sorted(i.id for i in alive))})")


@app.command("drain")
def drain(
    instance: str = typer.Argument(
        ...,
        help="An instance id (`mooncake status` lists them). A pool node goes with the prefill workers on it; its "
        "blocks are copied to the nodes that stay before it stops",
    ),
    conductor: Optional[str] = ConductorOpt,
    token_file: Optional[Path] = OperatorOpt,
    remove: bool = typer.Option(
        True, "--remove/--keep", help="Stop it once idle (needs a pool provider) or keep it drained"
    ),
) -> None:
    """Send an instance no new work; let what it runs finish; then (by default) stop it.

    A pool node (kv0) is drained with the prefill workers on it. Once they are idle, the Conductor has the nodes that
    stay copy the chains it holds (as much as their free DRAM takes), stops reading from it, and stops it when no read
    holds it; the prompts it held are served from the copies."""
    address = conductor_address(conductor)
    r = _call(_stub(address).Drain, pb.DrainRequest(id=instance, remove=remove), address, operator_token(token_file))
    console.print(f"{instance}: {pb.InstanceState.Name(r.state).lower()}" + (" (stopped once idle)" if remove else ""))
