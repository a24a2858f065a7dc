"""Engine configuration (a pydantic model passed in; nothing is read from the environment)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from mooncake.budgets import CPU_BATCHED_TOKENS, CUDA_BATCHED_TOKENS, default_batched_tokens

if TYPE_CHECKING:
    import torch

# the dtypes an engine runs in, by their names on command lines and in configs (names, not torch's objects: the
# gateway, the launcher and the CLI read this module and do not import torch)
DTYPE_NAMES = ("float32", "bfloat16", "float16")
# vLLM's --kv-cache-dtype names for what a KV cache may hold: auto (the engine's dtype) or fp8 (= fp8_e4m3: float8
# e4m3 with a per-layer scale); FP8_KV is the torch dtype's name, the one block keys and the pool's sizing name
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
FP8_KV = "float8_e4m3fn"


def dtype_of(name: str) -> torch.dtype:
    """The torch dtype of one of ``DTYPE_NAMES``."""
    import torch

    if name not in (*DTYPE_NAMES, FP8_KV):
        raise ValueError(f"dtype {name!r}: one of {', '.join(DTYPE_NAMES)}")
    return getattr(torch, name)


def kv_dtype_name(dtype: str, kv_cache_dtype: str = "auto") -> str:
    """The name of the dtype a cache keeps K and V in: the engine's ``dtype`` for ``auto``, float8 e4m3 for fp8."""
    if kv_cache_dtype == "auto":
        return dtype
    if kv_cache_dtype in KV_CACHE_DTYPES:
        return FP8_KV
    raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r}: one of {', '.join(KV_CACHE_DTYPES)}")


class EngineConfig(BaseModel):
    """Everything one engine instance needs to know; one config per process.

    ``num_kv_blocks`` fixes the paged cache size directly; otherwise it is sized from memory once the model's
    per-block size is known (``gpu_memory_utilization`` on CUDA, ``kv_cache_memory_gib`` on the CPU: kv_sizing.py).
    """

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    model: str = Field(description="Path to a Hugging Face layout model directory")
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="the weights' and the KV cache's")
    kv_cache_dtype: Literal["auto", "fp8", "fp8_e4m3"] = Field(
        "auto",
        description="what the KV cache, the pool and the hand-off keep K and V in (vLLM's flag and meaning): auto, "
        "the dtype above; fp8 (= fp8_e4m3), float8 e4m3 with a per-layer scale (the checkpoint's k_scale and "
        "v_scale, else 1.0): a block holds its tokens in a quarter of float32's bytes, half of bfloat16's",
    )
    pool_kv_dtype: Literal["auto", "fp8", "fp8_e4m3"] = Field(
        "auto",
        description="what the pool's blocks keep K and V in where the cache keeps them wider: auto, as the cache; "
        "fp8 (= fp8_e4m3), float8 e4m3 at scale 1.0, converted as blocks are written and read: the pool holds "
        "4x float32's tokens (2x bfloat16's) and a prefix fetched from another node moves as many fewer bytes",
    )
    device: str = Field(
        "cpu",
        pattern=r"^(cpu|cuda(:\d+)?)$",
        description="native engine: cpu, or cuda[:N] (the KV cache and weights on that GPU; KV leaves it through "
        "pinned host staging on a side stream). vLLM picks its own device",
    )
    block_size: int = Field(
        16,
        ge=1,
        le=1024,
        description="tokens per KV block, the pool's and the Conductor's (a worker's default: 16 native, 32 vllm: "
        "vLLM's CPU attention needs a multiple of 32)",
    )
    num_kv_blocks: int | None = Field(
        None, ge=1, description="the paged cache, in blocks; default: sized from memory (mooncake.engine.kv_sizing)"
    )
    kv_cache_memory_gib: float = Field(
        1.0,
        gt=0,
        description="on the CPU, the KV cache's memory when --num-kv-blocks is not given (no more blocks than "
        "max_num_seqs full-length sequences hold)",
    )
    gpu_memory_utilization: float = Field(
        0.9,
        gt=0,
        le=1,
        description="on CUDA, the fraction of the device's memory this engine may take (weights, activations, "
        "KV cache: vLLM's meaning); the cache gets what the weights and a step leave, when --num-kv-blocks is "
        "not given",
    )
    max_num_seqs: int = Field(64, ge=1, description="most requests in the engine's batch at once")
    max_num_batched_tokens: int | None = Field(
        None,
        ge=1,
        description="Per-step token budget; a longer prompt is prefilled in chunks. Default: "
        f"{CPU_BATCHED_TOKENS} on the CPU, {CUDA_BATCHED_TOKENS} on CUDA (default_batched_tokens)",
    )
    max_model_len: int | None = Field(None, ge=1, description="context limit (default: the model's)")
    enable_prefix_caching: bool = True
    seed: int = 0
    num_threads: int | None = Field(None, ge=1, description="torch threads (default: torch's)")
    tensor_parallel_size: int = Field(
        1,
        ge=1,
        le=64,
        description="split the model over this many ranks, a process each, each holding 1/N of the weights and of "
        "the KV heads (native: gloo on the CPU, NCCL on CUDA, rank r on cuda:r; vLLM: its tensor_parallel_size)",
    )
    use_kernels: bool = Field(True, description="Compile and use the CPU paged decode-attention kernel")
    enforce_eager: bool = Field(
        False,
        description="native engine on CUDA: run every step eagerly, without capturing decode steps as CUDA graphs "
        "(slower decode; for debugging)",
    )
    decode_graphs: bool | None = Field(
        None,
        description="Run decode steps through static buffers captured as CUDA graphs. Default: on for CUDA "
        "unless enforce_eager, off on the CPU, where True runs the same graph-ready step uncaptured (tests)",
    )
    kernel_dir: str = Field("~/.cache/mooncake/kernels", description="Where compiled kernels are cached")
    model_fingerprint: str | None = Field(
        None, description="Identity for block keys; default derived from the model files"
    )

    @model_validator(mode="after")
    def _check(self) -> "EngineConfig":
        if self.device.startswith("cuda") is False and self.device != "cpu":
            raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        if self.device.startswith("cuda"):
            check_cuda_device(self.device)
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = default_batched_tokens(self.device)
        if self.pool_kv_dtype != "auto" and self.kv_cache_dtype != "auto":
            raise ValueError(
                f"pool_kv_dtype {self.pool_kv_dtype} with kv_cache_dtype {self.kv_cache_dtype}: the pool keeps what an "
                "fp8 cache keeps (set one of them)"
            )
        if self.decode_graphs is None:
            self.decode_graphs = self.device.startswith("cuda") and not self.enforce_eager
        elif self.decode_graphs and self.enforce_eager:
            raise ValueError("decode_graphs and enforce_eager contradict each other")
        return self

    @property
    def captures_graphs(self) -> bool:
        """Whether decode steps replay captured CUDA graphs (graph-ready steps on CUDA)."""
        return bool(self.decode_graphs) and self.device.startswith("cuda")

    @property
    def torch_dtype(self) -> torch.dtype:
        return dtype_of(self.dtype)

    @property
    def kv_dtype(self) -> str:
        """The name of the dtype K and V are kept in (``kv_dtype_name``)."""
        return kv_dtype_name(self.dtype, self.kv_cache_dtype)

    @property
    def kv_torch_dtype(self) -> torch.dtype:
        return dtype_of(self.kv_dtype)

    @property
    def pool_dtype(self) -> str:
        """The name of the dtype the pool's blocks keep K and V in (the cache's, unless ``pool_kv_dtype``)."""
        return self.kv_dtype if self.pool_kv_dtype == "auto" else kv_dtype_name(self.dtype, self.pool_kv_dtype)

    @property
    def pool_torch_dtype(self) -> torch.dtype:
        return dtype_of(self.pool_dtype)


def check_cuda_device(device: str) -> None:
    """ValueError, saying what is missing, unless ``device`` (cuda or cuda:N) is a GPU this process can use."""
    import torch

    if not torch.cuda.is_available():
        raise ValueError(
            f"device {device!r}: no CUDA GPU here (torch {torch.__version__}, "
            f"built for CUDA {torch.version.cuda or 'none'}; torch.cuda.is_available() is False)"
        )
    index = torch.device(device).index
    if index is not None and index >= torch.cuda.device_count():
        raise ValueError(f"device {device!r}: this machine has {torch.cuda.device_count()} CUDA GPUs")


def nest_engine_fields(data: Any, defaults: dict[str, Any]) -> Any:
    """For a worker's config (a ``model_validator(mode="before")``): the EngineConfig keywords given flat
    (``model=``, ``block_size=``, ...) go into its ``engine_config``, over the worker's own ``defaults``.

    So the engine's options are declared once, here, and a worker's config holds an EngineConfig rather than a copy.
    """
    if not isinstance(data, dict):
        return data
    data = dict(data)
    given = data.pop("engine_config", None)
    nested = dict(defaults)
    if isinstance(given, EngineConfig):
        nested.update(given.model_dump(exclude_unset=True))
    elif given is not None:
        nested.update(given)
    nested.update({k: data.pop(k) for k in list(data) if k in EngineConfig.model_fields})
    data["engine_config"] = nested
    return data
