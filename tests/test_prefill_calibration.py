"""A prefill worker times prefills of made-up prompts as it starts, and the predictions start from them."""

from __future__ import annotations

from kvnodes import start_node

from conductor.predictors import PredictorConfig
from kvstore.client import KVStoreClient
from mooncake.engine.model_args import ModelArgs
from mooncake.engine.weights import load_hf_config
from mooncake.serving.reports import CALIBRATION_SHARES
from prefill.config import PrefillConfig
from prefill.worker import PrefillWorker


class Samples:
    """Where a ConductorLink would queue the samples for its next report."""

    def __init__(self) -> None:
        self.prefill: list[tuple[int, int, float]] = []

    def prefill_sample(self, prompt_tokens: int, cached_tokens: int, seconds: float) -> None:
        self.prefill.append((prompt_tokens, cached_tokens, seconds))


def test_calibration_times_prompts_of_the_step_budget_and_the_conductor_hears_of_them(tiny_dir, shm_dir):
    args = ModelArgs.from_hf_config(load_hf_config(tiny_dir))
    node = start_node(
        "kv-cal", args.num_layers * 2 * 16 * args.num_kv_heads * args.head_dim * 4, 8, shm_dir=shm_dir
    )  # float32 blocks
    worker = None
    try:
        # no max_model_len: the model's own context, as `mooncake serve prefill` runs without one
        worker = PrefillWorker(
            PrefillConfig(
                id="prefill-cal",
                model=str(tiny_dir),
                kvstore=node.grpc,
                block_size=16,
                num_kv_blocks=32,
                max_num_batched_tokens=64,
            )
        )
        assert not hasattr(worker, "predictor")  # it measures and reports; the Conductor alone fits
        free = worker.engine.num_free_blocks
        samples = worker.calibrate()
        assert [s.prompt_tokens for s in samples] == [round(s * 64) for s in CALIBRATION_SHARES] == [8, 32, 64]
        assert all(s.cached_tokens == 0 and s.seconds > 0 for s in samples)
        assert worker.engine.num_free_blocks == free  # the made-up prompts hold no cache blocks afterwards
        with KVStoreClient(node.grpc) as kv:
            stats = kv.stats()
            assert stats.dram.used_blocks == 0 and stats.reservations == 0  # and wrote nothing into the pool
        link = Samples()
        worker.link = link  # the server sets the link after calibrating: the samples go with its first report
        assert link.prefill == [(s.prompt_tokens, s.cached_tokens, s.seconds) for s in samples]
        assert PredictorConfig().min_samples <= len(samples)  # one worker's calibration fits the Conductor's model
    finally:
        if worker is not None:
            worker.close()
        node.stop()
