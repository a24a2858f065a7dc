"""One tensor-parallel engine as processes, for the tests: each rank runs the same requests on its shard (gloo).

    results = run_ranks(size, jobs, tmp_path)   # jobs: [(model_dir, prompts, engine overrides)], rank 0's outputs

Every rank builds an LLMEngine with its TensorParallel and is given the same requests, so their schedulers step alike
and their collectives meet. Rank 0 returns, per job, each prompt's (tokens, log-probabilities).
"""

from __future__ import annotations

import multiprocessing as mp
import traceback
from pathlib import Path

TIMEOUT_S = 300.0


def _rank(rank: int, size: int, init: str, jobs: list, out) -> None:
    try:
        import torch

        from mooncake.engine import EngineConfig, LLMEngine, SamplingParams
        from mooncake.engine.parallel import TensorParallel

        torch.set_num_threads(1)
        tp = TensorParallel.init(rank, size, init, backend="gloo")
        results = []
        for model_dir, prompts, overrides in jobs:
            cfg = dict(
                model=str(model_dir),
                block_size=8,
                num_kv_blocks=128,
                max_num_batched_tokens=32,
                max_num_seqs=8,
                dtype="float32",
                num_threads=1,
            )
            cfg.update(overrides)
            engine = LLMEngine(EngineConfig(**cfg), tp=tp)
            params = SamplingParams(temperature=0.0, max_tokens=16, logprobs=0, ignore_eos=True)
            ids = [engine.add_request(p, params, request_id=f"r{n}") for n, p in enumerate(prompts)]
            got = {i: ([], []) for i in ids}
            while engine.has_unfinished():
                for o in engine.step():
                    got[o.request_id][0].extend(o.new_token_ids)
                    got[o.request_id][1].extend(lp.logprob for lp in o.new_logprobs or [])
            results.append([got[i] for i in ids])
        if rank == 0:
            out.put(("ok", results))
    except BaseException:
        out.put(("error", f"rank {rank}:\n{traceback.format_exc()}"))


def run_ranks(size: int, jobs: list, work: Path) -> list:
    """Rank 0's results of ``jobs`` on a ``size``-rank engine (processes started fresh); AssertionError with a
    rank's traceback when one fails."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    init = f"file://{work / 'tp-init'}"
    procs = [ctx.Process(target=_rank, args=(r, size, init, jobs, out), daemon=True) for r in range(size)]
    for p in procs:
        p.start()
    try:
        status, value = out.get(timeout=TIMEOUT_S)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    assert status == "ok", value
    return value
