"""Stock vLLM in a process of its own, for the vLLM tests: the references the cluster is held to.

vLLM keeps process-wide state (its KV connector agent), so each use runs in a fresh
interpreter: ``run(mode, **args)`` starts ``python tests/vllm_alone.py`` with the arguments
as JSON on stdin and returns the JSON it prints.

- ``reference``: greedy tokens of each prompt, one ``vllm.LLM.generate`` per prompt, with
  no KV connector and prefix caching off: vLLM serving it alone (at ``tensor_parallel_size``, 1 by default).
- ``layout``: the KV our ``VllmEngine`` exports for a prompt, in the pool layout
  [L, 2, T, Hkv, D], saved with ``torch.save`` to ``path``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

RESULT = "VLLM_ALONE_RESULT "


def run(mode: str, timeout_s: float = 600, **args) -> object:
    # one thread, as the cluster's workers compute (tests start them with threads=1): the same sums in the same order
    env = {**os.environ, "VLLM_LOGGING_LEVEL": "WARNING", "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, __file__],
        input=json.dumps({"mode": mode, **args}),
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env=env,
        cwd=Path(__file__).resolve().parent.parent,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT)]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"vllm_alone {mode} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(lines[-1][len(RESULT) :])


def _reference(args: dict) -> list[list[int]] | list[dict]:
    """Greedy tokens per prompt; with ``logprobs`` (k), ``{"tokens", "logprobs": [[logprob, [[id, logprob] x k]]]}``,
    and for the prompts numbered in ``prompt_logprobs_of`` also "prompt_logprobs" (prompt tokens 1..)."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from mooncake.vllm_engine.shared_kv import bind_cpu_ranks

    tp = args.get("tensor_parallel_size", 1)
    if tp > 1:
        bind_cpu_ranks(tp)  # as a worker does: a core each where there are fewer NUMA nodes than ranks
    llm = LLM(
        model=args["model"],
        tensor_parallel_size=tp,
        dtype=args.get("dtype", "float32"),
        block_size=args["block_size"],
        max_model_len=args["max_model_len"],
        enforce_eager=True,
        enable_prefix_caching=False,
        kv_cache_memory_bytes=512 * 2**20,
        seed=0,
        kv_cache_dtype=args.get("kv_cache_dtype", "auto"),
    )
    k = args.get("logprobs")
    params = SamplingParams(temperature=0.0, max_tokens=args["max_tokens"], ignore_eos=True, logprobs=k)
    out = []
    for i, p in enumerate(args["prompts"]):
        with_prompt = i in args.get("prompt_logprobs_of", ())
        result = llm.generate(
            [TokensPrompt(prompt_token_ids=p)],
            params.clone() if not with_prompt else SamplingParams(**{**_fields(params), "prompt_logprobs": k}),
            use_tqdm=False,
        )[0]
        completion = result.outputs[0]
        tokens = list(completion.token_ids)
        if k is None:
            out.append(tokens)
            continue
        steps = []
        for token, entries in zip(tokens, completion.logprobs):
            top = sorted((e.rank, t, e.logprob) for t, e in entries.items() if e.rank is not None and e.rank <= k)
            steps.append([entries[token].logprob, [[t, v] for _, t, v in top]])
        entry = {"tokens": tokens, "logprobs": steps}
        if with_prompt:
            entry["prompt_logprobs"] = [step[t].logprob for t, step in zip(p[1:], result.prompt_logprobs[1:])]
        out.append(entry)
    return out


def _fields(params) -> dict:
    return dict(
        temperature=params.temperature,
        max_tokens=params.max_tokens,
        ignore_eos=params.ignore_eos,
        logprobs=params.logprobs,
    )


def _layout(args: dict) -> str:
    import torch

    from mooncake.blocks import blocks_for
    from mooncake.engine.config import EngineConfig
    from mooncake.engine.interface import EngineKind
    from mooncake.engine.request import SamplingParams
    from mooncake.serving.build import build_engine

    class Capture:
        """Stands where the prefill worker's PoolConnector does: keeps each layer of the prompt's blocks."""

        export = None

        def __init__(self) -> None:
            self.layers: dict[int, torch.Tensor] = {}
            self.active: list = []

        def start_step(self, step) -> None:
            self.active = [(r.block_ids, r.num_computed_tokens + r.num_new_tokens) for r in step.requests]

        def save_layer(self, layer, cache, _v, _step) -> None:
            for table, done in self.active:
                self.layers[layer] = self.export(layer, cache, table[: blocks_for(done, args["block_size"])])

        def wait_for_save(self) -> None:
            pass

    capture = Capture()
    config = EngineConfig(model=args["model"], block_size=args["block_size"], num_kv_blocks=64, max_model_len=1024)
    engine = build_engine(EngineKind.VLLM, config, vllm_args={"enforce_eager": True}, connector=capture)
    prompt = args["prompt"]
    engine.add_request(prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True), request_id="probe")
    while engine.has_unfinished():
        engine.step()
    kv = torch.stack([capture.layers[i] for i in range(len(capture.layers))])  # [L, n, 2, bs, Hkv, D]
    kv = kv.permute(0, 2, 1, 3, 4, 5).flatten(2, 3)[:, :, : len(prompt)]  # [L, 2, T, Hkv, D]
    torch.save(kv.clone(), args["path"])
    return args["path"]


if __name__ == "__main__":
    request = json.loads(sys.stdin.read())
    out = {"reference": _reference, "layout": _layout}[request["mode"]](request)
    print(RESULT + json.dumps(out), flush=True)
