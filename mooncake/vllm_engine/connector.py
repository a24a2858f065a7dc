"""MooncakePoolConnector: a vLLM v1 KV connector that moves KV between vLLM's paged cache and our pool.

vLLM builds two instances from ``kv_transfer_config`` (``kv_connector_module_path`` =
this module): a SCHEDULER one inside its scheduler and a WORKER one beside the model
runner. Both run in the worker process that hosts the engine (``VllmEngine`` runs vLLM
in-process), so both find that engine's ``Bridge`` by the id in
``kv_connector_extra_config["bridge"]``; the worker's own objects (the prefix to load,
the prefill job to push) never pass through vLLM, only block tables do.

    scheduler side, once per step                      worker side, in the forward pass
    get_num_new_matched_tokens: the bridge's load      register_kv_caches: probe the layout
      for the request (its prefix in pool or landing     (layout.py), one converter for all layers
      slots), minus what vLLM computed already         wait_for_layer_load(l): write layer l of
    update_state_after_alloc: note the load              each load into its blocks (waiting for a
    build_connector_meta: per request scheduled          pull still landing)
      now, its whole block table (tracked across      save_kv_layer(l): the prefill pusher takes
      steps), what it computes, and the load to do       layer l of the blocks this step completed
      (each load is used once: a preempted request      (landing slots and pool slots)
      computes its prompt again)                     wait_for_save: the step's pushes are done

Pushes finish inside the step (``wait_for_save`` waits for them), so ``request_finished``
never holds blocks back. Block keys are never vLLM's: the worker computes ours (DESIGN §4)
from the token ids and decides what is loaded and where it is pushed.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole

from mooncake.blocks import blocks_for
from mooncake.engine.connector import ConnectorStep, StepRequest
from mooncake.vllm_engine.layout import BlockLayout, fp8_writer
from mooncake.vllm_engine.shared_kv import SharedKV, heads_of

if TYPE_CHECKING:
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

    from prefill.connector import PoolConnector

log = logging.getLogger(__name__)

CONNECTOR_NAME = "MooncakePoolConnector"


@dataclass(slots=True)
class Load:
    """KV for a request's first ``num_tokens`` tokens: a tensor [n, L, 2, bs, Hkv, D] or an ExternalKV."""

    source: Any
    num_tokens: int


@dataclass(eq=False)
class Bridge:
    """What one VllmEngine shares with its two connector instances (all in one process)."""

    loads: dict[str, Load] = field(default_factory=dict)  # set before add_request; taken when scheduled
    loading: dict[str, Load] = field(default_factory=dict)  # scheduled this step: the worker side takes them
    external: dict[str, str] = field(default_factory=dict)  # vLLM's request id -> the worker's (jobs use it)
    pusher: PoolConnector | None = None  # the prefill worker's: where each layer of new KV goes
    layout: BlockLayout | None = None  # set by the worker side once the caches exist
    caches: list[torch.Tensor] | None = (
        None  # each layer's cache, in layer order (the decode worker's write-behind reads them)
    )
    shared: SharedKV | None = None  # at tensor-parallel size > 1: every head of the cache (shared_kv.py)
    steps: list[PoolConnectorMetadata] = field(default_factory=list)  # at size > 1: steps whose pushes wait


_BRIDGES: dict[str, Bridge] = {}
_BRIDGES_LOCK = threading.Lock()


def register_bridge(bridge_id: str, bridge: Bridge) -> None:
    with _BRIDGES_LOCK:
        if bridge_id in _BRIDGES:
            raise RuntimeError(f"a vLLM engine bridge {bridge_id!r} exists already in this process")
        _BRIDGES[bridge_id] = bridge


def unregister_bridge(bridge_id: str) -> None:
    with _BRIDGES_LOCK:
        _BRIDGES.pop(bridge_id, None)


def _bridge_for(vllm_config: VllmConfig) -> Bridge:
    bridge_id = vllm_config.kv_transfer_config.get_from_extra_config("bridge", None)
    with _BRIDGES_LOCK:
        bridge = _BRIDGES.get(bridge_id)
    if bridge is None:
        raise RuntimeError(
            f"{CONNECTOR_NAME} runs only inside a mooncake worker's VllmEngine (in-process, no bridge "
            f"{bridge_id!r} here): start it with `mooncake serve prefill|decode --engine vllm`"
        )
    return bridge


@dataclass(slots=True)
class LoadSpec:
    request_id: str
    block_ids: list[int]
    num_tokens: int


@dataclass
class PoolConnectorMetadata(KVConnectorMetadata):
    """One step: the loads to do and every scheduled request's progress (picklable)."""

    loads: list[LoadSpec] = field(default_factory=list)
    requests: list[StepRequest] = field(default_factory=list)
    step_id: int = 0


class MooncakePoolConnector(KVConnectorBase_V1):
    """See the module docstring. At tensor-parallel size N > 1 the worker side runs in vLLM's rank processes and
    reaches the scheduling process through the shared copy (shared_kv.py); pipeline parallel size 1 only."""

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        parallel = vllm_config.parallel_config
        if parallel.pipeline_parallel_size != 1:
            raise ValueError(f"{CONNECTOR_NAME} supports pipeline parallel size 1 only")
        self.world = parallel.tensor_parallel_size
        self.block_size = vllm_config.cache_config.block_size
        self._name = vllm_config.kv_transfer_config.get_from_extra_config("bridge", None)
        # at size 1 both sides share the engine's bridge; at N > 1 only the scheduler side is in its process
        self.bridge = _bridge_for(vllm_config) if self.world == 1 or role == KVConnectorRole.SCHEDULER else None
        self.shared: SharedKV | None = None
        if self.bridge is not None and self.world > 1:
            self.shared = self.bridge.shared = _shared(vllm_config, self._name, kv_cache_config.num_blocks)
        # scheduler side
        self._allocated: dict[str, int] = {}  # request id -> external tokens vLLM allocated for
        self._tables: dict[str, list[int]] = {}  # request id -> block table (group 0)
        self._steps = 0
        # worker side
        self._layers: dict[str, int] = {}  # layer name -> index
        self._writers: dict[int, Any] = {}
        self._layout: BlockLayout | None = None
        self._device = torch.device("cpu")  # the caches'
        self._meta_loads: list[tuple[LoadSpec, Load | None, torch.Tensor]] = []  # this step's: (spec, source, slots)
        self._heads, self._writes = slice(None), True  # at N > 1: this rank's KV heads; whether it writes them
        self._rank = 0
        self._touched: torch.Tensor | None = None  # at N > 1: the blocks this step writes (the cache's device)
        self._touched_rows: torch.Tensor | None = None  # the same, indexing the shared copy (host)

    # -- scheduler side ------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        load = self.bridge.loads.get(request.request_id)
        if (
            load is None or num_computed_tokens
        ):  # vLLM's own prefix cache hit (a worker turns it off): it computes the rest
            return 0, False
        return load.num_tokens, False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        if num_external_tokens > 0:
            self._allocated[request.request_id] = num_external_tokens

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        self._steps += 1
        meta = PoolConnectorMetadata(step_id=self._steps)
        counts = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            table = self._tables[new.req_id] = list(new.block_ids[0])
            n_ext = self._allocated.pop(new.req_id, 0)
            load = self.bridge.loads.pop(new.req_id, None)  # used once: a preempted request recomputes
            if n_ext and load is not None:
                if self.shared is None:
                    self.bridge.loading[new.req_id] = load
                else:
                    self._share(load, table, n_ext)
                first = (
                    new.num_computed_tokens - n_ext
                )  # tokens vLLM had already: none, get_num_new_matched_tokens saw to it
                if first != 0:
                    raise RuntimeError(
                        f"request {new.req_id}: {first} tokens computed locally before its external prefix"
                    )
                meta.loads.append(LoadSpec(new.req_id, table, n_ext))
            meta.requests.append(
                StepRequest(
                    self._worker_id(new.req_id), new.num_computed_tokens, counts.get(new.req_id, 0), None, table
                )
            )
        cached = scheduler_output.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            new_ids = cached.new_block_ids[i]
            if rid in cached.resumed_req_ids:
                self._tables[rid] = list(new_ids[0]) if new_ids else []
            elif new_ids:
                self._tables.setdefault(rid, []).extend(new_ids[0])
            meta.requests.append(
                StepRequest(
                    self._worker_id(rid),
                    cached.num_computed_tokens[i],
                    counts.get(rid, 0),
                    None,
                    list(self._tables.get(rid, [])),
                )
            )
        if self.shared is not None:
            self.bridge.steps.append(meta)
        return meta

    def _share(self, load: Load, table: list[int], num_tokens: int) -> None:
        """At N > 1: a load's KV into the shared copy at the request's blocks, where each rank reads its heads (a pull
        still landing is waited for here, layer by layer)."""
        n = blocks_for(num_tokens, self.block_size)
        index = torch.tensor(table[:n], dtype=torch.long)
        src = load.source
        for layer in range(self.shared.kv.shape[1]):
            kv = src.layer(layer, 0, n) if hasattr(src, "layer") else src[:n, layer]
            self.shared.kv[index, layer] = kv.to("cpu")

    def _worker_id(self, vllm_id: str) -> str:
        return self.bridge.external.get(vllm_id, vllm_id)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._tables.pop(request.request_id, None)
        self._allocated.pop(request.request_id, None)
        self.bridge.loads.pop(request.request_id, None)
        return False, None  # every push of a step ends with the step

    # -- worker side ---------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.config import get_layers_from_vllm_config
        from vllm.model_executor.layers.attention import Attention
        from vllm.model_executor.models.utils import extract_layer_index

        attention = get_layers_from_vllm_config(self._vllm_config, Attention, list(kv_caches))
        dtype = self._vllm_config.model_config.dtype
        for name, cache in kv_caches.items():
            index = self._layers[name] = extract_layer_index(name)
            layer = attention[name]
            write = self._writers[index] = lambda k, v, s, layer=layer, cache=cache: layer.impl.do_kv_cache_update(
                layer, k, v, cache, s
            )
            if cache.dtype == torch.uint8:  # an FP8 cache: float8 K/V in, each times its scale (layout.fp8_writer)
                scales = (getattr(layer, "_k_scale_float", 1.0), getattr(layer, "_v_scale_float", 1.0))
                self._writers[index] = fp8_writer(write, *scales, dtype)
        if sorted(self._layers.values()) != list(range(len(kv_caches))):
            raise RuntimeError(f"cannot order the attention layers {list(kv_caches)}")
        first = next(cache for name, cache in kv_caches.items() if self._layers[name] == 0)
        self._device = first.device
        if first.dim() != 4:
            raise ValueError(
                f"{CONNECTOR_NAME} needs a [blocks, heads, block_size, 2*head_size] cache per layer "
                f"(MLA and other latent caches are not supported); got {tuple(first.shape)}"
            )
        # block 0 is vLLM's null block: never holds a request's KV, safe to probe (and restored after)
        self._layout = BlockLayout.probe(first, 0, self._writers[0])
        if self.world == 1:
            self.bridge.caches = [kv_caches[name] for name in sorted(kv_caches, key=self._layers.__getitem__)]
            self.bridge.layout = self._layout
        else:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            self._rank = get_tensor_model_parallel_rank()
            self.shared = _shared(self._vllm_config, self._name, first.shape[0])
            self._heads, self._writes = heads_of(self._rank, self.world, self.shared.kv.shape[4])
        log.info(
            "vLLM KV cache: %d layers of %s %s, converted to the pool layout by a probed permutation%s",
            len(kv_caches),
            tuple(first.shape),
            first.dtype,
            f" (rank {self._rank} of {self.world}: KV heads {self._heads.start}..{self._heads.stop - 1})"
            if self.world > 1
            else "",
        )

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """Called as each step's forward context is entered, before any layer runs: set up its loads and pushes."""
        super().bind_connector_metadata(connector_metadata)
        meta = connector_metadata
        if not isinstance(meta, PoolConnectorMetadata):
            raise RuntimeError(f"{CONNECTOR_NAME} got metadata of type {type(meta).__name__}")
        self._meta_loads = []
        for spec in meta.loads:
            load = self.bridge.loading.pop(spec.request_id, None) if self.shared is None else None
            if load is not None or self.shared is not None:
                self._meta_loads.append((spec, load, self._slots(spec.block_ids)[: spec.num_tokens]))
        if self.shared is not None:
            self._touched = self._written_blocks(meta.requests)
            self._touched_rows = self._touched.cpu() if self._touched is not None else None  # once a step
            return
        pusher = self.bridge.pusher
        if pusher is not None:
            pusher.start_step(ConnectorStep(meta.step_id, meta.requests))

    def _slots(self, block_ids: list[int]) -> torch.Tensor:
        table = torch.tensor(block_ids, dtype=torch.long, device=self._device)
        return (table[:, None] * self.block_size + torch.arange(self.block_size, device=self._device)).reshape(-1)

    def _written_blocks(self, requests: list[StepRequest]) -> torch.Tensor | None:
        """The blocks a step writes new KV into: each request's from its first new token's to its last's."""
        bs, ids = self.block_size, []
        for r in requests:
            if r.num_new_tokens > 0:
                ids += r.block_ids[
                    r.num_computed_tokens // bs : blocks_for(r.num_computed_tokens + r.num_new_tokens, bs)
                ]
        return torch.tensor(ids, dtype=torch.long, device=self._device) if ids else None

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Nothing to start: each layer's load happens in ``wait_for_layer_load``, just before that layer."""

    def wait_for_layer_load(self, layer_name: str) -> None:
        if not self._meta_loads:
            return
        layer = self._layers[layer_name]
        for spec, load, slots in self._meta_loads:
            n = blocks_for(spec.num_tokens, self.block_size)
            if load is None:  # N > 1: this rank's heads of the shared copy (its rows: the first n of spec's blocks)
                kv = self.shared.kv[spec.block_ids[:n], layer][..., self._heads, :]
            else:
                src = load.source
                kv = src.layer(layer, 0, n) if hasattr(src, "layer") else src[:n, layer]
            self._layout.import_tokens(self._writers[layer], kv, slots)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        if self.shared is not None:
            if self._writes and self._touched is not None:
                blocks = self._layout.export_blocks(kv_layer, self._touched).cpu()  # [n, 2, bs, heads here, D]
                self.shared.kv[self._touched_rows, self._layers[layer_name], :, :, self._heads] = blocks
            return
        pusher = self.bridge.pusher
        if pusher is not None:
            pusher.save_layer(self._layers[layer_name], kv_layer, None, None)

    def wait_for_save(self) -> None:
        if self.shared is not None:
            self.shared.done[self._rank] = self._get_connector_metadata().step_id  # the copy holds this step
            return
        pusher = self.bridge.pusher
        if pusher is not None:
            pusher.wait_for_save()


def _shared(vllm_config: VllmConfig, name: str, num_blocks: int) -> SharedKV:
    """The shared copy of the cache of the engine named ``name`` (every head: the pool's block shape; an FP8 cache's
    in float8 e4m3, what its blocks export as and import from)."""
    mc, cache = vllm_config.model_config, vllm_config.cache_config
    shape = (mc.get_num_layers(vllm_config.parallel_config), 2, cache.block_size)
    shape += (mc.get_total_num_kv_heads(), mc.get_head_size())
    dtype = mc.dtype if str(cache.cache_dtype) == "auto" else torch.float8_e4m3fn
    return SharedKV(name, num_blocks, shape, dtype, vllm_config.parallel_config.tensor_parallel_size)
