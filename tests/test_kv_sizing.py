"""A cache sized from memory when no block count is given (mooncake/engine/kv_sizing.py): on the CPU a byte budget,
capped at what the batch can hold at once; too little memory for one full-length sequence is refused naming the
setting. (The CUDA path, gpu_memory_utilization, needs a GPU: not run here.)"""

from __future__ import annotations

import pytest
from conftest import make_engine

from mooncake.engine.kv_sizing import cache_blocks


def test_a_cpu_cache_takes_its_byte_budget_up_to_what_the_batch_can_hold(tiny_dir):
    fixed = make_engine(tiny_dir, num_kv_blocks=100)
    block = fixed.block_bytes
    assert fixed.pool.num_blocks == 100
    budget = 300 * block / 2**30  # room for 300 blocks
    by_memory = make_engine(tiny_dir, num_kv_blocks=None, kv_cache_memory_gib=budget, max_model_len=512, max_num_seqs=8)
    assert by_memory.pool.num_blocks == 300
    capped = make_engine(tiny_dir, num_kv_blocks=None, kv_cache_memory_gib=1.0, max_model_len=512, max_num_seqs=8)
    assert capped.pool.num_blocks == 8 * 512 // 8  # eight 512-token sequences of 8-token blocks, not 1 GiB of them


def test_too_small_a_budget_for_one_sequence_is_refused_naming_it(tiny_dir):
    fixed = make_engine(tiny_dir, num_kv_blocks=100)
    config = fixed.config.model_copy(
        update=dict(num_kv_blocks=None, kv_cache_memory_gib=10 * fixed.block_bytes / 2**30)
    )
    with pytest.raises(ValueError, match=r"kv_cache_memory_gib .*10 blocks.*fewer than one 1024-token sequence needs"):
        cache_blocks(config, fixed.args, fixed.block_bytes, 1024)


def test_the_workers_size_their_caches_from_memory_by_default():
    from decode.server import parse_args as decode_args
    from prefill.server import parse_args as prefill_args

    d = decode_args(["--model", "m"])
    p = prefill_args(["--model", "m", "--kvstore", "k:1"])
    assert (d.num_kv_blocks, d.kv_cache_memory_gib, d.gpu_memory_utilization) == (None, 2.0, 0.9)
    assert (p.num_kv_blocks, p.kv_cache_memory_gib) == (None, 1.0)
    assert decode_args(["--model", "m", "--num-kv-blocks", "64"]).num_kv_blocks == 64
