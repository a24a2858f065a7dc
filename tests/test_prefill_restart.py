"""A prefill worker that starts under an id hands back what an earlier run under that id held on its pool node."""

from __future__ import annotations

import logging

from kvnodes import start_node

from kvstore.client import KVStoreClient
from mooncake.engine.model_args import ModelArgs
from mooncake.engine.tiny import make_tiny
from mooncake.engine.weights import load_hf_config
from prefill.config import PrefillConfig
from prefill.worker import PrefillWorker

BLOCK_SIZE = 16


def test_a_restarted_prefill_worker_frees_the_leases_and_reservations_its_last_run_left(tmp_path, shm_dir, caplog):
    model = make_tiny(tmp_path / "model", "llama")
    args = ModelArgs.from_hf_config(load_hf_config(model))
    block_bytes = args.num_layers * 2 * BLOCK_SIZE * args.num_kv_heads * args.head_dim * 4  # float32
    node = start_node("kv0", block_bytes, 8, shm_dir=shm_dir)
    try:
        keys = [bytes([i + 1]) * 16 for i in range(3)]
        # the last run of prefill-7 stopped mid-prefill: a prefix leased, slots for the rest reserved (600 s)
        last_run = KVStoreClient(node.grpc, owner="prefill-7")
        last_run.put(keys[:1], bytes(block_bytes))
        last_run.get_locations(keys[:1])
        last_run.reserve(keys[1:], ttl_s=600)
        last_run.close()
        with KVStoreClient(node.grpc) as kv:
            held = kv.stats()
            assert (held.leases, held.reservations, held.dram.reserved_blocks) == (1, 1, 2)
            config = PrefillConfig(
                id="prefill-7", model=str(model), kvstore=node.grpc, block_size=BLOCK_SIZE, num_kv_blocks=16
            )
            with caplog.at_level(logging.INFO, logger="prefill.worker"):
                worker = PrefillWorker(config)
            try:
                stats = kv.stats()
                assert (stats.leases, stats.reservations, stats.dram.reserved_blocks) == (0, 0, 0)
                assert "left 1 leases and 1 reservations" in caplog.text
            finally:
                worker.close()
    finally:
        node.stop()
