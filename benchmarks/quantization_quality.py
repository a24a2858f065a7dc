"""FP8 KV and quantized weights against full precision on real weights: greedy agreement, log-probability drift,
bytes and speed.

    python -m benchmarks.quantization_quality                # SmolLM2-135M (mooncake model pull), float32, 1,000 tokens
    python -m benchmarks.quantization_quality --tokens 200 --dtype bfloat16 --model DIR --only fp8-kv int4-g64

Variants: an FP8 KV cache (``--kv-cache-dtype fp8``), and the model's weights quantized by compressed-tensors
(tests/quantized.py: its min-max scales, round to nearest, no calibration data) in FP8 per output channel, int8 per
channel, and int4 in groups of 64 with zero points (W4A16, the scheme AWQ and GPTQ checkpoints use; a calibrated GPTQ
or AWQ does better than round to nearest). A fixed text (``TEXT``, as a chat turn) is continued greedily for
``--tokens`` tokens by the full-precision engine: the reference. Each engine then scores that one sequence
teacher-forced (``prompt_logprobs``: the text and the reference continuation as one prompt, prefilled in the engine's
chunks): at each continuation position, whether its likeliest next token is the reference's (agreement), and how far
its log-probability of the reference token is from the full-precision engine's (drift: mean and largest absolute
difference). Each also runs free (greedy, on its own tokens): the tokens it shares with the reference before the first
difference. Bytes: one block of each cache (what a hand-off and the pool move and hold per 16 tokens) and the tokens
1 GiB holds; the weights as held (quantized layers as
stored). Speed: each free run's decode tokens a second, one engine after the other in this process (2 cores: compare
the variants, not the figures across machines).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
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


# name: (compressed-tensors scheme for tests/quantized.py, or None: the float weights; the KV cache dtype)
VARIANTS = {
    "full": (None, "auto"),
    "fp8-kv": (None, "fp8"),
    "fp8-weights": ({"bits": 8, "kind": "float", "strategy": "channel"}, "auto"),
    "int8-weights": ({"bits": 8, "kind": "int", "strategy": "channel"}, "auto"),
    "int4-g64": ({"bits": 4, "kind": "int", "strategy": "group", "symmetric": False, "group": 64}, "auto"),
}


def quantized_model(model: str, scheme: dict, work: Path, name: str) -> str:
    """``model`` quantized by compressed-tensors into ``work / name``."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from quantized import compressed_tensors_checkpoint

    return str(compressed_tensors_checkpoint(Path(model), work / name, **scheme))


def weight_bytes(eng: LLMEngine) -> int:
    """The model's weights as the engine holds them (a quantized layer's values, scales and zero points)."""
    model = eng.runner.model
    return sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))


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
    p.add_argument("--only", nargs="+", choices=[v for v in VARIANTS if v != "full"], help="these variants only")
    p.add_argument("--json", type=Path, help="also write the figures here")
    args = p.parse_args(argv)
    model = args.model
    if model is None:
        from mooncake.engine.registry import ModelCacheConfig, pull

        model = str(pull("smollm2-135m", ModelCacheConfig().cache_dir, progress=False))
    tok = Tokenizer.from_dir(model)
    prompt = tok.encode_chat([{"role": "user", "content": TEXT}])
    max_len = len(prompt) + args.tokens + 16
    names = ["full", *(args.only or [v for v in VARIANTS if v != "full"])]
    figures: dict = {"model": model, "dtype": args.dtype, "variants": {}}
    with tempfile.TemporaryDirectory() as work:
        runs = {}
        for name in names:
            scheme, kv = VARIANTS[name]
            path = model if scheme is None else quantized_model(model, scheme, Path(work), name)
            eng = engine(path, args.dtype, kv, max_len)
            own, tps = free_run(eng, prompt, args.tokens)
            runs[name] = (eng, own, tps)
        reference = runs["full"][1]
        sequence = prompt + reference
        full_lp, _ = scored(runs["full"][0], sequence, len(prompt))
        gib = 2**30
        for name, (eng, own, tps) in runs.items():
            lp, top = scored(eng, sequence, len(prompt))
            drift = [abs(a - b) for a, b in zip(full_lp, lp)]
            figures["variants"][name] = {
                "agreement": sum(top) / len(top),  # full against itself: 1.0 unless the prefill breaks a near-tie
                "logprob_drift_mean": statistics.fmean(drift),
                "logprob_drift_max": max(drift),
                "free_run_tokens_before_first_difference": next(
                    (i for i, (a, b) in enumerate(zip(own, reference)) if a != b), len(reference)
                ),
                "block_bytes": eng.block_bytes,
                "tokens_per_gib": gib // eng.block_bytes * eng.block_size,
                "weight_bytes": weight_bytes(eng),
                "decode_tokens_per_s": tps,
            }
    full = figures["variants"]["full"]
    figures["tokens"] = len(reference)
    print(f"{Path(model).name} in {args.dtype}, {len(reference)} reference tokens (teacher-forced against them):")
    print(
        f"  {'variant':<13} {'agreement':>9} {'drift mean':>10} {'drift max':>9} {'free run':>8} "
        f"{'block bytes':>11} {'KV tokens/GiB':>13} {'weights MiB':>11} {'decode tok/s':>12} {'vs full':>7}"
    )
    for name, v in figures["variants"].items():
        print(
            f"  {name:<13} {v['agreement']:>9.1%} {v['logprob_drift_mean']:>10.4f} {v['logprob_drift_max']:>9.4f} "
            f"{v['free_run_tokens_before_first_difference']:>8} {v['block_bytes']:>11,} {v['tokens_per_gib']:>13,} "
            f"{v['weight_bytes'] / 2**20:>11.1f} {v['decode_tokens_per_s']:>12.1f} "
            f"{v['decode_tokens_per_s'] / full['decode_tokens_per_s']:>6.2f}x"
        )
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
