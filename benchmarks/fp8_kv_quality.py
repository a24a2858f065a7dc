"""An FP8 KV cache against full precision on real weights: greedy agreement, log-probability drift, bytes and speed.

    python -m benchmarks.fp8_kv_quality                     # SmolLM2-135M (mooncake model pull), float32, 1,000 tokens
    python -m benchmarks.fp8_kv_quality --tokens 200 --dtype bfloat16 --model DIR

A fixed text (``TEXT``, as a chat turn) is continued greedily for ``--tokens`` tokens with the full-precision cache:
the reference. Both engines then score that one sequence teacher-forced (``prompt_logprobs``: the text and the
reference continuation as one prompt, prefilled in the engine's chunks): at each continuation position, whether the
engine's likeliest next token is the reference's (agreement), and how far the FP8 engine's log-probability of the
reference token is from the full-precision engine's (drift: mean and largest absolute difference). The FP8 engine
also runs free (greedy, on its own tokens): the tokens it shares with the reference before the first difference.
Bytes: one block of each cache, and the tokens 1 GiB of cache holds. Speed: each free run's decode tokens a second,
one engine after the other in this process (2 cores: compare the two, not the figures across machines).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from mooncake.engine.config import EngineConfig
from mooncake.engine.engine import LLMEngine
from mooncake.engine.request import SamplingParams
from mooncake.engine.tokenizer import Tokenizer

TEXT = (
    "Explain, step by step and in plain words, how a city's water reaches a kitchen tap: where it is drawn from, how "
    "it is cleaned, how pumps and towers keep it under pressure, what the pipes under the street are made of, and "
    "what goes wrong when a main breaks in winter. Then say what a household can do to use less of it."
)


def engine(model: str, dtype: str, kv: str, max_len: int) -> LLMEngine:
    config = EngineConfig(model=model, dtype=dtype, kv_cache_dtype=kv, max_model_len=max_len, max_num_seqs=1)
    return LLMEngine(config)


def free_run(eng: LLMEngine, prompt: list[int], tokens: int) -> tuple[list[int], float]:
    """Greedy tokens, and the decode tokens a second (after the first token)."""
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    rid = eng.add_request(prompt, params)
    first_at, out = None, []
    while eng.has_unfinished():
        for o in eng.step():
            if o.request_id == rid:
                out = list(o.output_token_ids)
                if first_at is None and out:
                    first_at = time.perf_counter()
    return out, (len(out) - 1) / (time.perf_counter() - first_at)


def scored(eng: LLMEngine, sequence: list[int], start: int) -> tuple[list[float], list[bool]]:
    """Teacher-forced: the log-probability of each token of ``sequence`` from ``start`` on, and whether it was the
    engine's likeliest there."""
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
    (out,) = eng.generate([sequence], params)
    rows = out.prompt_logprobs[start - 1 :]  # prompt_logprobs start at the prompt's second token
    return [r.logprob for r in rows], [r.top[0][0] == r.token_id for r in rows]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="model directory (default: SmolLM2-135M, pulled and converted once)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--tokens", type=int, default=1000, help="tokens of the reference continuation")
    p.add_argument("--json", type=Path, help="also write the figures here")
    args = p.parse_args(argv)
    model = args.model
    if model is None:
        from mooncake.engine.registry import ModelCacheConfig, pull

        model = str(pull("smollm2-135m", ModelCacheConfig().cache_dir, progress=False))
    tok = Tokenizer.from_dir(model)
    prompt = tok.encode_chat([{"role": "user", "content": TEXT}])
    max_len = len(prompt) + args.tokens + 16
    full, fp8 = engine(model, args.dtype, "auto", max_len), engine(model, args.dtype, "fp8", max_len)
    reference, full_tps = free_run(full, prompt, args.tokens)
    own, fp8_tps = free_run(fp8, prompt, args.tokens)
    sequence = prompt + reference
    full_lp, full_top = scored(full, sequence, len(prompt))
    fp8_lp, fp8_top = scored(fp8, sequence, len(prompt))
    drift = [abs(a - b) for a, b in zip(full_lp, fp8_lp)]
    shared = next((i for i, (a, b) in enumerate(zip(own, reference)) if a != b), len(reference))
    gib = 2**30
    figures = {
        "model": model,
        "dtype": args.dtype,
        "tokens": len(reference),
        "agreement_fp8": sum(fp8_top) / len(fp8_top),
        "agreement_full": sum(full_top) / len(full_top),  # 1.0 unless the teacher-forced prefill breaks a near-tie
        "logprob_drift_mean": statistics.fmean(drift),
        "logprob_drift_max": max(drift),
        "free_run_tokens_before_first_difference": shared,
        "block_bytes_full": full.block_bytes,
        "block_bytes_fp8": fp8.block_bytes,
        "tokens_per_gib_full": gib // full.block_bytes * full.block_size,
        "tokens_per_gib_fp8": gib // fp8.block_bytes * fp8.block_size,
        "decode_tokens_per_s_full": full_tps,
        "decode_tokens_per_s_fp8": fp8_tps,
    }
    print(
        f"{Path(model).name} in {args.dtype}, {len(reference)} reference tokens:\n"
        f"  greedy agreement, teacher-forced: fp8 {figures['agreement_fp8']:.1%} "
        f"(full precision against itself: {figures['agreement_full']:.1%})\n"
        f"  log-probability drift of the reference token: mean {figures['logprob_drift_mean']:.4f}, "
        f"max {figures['logprob_drift_max']:.4f}\n"
        f"  fp8 free run: its first {shared} tokens are the reference's\n"
        f"  a block: {full.block_bytes:,} bytes, fp8 {fp8.block_bytes:,} ({full.block_bytes / fp8.block_bytes:.0f}x); "
        f"1 GiB holds {figures['tokens_per_gib_full']:,} tokens, fp8 {figures['tokens_per_gib_fp8']:,}\n"
        f"  decode: {full_tps:.1f} tokens/s, fp8 {fp8_tps:.1f} tokens/s (fp8 / full {fp8_tps / full_tps:.2f}x)"
    )
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
