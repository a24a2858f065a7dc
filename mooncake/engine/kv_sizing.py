"""How many KV blocks an engine's paged cache holds when its configuration names no count: sized from memory.

    CUDA  vLLM's ``gpu_memory_utilization``: of the device's memory, that fraction for this engine's everything.
          Once the model is loaded, what is left of the fraction (less what anyone already holds on the device and an
          estimate of a step's activations) is the cache.
    CPU   a byte budget, ``kv_cache_memory_gib`` (vLLM's VLLM_CPU_KVCACHE_SPACE), and no more blocks than the batch
          can hold at once (``max_num_seqs`` sequences of ``max_model_len``): the memory is shared with everything
          else on the host, and a block no sequence can use is memory taken from it.

Called once, at engine start; the count is what the worker registers with the Conductor and prints in its READY line.
"""

from __future__ import annotations

import logging

import torch

from mooncake.blocks import blocks_for
from mooncake.engine.config import EngineConfig
from mooncake.engine.model_args import ModelArgs

log = logging.getLogger(__name__)

CUDA_MARGIN_BYTES = 512 << 20  # the allocator's slack, CUDA graphs' pools, the sampler's buffers


def cache_blocks(config: EngineConfig, args: ModelArgs, block_bytes: int, max_model_len: int) -> int:
    """The cache's block count: ``config.num_kv_blocks`` if set, else sized from memory (module docstring).
    ValueError when the memory left holds not even one sequence of ``max_model_len``, naming the setting to change."""
    if config.num_kv_blocks:
        return config.num_kv_blocks
    per_seq = blocks_for(max_model_len, config.block_size)
    device = torch.device(config.device)
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        budget = int(total * config.gpu_memory_utilization) - (total - free) - activation_bytes(config, args)
        where = (
            f"gpu_memory_utilization {config.gpu_memory_utilization} of {total / 2**30:.1f} GiB leaves "
            f"{max(budget, 0) / 2**30:.2f} GiB for the KV cache"
        )
        blocks = budget // block_bytes
    else:
        budget = int(config.kv_cache_memory_gib * 2**30)
        where = f"kv_cache_memory_gib {config.kv_cache_memory_gib}"
        blocks = min(budget // block_bytes, config.max_num_seqs * per_seq)
    if blocks < per_seq:
        raise ValueError(
            f"{where}: {max(blocks, 0)} blocks of {block_bytes} bytes, fewer than one {max_model_len}-token "
            f"sequence needs ({per_seq}); give it more memory or a smaller --max-model-len"
        )
    log.info(
        "KV cache: %d blocks of %d tokens (%.2f GiB; %s)",
        blocks,
        config.block_size,
        blocks * block_bytes / 2**30,
        where,
    )
    return int(blocks)


def activation_bytes(config: EngineConfig, args: ModelArgs) -> int:
    """A step's largest transient tensors, over-estimated: the step's tokens through the widest projections (the
    fused q/k/v, the gate-up or the routed experts' rows) in float32, the logits of a full batch, and the margin."""
    elem = 4
    tokens = config.max_num_batched_tokens or 0
    inter = max(args.intermediate_size, args.moe_intermediate_size * max(args.num_experts_per_tok, 1))
    qkv = (args.num_heads + 2 * args.num_kv_heads) * args.head_dim
    per_token = (4 * args.hidden_size + 3 * inter + 2 * qkv) * elem
    logits = config.max_num_seqs * args.vocab_size * elem * 3
    return tokens * per_token + logits + CUDA_MARGIN_BYTES
