"""ClusterConfig: what ``mooncake up`` starts (how many of each component, the engine, SLOs, ports, TLS), checked
as a whole before anything starts, with the settings it derives (threads per computing process, block size and
bytes)."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, Field, field_validator, model_validator

from conductor.admission import AdmissionKind
from conductor.config import ConductorConfig
from conductor.local import LocalPrefill
from conductor.policies import PolicyKind
from conductor.types import DEFAULT_SLO
from decode.config import DECODE_ENGINE_DEFAULTS
from mooncake.engine.config import EngineConfig
from mooncake.engine.interface import EngineKind, parse_vllm_args
from mooncake.gateway.reasoning import ReasoningParser
from mooncake.gateway.recovery import RecoveryConfig
from mooncake.gateway.tool_parsers import ToolCallParser
from mooncake.localproc import usable_cpus
from mooncake.runtime.channels import DETECT_S, LOCAL_HOST
from prefill.config import PREFILL_ENGINE_DEFAULTS

_ENGINE = EngineConfig.model_fields
_CONDUCTOR = ConductorConfig.model_fields


class ClusterConfig(BaseModel):
    """What ``mooncake up`` starts (its flags fill this)."""

    model: str = Field(description="model directory")
    model_name: str = Field(description="the name clients send as `model`")
    prefill: int = Field(1, ge=1, description="Prefill workers (each gets its own pool node)")
    prefill_groups: int = Field(
        0,
        ge=0,
        description="Of the prefill workers, this many run as pipelined groups (chunked pipeline parallelism): "
        "the model's layers split over --group-size stage processes, one core each; long prompts go there",
    )
    group_size: int = Field(2, ge=2, description="Stage processes per pipelined prefill group")
    decode: int = Field(1, ge=1, description="Decode workers")
    prefill_tp: int = Field(
        1,
        ge=1,
        le=64,
        description="Tensor-parallel ranks of each prefill worker, a process a rank (our engine: rank r on cuda:r past "
        "the worker's device, gloo ranks sharing the cores on the CPU; vLLM: its tensor_parallel_size)",
    )
    decode_tp: int = Field(1, ge=1, le=64, description="Tensor-parallel ranks of each decode worker (as --prefill-tp)")
    host: str = Field(LOCAL_HOST, description="Address every component binds")
    port: int = Field(8000, ge=0, le=65535, description="The gateway's HTTP port (0: any free port)")
    api_key: str | None = Field(None, description="Require `Authorization: Bearer <key>` on /v1/*")
    tenants_file: Path | None = Field(
        None,
        description="API keys by tenant (YAML or JSON), instead of --api-key: each tenant "
        "gets a KV cache of its own and its own rate limit and cap on requests in flight",
    )
    redis_url: str | None = Field(None, description="Persist the Conductor's registry and settings here")
    workdir: Path = Field(
        default_factory=lambda: Path.home() / ".cache" / "mooncake" / "run", description="Logs (and SSD files) go here"
    )
    dtype: str = Field(_ENGINE["dtype"].default, description="Workers' dtype (float32, bfloat16 or float16)")
    kv_cache_dtype: str = Field(
        _ENGINE["kv_cache_dtype"].default,
        pattern="^(auto|fp8|fp8_e4m3)$",
        description="What the workers' KV caches, the pool and the hand-offs keep K and V in: auto (the dtype "
        "above) or fp8 (float8 e4m3, a per-layer scale: a quarter of float32's bytes, half of bfloat16's)",
    )
    pool_kv_dtype: str = Field(
        _ENGINE["pool_kv_dtype"].default,
        pattern="^(auto|fp8|fp8_e4m3)$",
        description="What the pool's blocks keep K and V in where the caches keep them wider: auto (as the caches) "
        "or fp8 (float8 e4m3 at scale 1.0, converted as blocks go into and out of the pool: 4x float32's tokens in the "
        "same pool DRAM, and a prefix fetched from another node moves a quarter of the bytes); our engine only",
    )
    device: str = Field(
        _ENGINE["device"].default,
        pattern=r"^(cpu|cuda(:\d+)?)$",
        description="Native workers' device: cpu, or cuda[:N] (every worker on that GPU; a pipelined group's stages "
        "spread over the GPUs with plain `cuda`)",
    )
    engine: str = Field(
        EngineKind.NATIVE.value,
        pattern="^(native|vllm)$",
        description="Workers' engine: native (ours) or vllm (stock vLLM, installed with the project's `vllm` extra)",
    )
    vllm_args: list[str] = Field(
        default_factory=list,
        description="KEY=VALUE vLLM engine argument for every worker, repeatable "
        "(e.g. enforce_eager=true, gpu_memory_utilization=0.85)",
    )
    block_size: int | None = Field(None, ge=1, description="Tokens per KV block [default: 16 native, 32 vllm]")
    pool_dram_mib: int = Field(1024, ge=1, description="DRAM tier of each pool node (MiB)")
    pool_ssd_mib: int = Field(0, ge=0, description="SSD tier of each pool node (MiB; 0: none)")
    max_model_len: int | None = Field(None, description="Context limit [default: the model's]")
    max_num_batched_tokens: int | None = Field(
        None,
        ge=1,
        description="every worker engine's token budget per step (a prefill group's chunk; the prompt chunk a decode "
        "worker computes itself). " + str(EngineConfig.model_fields["max_num_batched_tokens"].description),
    )
    enforce_eager: bool = Field(
        False,
        description="Native workers on CUDA: run every step eagerly, without capturing decode steps as CUDA graphs",
    )
    decode_max_seqs: int = Field(
        DECODE_ENGINE_DEFAULTS["max_num_seqs"], ge=1, description="Requests each decode worker runs at once, at most"
    )
    gpu_memory_utilization: float = Field(
        EngineConfig.model_fields["gpu_memory_utilization"].default,
        gt=0,
        le=1,
        description="Native workers on CUDA: the fraction of each GPU a worker's engine takes (weights, activations, "
        "KV cache: vLLM's meaning); its KV cache is what is left",
    )
    decode_kv_memory_gib: float = Field(
        DECODE_ENGINE_DEFAULTS["kv_cache_memory_gib"],
        gt=0,
        description="On the CPU, each decode worker's KV cache in GiB (at most decode-max-seqs full-length sequences)",
    )
    prefill_kv_memory_gib: float = Field(
        PREFILL_ENGINE_DEFAULTS["kv_cache_memory_gib"],
        gt=0,
        description="On the CPU, each prefill worker's KV cache in GiB (at most its batch of full-length prompts)",
    )
    reasoning_parser: ReasoningParser = Field(
        ReasoningParser.AUTO, description="The gateway's split of reasoning into reasoning_content (gateway --help)"
    )
    tool_call_parser: ToolCallParser = Field(
        ToolCallParser.AUTO, description="The format the gateway reads tool calls in (gateway --help)"
    )
    threads: int | None = Field(
        None,
        ge=1,
        description="torch threads per worker [default on the CPU: the usable cores shared evenly among the processes "
        "that compute (prefill and decode workers, a pipelined group's stages), at least 1; on CUDA: torch's]",
    )
    policy: PolicyKind = Field(_CONDUCTOR["policy"].default, description="Prefill placement policy")
    admission: AdmissionKind = Field(
        _CONDUCTOR["admission"].default, description="Admission (early rejection) policy (conductor.admission)"
    )
    local_prefill: LocalPrefill = Field(
        _CONDUCTOR["local_prefill"].default,
        description="where prompts are computed: auto (whichever is predicted sooner; conductor.local), "
        "never (a prefill worker) or always (the decode worker itself)",
    )
    narrow_handoff: str = Field(
        _CONDUCTOR["narrow_handoff"].default,
        pattern="^(auto|always|never)$",
        description="with --pool-kv-dtype: whether a prompt's KV moves to its decode worker in the pool's dtype: auto "
        "(between hosts, when predicted sooner at the learnt bandwidth), always or never",
    )
    planner: str = Field(
        "off",
        pattern="^(off|act|advise)$",
        description="The Conductor's capacity planner: act (scale the prefill and decode pools to its plans every "
        "interval), advise (plan and export them, scale nothing) or off (`mooncake plan` still asks for one)",
    )
    planner_interval_s: float = Field(30.0, gt=0, description="Seconds between the planner's plans")
    planner_max: int = Field(4, ge=1, description="The most instances the planner runs in each of the two pools")
    ttft_slo_s: float = Field(DEFAULT_SLO.ttft_s, gt=0, description="TTFT SLO in seconds")
    tbt_slo_s: float = Field(
        DEFAULT_SLO.tbt_s, gt=0, description="TBT SLO in seconds (CPU decode steps are tens of ms)"
    )
    slo_classes: list[str] = Field(
        default_factory=list,
        description="Another SLO class NAME=TTFT,TBT in seconds, repeatable (e.g. batch=120,0.5): a request names "
        "its class in its body (slo_class; 'default' is --ttft-slo and --tbt-slo's)",
    )
    gateway: bool = Field(True, description="Start the OpenAI gateway (off: the cluster without its front door)")
    restart: bool = Field(True, description="restart a component that dies")
    hold_s: float = Field(
        RecoveryConfig.model_fields["hold_s"].default,
        ge=0,
        description="Seconds the gateway holds a request while the Conductor (or every worker of a role) is away, "
        "before answering 503",
    )
    network_hosts: bool = Field(
        False,
        description="put each prefill worker (with its pool node) and each decode worker "
        "on a network host of its own (a namespace on a bridge; root only), so links can be cut",
    )
    link_mbit: float | None = Field(
        None,
        gt=0,
        description="with network_hosts: each host's link limited to this many megabits a second each way (tc "
        "tbf), as a real network's bandwidth; none: the bridge's own (memory speed)",
    )
    detect_s: float = Field(
        DETECT_S,
        gt=0,
        description="a worker silent this long on a live connection (a host off the "
        "network) is taken for dead by its callers",
    )
    conductors: int = Field(
        1,
        ge=1,
        le=5,
        description="Conductors; more than one needs --redis-url: one leads, the others stand by and take over when "
        "it dies",
    )
    insecure: bool = Field(
        False,
        description="No TLS between the components (development only). By default they present certificates from "
        "a CA made in the run directory (or $MOONCAKE_TLS_DIR's) and refuse any peer without one",
    )
    ready_timeout_s: float = Field(
        180.0, gt=0, description="Seconds each component has to print READY before `mooncake up` gives up"
    )
    worker_nice: int = Field(
        0,
        ge=0,
        le=19,
        description="Run the workers and pool nodes this much below normal CPU priority (nice, and the same for the "
        "session each runs in, which the kernel's autogroups schedule as one). 0: as a client on the same cores "
        "runs (at nice 10, a load generator such as aiperf starved them: 0.23x the goodput of nice 0)",
    )
    control_nice: int = Field(
        -10,
        ge=-20,
        le=0,
        description="Run the Conductor and the gateway this much above normal CPU priority where the kernel allows it "
        "(root or CAP_SYS_NICE; elsewhere at normal priority), so that decisions and refusals stay fast however busy "
        "the workers and a client on the same cores are",
    )

    @field_validator("slo_classes")
    @classmethod
    def _slo_classes(cls, specs: list[str]) -> list[str]:
        for spec in specs:
            name, _, values = spec.partition("=")
            try:
                ttft, tbt = (float(v) for v in values.split(","))
            except ValueError:
                raise ValueError(f"{spec!r} is not NAME=TTFT,TBT (seconds), such as batch=120,0.5") from None
            if not name or name == "default" or ttft <= 0 or tbt <= 0:
                raise ValueError(f"{spec!r}: a name other than 'default' and two positive numbers of seconds")
        return specs

    @model_validator(mode="after")
    def _one_way_in(self) -> "ClusterConfig":
        if self.api_key and self.tenants_file:
            raise ValueError("give --api-key or --tenants, not both (a tenants file can hold any number of keys)")
        return self

    @model_validator(mode="after")
    def _standbys_need_redis(self) -> "ClusterConfig":
        if self.conductors > 1 and not self.redis_url:
            raise ValueError("standby Conductors elect their leader in Redis: give --redis-url with --conductors > 1")
        return self

    @model_validator(mode="after")
    def _groups_fit(self) -> "ClusterConfig":
        if self.prefill_groups > self.prefill:
            raise ValueError(
                f"--prefill-groups {self.prefill_groups} exceeds the {self.prefill} prefill workers: the groups "
                "are the first of them (add --prefill)"
            )
        if self.prefill_groups and self.engine != "native":
            raise ValueError("pipelined prefill groups run the native engine")
        return self

    @model_validator(mode="after")
    def _link(self) -> "ClusterConfig":
        if self.link_mbit is not None and not self.network_hosts:
            raise ValueError("--link-mbit shapes the links of network hosts: it needs --network-hosts")
        return self

    @model_validator(mode="after")
    def _ranks_fit(self) -> "ClusterConfig":
        if self.prefill_tp > 1 and self.prefill_groups:
            raise ValueError("--prefill-tp above 1 and pipelined prefill groups (--prefill-groups) do not combine yet")
        return self

    @model_validator(mode="after")
    def _kv_dtype_fits(self) -> "ClusterConfig":
        if self.pool_kv_dtype != "auto":
            if self.kv_cache_dtype != "auto":
                raise ValueError("--pool-kv-dtype with --kv-cache-dtype fp8: the pool keeps what an fp8 cache keeps")
            if self.engine != "native" or self.prefill_groups:
                raise ValueError(
                    f"--pool-kv-dtype {self.pool_kv_dtype}: our engine's workers only (not vLLM's, nor pipelined "
                    "prefill groups) for now"
                )
        if self.kv_cache_dtype == "auto":
            return self
        if self.prefill_groups:
            raise ValueError(f"--kv-cache-dtype {self.kv_cache_dtype} and pipelined prefill groups do not combine yet")
        return self

    @model_validator(mode="after")
    def _threads(self) -> "ClusterConfig":
        """No ``threads`` on the CPU: each computing process gets its share of the usable cores. torch's own default, a
        thread per core in every process, oversubscribes them as soon as two workers compute at once (2P+1D on 2
        cores: 6 threads), and the client on the same cores waits behind them."""
        if self.threads is None and self.device == "cpu":
            self.threads = max(1, len(usable_cpus()) // self.computing_processes())
        return self

    def computing_processes(self) -> int:
        """The processes that run the model: a prefill worker (a pipelined group's stages, each), a decode worker."""
        return self.prefill - self.prefill_groups + self.prefill_groups * self.group_size + self.decode

    @model_validator(mode="after")
    def _block_size(self) -> "ClusterConfig":
        if self.block_size is None:
            from mooncake.serving.worker_args import default_block_size

            self.block_size = default_block_size(self.engine)
        return self

    def block_bytes(self) -> int:
        """Bytes of one block in the pool layout and dtype, as the workers' engine will lay the model out (the pool
        nodes are sized by it before any worker starts): ours by its own model arguments, vLLM by its reading of the
        model (imports vLLM: seconds). Raises ValueError (one line, naming the model) for a model the engine cannot
        serve or whose KV the pool cannot carry."""
        from mooncake.serving.model_support import kv_layout

        # a size the model does not split into: said before any start
        splits = {flag: n for flag, n in (("--prefill-tp", self.prefill_tp), ("--decode-tp", self.decode_tp)) if n > 1}
        args = parse_vllm_args(self.vllm_args)
        kept = self.kv_cache_dtype if self.pool_kv_dtype == "auto" else self.pool_kv_dtype  # what the pool holds
        return kv_layout(self.engine, self.model, self.dtype, args, splits, kept).block_bytes(self.block_size)
