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


def children(pid: int) -> list[int]:
    """The live processes whose parent is ``pid`` (from /proc)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            out.append(int(stat.parent.name))
    return out


def rank_processes(pid: int) -> list[int]:
    """The tensor-parallel ranks process ``pid`` started (multiprocessing's spawned children)."""
    return [p for p in children(pid) if "spawn_main" in Path(f"/proc/{p}/cmdline").read_text()]


def greedy():
    """The sampling every TP test runs: 16 greedy tokens with their log-probabilities."""
    from mooncake.engine import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=16, logprobs=0, ignore_eos=True)


def generate(engine, prompts: list[list[int]], **add) -> list[tuple[list[int], list[float]]]:
    """Each prompt's (tokens, log-probabilities) generated on ``engine`` (ids r0, r1, ...; ``add``: add_request's
    kv and options), run to the end."""
    ids = [engine.add_request(p, greedy(), request_id=f"r{n}", **add) for n, p in enumerate(prompts)]
    got = {i: ([], []) for i in ids}
    while engine.has_unfinished():
        for o in engine.step():
            got[o.request_id][0].extend(o.new_token_ids)
            got[o.request_id][1].extend(lp.logprob for lp in o.new_logprobs or [])
    return [got[i] for i in ids]


def _rank(rank: int, size: int, init: str, jobs: list, out) -> None:
    try:
        import torch
        from conftest import make_engine

        from mooncake.engine.parallel import TensorParallel

        torch.set_num_threads(1)
        tp = TensorParallel.init(rank, size, init, backend="gloo")
        results = [
            generate(make_engine(model_dir, tp=tp, num_threads=1, **overrides), prompts)
            for model_dir, prompts, overrides in jobs
        ]
        if rank == 0:
            out.put(("ok", results))
    except BaseException:
        out.put(("error", f"rank {rank}:\n{traceback.format_exc()}"))


def run_ranks(size: int, jobs: list, work: Path) -> list:
    """Rank 0's results of ``jobs`` on a ``size``-rank engine (processes started fresh); AssertionError with a
    rank's traceback when one fails."""
    return _spawn(_rank, size, jobs, work)


def _spawn(target, size: int, jobs: list, work: Path) -> list:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    init = f"file://{work / f'tp-init-{target.__name__}'}"
    procs = [ctx.Process(target=target, args=(r, size, init, jobs, out), daemon=True) for r in range(size)]
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


def _led(rank: int, size: int, init: str, jobs: list, out) -> None:
    """As ``_rank``, but only rank 0 is given the requests (through ``Leader``); the others ``follow`` it."""
    try:
        import torch
        from conftest import make_engine

        from mooncake.engine.parallel import TensorParallel
        from mooncake.engine.ranks import Leader, follow
        from mooncake.engine.request import PromptKV, RequestOptions

        torch.set_num_threads(1)
        tp = TensorParallel.init(rank, size, init, backend="gloo")
        results = []
        for model_dir, prompt, leading, export_after in jobs:
            engine = make_engine(model_dir, tp=tp, max_num_seqs=64)
            if rank:
                follow(engine)
                continue
            engine = Leader(engine)
            kv = options = None
            if leading is not None:  # (KV of the first n tokens, the tokens already generated)
                (n, data), outputs = leading  # numpy (a tensor in a queue goes with the process that put it)
                kv, options = PromptKV(n, torch.from_numpy(data)), RequestOptions(outputs=tuple(outputs))
            rid = engine.add_request(prompt, greedy(), kv=kv, options=options)
            tokens, logprobs, exported = [], [], None
            while engine.has_unfinished():
                for o in engine.step():
                    tokens += o.new_token_ids
                    logprobs += [lp.logprob for lp in o.new_logprobs or []]
                if export_after and exported is None and len(tokens) >= export_after:
                    computed = len(prompt) + len(tokens) - 1
                    kv = engine.export_kv(engine.request_block_ids(rid)).numpy()
                    exported = ((computed, kv), list(tokens))
                    engine.abort_request(rid)
            engine.close()
            results.append((tokens, logprobs, exported))
        if rank == 0:
            out.put(("ok", results))
    except BaseException:
        out.put(("error", f"rank {rank}:\n{traceback.format_exc()}"))


def run_led(size: int, jobs: list, work: Path) -> list:
    """Rank 0's results of ``jobs`` ([(model_dir, prompt, leading KV or None, export after N tokens or 0)]) on a
    ``size``-rank engine whose followers are given nothing but rank 0's broadcast calls: per job (tokens,
    log-probabilities, (exported (tokens, KV), tokens so far) or None)."""
    return _spawn(_led, size, jobs, work)
