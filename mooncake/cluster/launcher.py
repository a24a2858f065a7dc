"""LocalCluster: the whole system as processes on this machine (what ``mooncake up`` runs).

    conductor --- kvstore kv0 .. kv{P-1}  (one pool node per prefill worker, DRAM in /dev/shm)
              --- prefill-0 .. prefill-{P-1}  (each on its own node)
              --- decode-0 .. decode-{D-1}
              --- gateway (OpenAI HTTP on --port)

Every component is its own process (``python -m conductor|kvstore|prefill|decode``,
``python -m mooncake.gateway``), started in dependency order; each prints ``READY
{json}`` on stdout when it serves, and its log goes to ``<workdir>/logs/<name>.log``.
Ports are chosen up front, so a component that dies is restarted on the same port
(``supervise``): its peers reconnect and it registers with the Conductor again.
``stop`` sends SIGTERM to everything (workers drain and deregister) and SIGKILL to
whatever is still there after the grace period.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path

from conductor.auth import write_token_file
from mooncake import tls
from mooncake.budgets import default_batched_tokens
from mooncake.cluster.component import Component, ComponentRefused, tail  # noqa: F401 - ComponentRefused: callers'
from mooncake.cluster.components import component_argv
from mooncake.cluster.config import ClusterConfig
from mooncake.localproc import free_port

log = logging.getLogger(__name__)


class LocalCluster:
    """Start with ``start()``, stop with ``stop()``; ``endpoint`` is the OpenAI base URL once started."""

    def __init__(self, config: ClusterConfig, on_event: Callable[[str], None] | None = None) -> None:
        self.config = config
        self.on_event = on_event or (lambda msg: log.info("%s", msg))
        run = f"{int(time.time())}-{os.getpid()}"
        self.run_dir = Path(config.workdir) / run
        self.operator_token_file = self.run_dir / "operator-token"  # the admin calls' credential (conductor.auth)
        self.operator_token: str | None = None
        self.tls_dir: Path | None = None  # the components' certificates (mooncake.tls); None: --insecure
        self.shm_dir = f"/dev/shm/mooncake-{run}"
        self.components: dict[str, Component] = {}
        self._stop = threading.Event()
        self._supervisor: threading.Thread | None = None
        self.net = None
        if config.network_hosts:
            from mooncake.cluster.netns import VirtualNetwork

            self.net = VirtualNetwork()
        self.root_host = self.net.gateway_ip if self.net is not None else config.host  # the Conductor's and gateway's
        self.hosts: dict[str, str] = {}  # component -> the network host it runs on (network_hosts)
        self._stage_servers: dict[int, list[Component]] = {}  # group prefill-i -> its stage servers (network_hosts)
        h = self.root_host
        self.ports = {"conductor": free_port(h), "gateway": config.port or free_port(h), "control": free_port(h)}
        for i in range(1, config.conductors):
            self.ports[f"conductor-{i}"] = free_port(h)
        self._block_bytes = config.block_bytes()
        self._control = None  # the control endpoint the Conductor's local pool provider calls (start())
        self._next: dict[str, int] = {}
        self._lock = threading.Lock()

    # -- argv of each component ---------------------------------------------------------------
    # Each component's argv is rendered from its own parser (mooncake.cliargs.to_argv, by the flags' dests), which
    # reads its flags off the component's config model: the launcher names the values it sets, never a flag.

    def _python(self, component: str, on: str | None = None, **values) -> list[str]:
        """Start ``component`` with ``values`` as its flags, on network host ``on`` (network_hosts)."""
        argv = component_argv(component, **values)
        return self.net.wrap(on, argv) if self.net is not None and on is not None else argv

    def _host(self, host: str, *components: str) -> str:
        """The address of network host ``host`` (the root's without network_hosts), where ``components`` run."""
        if self.net is None:
            return self.root_host
        for name in components:
            self.hosts[name] = host
        new = host not in self.net.hosts
        address = self.net.add_host(host)
        if new and self.config.link_mbit:
            self.net.shape(host, self.config.link_mbit)
        return address

    def _port(self, name: str, host: str) -> int:
        """``name``'s port: free on the root host; on a network host of its own any port is free."""
        if name not in self.ports:
            self.ports[name] = free_port(host) if self.net is None else 7100 + len(self.ports)
        return self.ports[name]

    def _engine(self) -> dict:
        """The engine's flags every worker gets."""
        c = self.config
        return dict(
            model=c.model,
            dtype=c.dtype,
            kv_cache_dtype=c.kv_cache_dtype,
            pool_kv_dtype=c.pool_kv_dtype,
            block_size=c.block_size,
            device=c.device,
            max_model_len=c.max_model_len,
            max_num_batched_tokens=c.max_num_batched_tokens,
            threads=c.threads,
            engine=c.engine,
            enforce_eager=c.enforce_eager,
            gpu_memory_utilization=c.gpu_memory_utilization,
            vllm_arg=list(c.vllm_args),
        )

    def _chunk(self) -> int:
        c = self.config
        return c.max_num_batched_tokens or default_batched_tokens(c.device)

    def _worker_env(self) -> dict[str, str] | None:
        """A vLLM worker's environment: tcmalloc and Intel OpenMP preloaded where present (vLLM's CPU guide); with
        ``threads`` set, that many OpenMP threads, idle ones asleep after 5 ms as vLLM sets up its own workers.

        vLLM applies its CPU thread binding (VLLM_CPU_OMP_THREADS_BIND) only to the worker processes its
        multiprocessing executor starts; a worker hosts vLLM in its own process, where OpenMP's defaults would
        give every engine a thread per core, spinning 200 ms after each parallel region (Intel OpenMP).
        """
        c = self.config
        if c.engine != "vllm":
            return None
        from mooncake.vllm_engine import cpu_preload

        env = {}
        if preload := cpu_preload():
            env["LD_PRELOAD"] = preload
        if c.threads:
            env.update(OMP_NUM_THREADS=str(c.threads), KMP_BLOCKTIME="5", KMP_TPAUSE="0")
        return env or None

    def _conductor(self, i: int = 0) -> Component:
        """The Conductor (``conductor``), or standby ``conductor-{i}``."""
        c, h = self.config, self.root_host
        name = "conductor" if i == 0 else f"conductor-{i}"
        scheme = "https" if self.tls_dir else "http"
        provider = dict(pool_provider="local", pool_control=f"{scheme}://{h}:{self.ports['control']}")
        argv = self._python(
            "conductor",
            host=h,
            port=self.ports[name],
            metrics_port=0,
            policy=c.policy,
            admission=c.admission,
            local_prefill=c.local_prefill,
            narrow_handoff=c.narrow_handoff,
            block_bytes=self._block_bytes,  # as the chart gives it: the pool nodes' own, before any registers
            ttft_slo=c.ttft_slo_s,
            tbt_slo=c.tbt_slo_s,
            slo_class=list(c.slo_classes),
            redis_url=c.redis_url,
            **(provider if self._control else {}),
            **(self._planner_flags() if c.planner != "off" else {}),
            operator_token_file=self.operator_token_file,
            prediction_log=self.run_dir / "logs" / f"{name}-predictions.jsonl",  # conductor.audit
        )
        return Component(name, argv, self.run_dir / "logs" / f"{name}.log", nice=c.control_nice)

    def _planner_flags(self) -> dict:
        c = self.config
        return dict(
            planner=c.planner,
            planner_interval=c.planner_interval_s,
            planner_max_prefill=c.planner_max,
            planner_max_decode=c.planner_max,
        )

    def _prefill_pair(self, i: int) -> tuple[Component, Component]:
        """Pool node ``kv{i}`` and ``prefill-{i}`` on it (one host, ``p{i}``)."""
        c, h = self.config, self._host(f"p{i}", f"kv{i}", f"prefill-{i}")
        port = self._port(f"kv{i}", h)
        ssd = dict(ssd_dir=self.run_dir / f"ssd-kv{i}", ssd_mib=c.pool_ssd_mib) if c.pool_ssd_mib else {}
        node = Component(
            f"kv{i}",
            self._python(
                "kvstore",
                on=f"p{i}",
                node=f"kv{i}",
                host=h,
                port=port,
                block_bytes=self._block_bytes,
                dram_mib=c.pool_dram_mib,
                shm_dir=self.shm_dir,
                conductor=self.conductor_addresses,
                metrics_port=0,
                hand_off_s=0,  # the Conductor hands a node off before the launcher stops it (scaling down)
                **ssd,
            ),
            self.run_dir / "logs" / f"kv{i}.log",
            nice=c.worker_nice,
        )
        group = dict(pipeline_stages=c.group_size) if i < c.prefill_groups else {}
        if group and self.net is not None:  # each stage a server on a network host of its own
            stages = [self._stage_server(i, j) for j in range(c.group_size)]
            self._stage_servers[i] = [comp for comp, _ in stages]
            group = dict(stage_addresses=",".join(address for _, address in stages), stage_key_file=self._stage_key())
        prefill = Component(
            f"prefill-{i}",
            self._python(
                "prefill",
                on=f"p{i}",
                id=f"prefill-{i}",
                kvstore=f"{h}:{port}",
                conductor=self.conductor_addresses,
                host=h,
                port=self._port(f"prefill-{i}", h),
                kv_cache_memory_gib=c.prefill_kv_memory_gib,
                tensor_parallel_size=c.prefill_tp,
                **self._engine(),
                **group,
            ),
            self.run_dir / "logs" / f"prefill-{i}.log",
            env=self._worker_env(),
            nice=c.worker_nice,
        )
        return node, prefill

    def _stage_server(self, i: int, j: int) -> tuple[Component, str]:
        """Stage ``j`` of group ``prefill-{i}`` as a stage server on host ``p{i}s{j}``, and the address its worker
        dials."""
        c, name = self.config, f"prefill-{i}-stage{j}"
        h = self._host(f"p{i}s{j}", name)
        port = self._port(name, h)
        comp = Component(
            name,
            self._python(
                "prefill-stage",
                on=f"p{i}s{j}",
                model=c.model,
                stage=j,
                stages=c.group_size,
                host=h,
                port=port,
                key_file=self._stage_key(),
                dtype=c.dtype,
                block_size=c.block_size,
                chunk=self._chunk(),
                shm_dir=self.shm_dir,
                max_model_len=c.max_model_len,
                device=c.device,
            ),
            self.run_dir / "logs" / f"{name}.log",
            nice=c.worker_nice,
        )
        return comp, f"{h}:{port}"

    def _stage_key(self) -> Path:
        """The groups' key (random, made once per run directory, readable by its owner only)."""
        path = self.run_dir / "stage.key"
        if not path.exists():
            path.touch(mode=0o600)
            path.write_text(os.urandom(32).hex())
        return path

    def _decode(self, i: int) -> Component:
        c, h = self.config, self._host(f"d{i}", f"decode-{i}")
        return Component(
            f"decode-{i}",
            self._python(
                "decode",
                on=f"d{i}",
                id=f"decode-{i}",
                conductor=self.conductor_addresses,
                host=h,
                port=self._port(f"decode-{i}", h),
                max_num_seqs=c.decode_max_seqs,
                kv_cache_memory_gib=c.decode_kv_memory_gib,
                tensor_parallel_size=c.decode_tp,
                tbt_slo=c.tbt_slo_s,
                detect_s=c.detect_s,
                shm_dir=self.shm_dir,
                **self._engine(),
            ),
            self.run_dir / "logs" / f"decode-{i}.log",
            env=self._worker_env(),
            nice=c.worker_nice,
        )

    def _gateway(self) -> Component:
        c = self.config
        argv = self._python(
            "gateway",
            conductor=self.conductor_addresses,
            model=c.model,
            model_name=c.model_name,
            host=self.root_host,
            port=self.ports["gateway"],
            dtype=c.dtype,
            kv_cache_dtype=c.kv_cache_dtype,
            pool_kv_dtype=c.pool_kv_dtype,
            block_size=c.block_size,
            engine=c.engine,
            retry_budget_s=c.ttft_slo_s,
            hold_s=c.hold_s,
            detect_s=c.detect_s,
            max_model_len=c.max_model_len,
            api_key=c.api_key,
            tenants=None if c.api_key else c.tenants_file,
            reasoning_parser=c.reasoning_parser.value,
            tool_call_parser=c.tool_call_parser.value,
        )
        return Component("gateway", argv, self.run_dir / "logs" / "gateway.log", nice=c.control_nice)

    def _plan(self) -> list[list[Component]]:
        """The components in start order: waves that may start together."""
        pairs = [self._prefill_pair(i) for i in range(self.config.prefill)]
        decodes = [self._decode(i) for i in range(self.config.decode)]
        self._next = {"prefill": self.config.prefill, "decode": self.config.decode}
        standbys = [self._conductor(i) for i in range(1, self.config.conductors)]  # after the first: it leads
        stage_servers = [comp for comps in self._stage_servers.values() for comp in comps]
        waves = [[self._conductor()], standbys + [n for n, _ in pairs] + stage_servers, [p for _, p in pairs] + decodes]
        if self.config.gateway:
            waves.append([self._gateway()])
        return waves

    # -- lifecycle ----------------------------------------------------------------------------------

    def start(self) -> "LocalCluster":
        """Start every component, wave by wave, waiting for each wave's READY lines. Raises RuntimeError on failure."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.operator_token = write_token_file(self.operator_token_file)
        self._use_tls()
        from mooncake.cluster.control import start_control_server

        self._control = start_control_server(self, self.root_host, self.ports["control"])
        try:
            for wave in self._plan():
                for comp in wave:
                    self.components[comp.name] = comp
                    comp.start()
                    self.on_event(f"started {comp.name} (pid {comp.proc.pid})")
                for comp in wave:
                    comp.wait_ready(self.config.ready_timeout_s)
                    self.on_event(f"{comp.name} ready: {comp.info.get('grpc') or comp.info.get('http') or ''}")
            self._wait_registered()
        except BaseException:
            self.stop()
            raise
        if self.config.restart:
            self._supervisor = threading.Thread(target=self._supervise, name="cluster-supervisor", daemon=True)
            self._supervisor.start()
        return self

    def _use_tls(self) -> None:
        """Pick the components' identity: ``$MOONCAKE_TLS_DIR`` when set, else a CA and certificate made in the run
        directory; this process (which calls the Conductor) and every component use it. ``insecure``: none at all."""
        if self.config.insecure:
            if os.environ.get(tls.ENV_DIR):
                raise RuntimeError(f"--insecure, but {tls.ENV_DIR} is set in this environment: unset it first")
            self.on_event("INSECURE: no TLS between the components; anyone who can reach their ports can call them")
            return
        given = os.environ.get(tls.ENV_DIR)
        self.tls_dir = Path(given) if given else tls.generate(self.run_dir / "tls").directory
        tls.Identity.load(self.tls_dir)  # a clear error now rather than in every component's log
        os.environ[tls.ENV_DIR] = str(self.tls_dir)  # inherited by every component this process starts

    def _wait_registered(self) -> None:
        """Until the Conductor lists every worker and pool node alive (they register right after READY)."""
        import grpc

        from protos import conductor_pb2 as cpb
        from protos import conductor_pb2_grpc as cpb_grpc

        want = self.config.prefill * 2 + self.config.decode
        deadline = time.monotonic() + 30
        addresses = self.conductor_addresses.split(",")
        with contextlib.ExitStack() as channels:
            stubs = [cpb_grpc.ConductorStub(channels.enter_context(tls.grpc_channel(a))) for a in addresses]
            while True:
                alive = 0
                for stub in stubs:  # whichever leads
                    try:
                        listing = stub.ListInstances(cpb.ListInstancesRequest(), timeout=5)
                    except grpc.RpcError:
                        continue
                    alive = sum(1 for i in listing.instances if i.state == cpb.ALIVE)
                    break
                if alive >= want:
                    return
                if time.monotonic() > deadline:
                    raise RuntimeError(f"only {alive} of {want} instances registered with the Conductor within 30 s")
                time.sleep(0.1)

    def _supervise(self) -> None:
        while not self._stop.wait(0.5):
            with self._lock:
                comps = list(self.components.values())
            for comp in comps:
                if comp.alive or comp.stopping or comp.proc is None or self._stop.is_set():
                    continue  # (never started yet: a scale-up's thread is starting it and says if that fails)
                code = comp.proc.returncode if comp.proc else None
                comp.restarts += 1
                delay = min(30.0, 2.0 ** min(comp.restarts, 5) / 4)
                self.on_event(f"{comp.name} exited ({code}); restarting in {delay:.1f} s (restart {comp.restarts})")
                if self._stop.wait(delay):
                    return
                self._bring_up(comp, "is back", "did not come back")

    # -- scaling (the Conductor's local pool provider calls these through mooncake.cluster.control) ---------

    def add(self, role: str, count: int) -> list[str]:
        """Start ``count`` more prefill workers (each with its pool node) or decode workers; return their names.

        Returns at once: they register with the Conductor when ready (the supervisor
        restarts one that fails to start).
        """
        if role not in ("prefill", "decode") or count < 1:
            raise ValueError(f"add needs role prefill or decode and a positive count, got {role!r}, {count}")
        started = []
        for _ in range(count):
            with self._lock:
                i = self._next[role]
                self._next[role] = i + 1
            comps = list(self._prefill_pair(i)) if role == "prefill" else [self._decode(i)]
            started.append(comps[-1].name)
            threading.Thread(
                target=self._start_chain, args=(comps,), name=f"start-{comps[-1].name}", daemon=True
            ).start()
        return started

    def _start_chain(self, comps: list[Component]) -> None:
        """Start components one after another (a pool node before its prefill worker)."""
        for comp in comps:
            with self._lock:
                self.components[comp.name] = comp
            if not self._bring_up(comp, "ready (scaled up)", "did not start"):
                return

    def _bring_up(self, comp: Component, ready: str, failed: str) -> bool:
        """Start ``comp`` and wait for its READY line; say which way it went (``ready`` / ``failed: why``)."""
        try:
            comp.start()
            comp.wait_ready(self.config.ready_timeout_s)
        except RuntimeError as e:
            self.on_event(f"{comp.name} {failed}: {e}")
            return False
        self.on_event(f"{comp.name} {ready}")
        return True

    def remove(self, name: str, grace_s: float = 60.0) -> None:
        """Stop worker ``name`` (SIGTERM: it finishes what it runs and deregisters), and a prefill worker's pool
        node."""
        comp = self.components.get(name)
        if comp is None or not (name.startswith("prefill-") or name.startswith("decode-")):
            raise ValueError(f"no worker {name!r} in this cluster")
        chain = [comp]
        if name.startswith("prefill-"):
            node = self.components.get(f"kv{name.removeprefix('prefill-')}")
            if node is not None:
                chain.append(node)
        for c in chain:
            c.terminate()
            deadline = time.monotonic() + grace_s
            while c.alive and time.monotonic() < deadline:
                time.sleep(0.05)
            c.kill()
            with self._lock:
                self.components.pop(c.name, None)
            self.on_event(f"{c.name} stopped (scaled down)")

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM everything (gateway and workers first), wait up to ``grace_s``, SIGKILL the rest."""
        self._stop.set()
        if self._control is not None:
            self._control.shutdown()
            self._control = None
        with self._lock:
            comps = list(self.components.values())
        order = sorted(
            comps,
            key=lambda c: ("gateway", "decode", "prefill", "kv", "conductor").index(
                next(p for p in ("gateway", "decode", "prefill", "kv", "conductor") if c.name.startswith(p))
            ),
        )
        for comp in order:
            comp.terminate()
        deadline = time.monotonic() + grace_s
        for comp in order:
            while comp.alive and time.monotonic() < deadline:
                time.sleep(0.05)
            if comp.alive:
                self.on_event(f"{comp.name} did not stop in {grace_s:.0f} s: killing it")
            comp.kill()

        shutil.rmtree(self.shm_dir, ignore_errors=True)
        if self.net is not None:
            self.net.close()

    # -- where things are ---------------------------------------------------------------------------

    @property
    def conductor_address(self) -> str:
        """The first Conductor's (the only one, unless --conductors)."""
        return f"{self.root_host}:{self.ports['conductor']}"

    @property
    def conductor_addresses(self) -> str:
        """Every Conductor's address, comma-separated: what gateways and workers are given (they follow the leader)."""
        names = ["conductor"] + [f"conductor-{i}" for i in range(1, self.config.conductors)]
        return ",".join(f"{self.root_host}:{self.ports[n]}" for n in names)

    @property
    def endpoint(self) -> str:
        return f"http://{self.root_host}:{self.ports['gateway']}/v1"

    def address(self, name: str) -> str:
        """``host:port`` of component ``name``'s gRPC service."""
        host = self.hosts.get(name)
        return f"{self.net.hosts[host] if host is not None else self.root_host}:{self.ports[name]}"

    def cut(self, name: str) -> None:
        """Take the network host of component ``name`` off the network (network_hosts only); ``heal`` undoes it."""
        self._network().cut(self.hosts[name])

    def heal(self, name: str) -> None:
        self._network().heal(self.hosts[name])

    def _network(self):
        if self.net is None:
            raise ValueError("the cluster has no network hosts (network_hosts=False)")
        return self.net

    def component(self, name: str) -> Component:
        return self.components[name]
