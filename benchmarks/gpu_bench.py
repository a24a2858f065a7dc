"""The engine on a GPU against transformers and against the device's own limits, measured in one run.

    python -m benchmarks.gpu_bench [--shape llama-1b|tiny] [--device cuda] [--dtype bfloat16] [--json PATH]
                                   [--no-transformers] [--no-compiled] [--quick]

Makes a random-weight llama of the chosen shape on the spot (mooncake.engine.tiny.make_tiny; ``llama-1b`` is
Llama-3.2-1B's shape: vocab 128,256, hidden 2,048, intermediate 8,192, 16 layers, 32/8 heads of 64, tied
embeddings) and measures, greedy, random prompt ids:

  decode step at 1 and at 32 running requests (512-token prompts): mean wall time of an engine step, prompts
      prefilled first; ours with CUDA graphs (the default) and eager (``--enforce-eager``'s path), transformers
      eager (sdpa, dynamic cache) and compiled (static cache, torch.compile mode="reduce-overhead" of one decoding
      forward, the gpt-fast pattern transformers documents)
  throughput of 64 requests of 512 prompt / 128 output tokens (output tokens/s): ours, transformers' generate
  one 4,096-token prompt: time to the first token at the CUDA default step budget and at 512 to 8,192, and at the
      default once more with torch's kernels between the matmuls instead of kernels/triton_fused.py's and
      triton_mlp.py's (whether fusing them pays); one transformers forward

and the limits of the same device in the same run: the device copy rate (bytes read + written per second by a
1 GiB ``copy_``), which bounds a decode step at (weights + the KV it reads) / rate, and the bf16 matmul rate
(8192^3), which bounds a prefill at its FLOPs (2 x non-embedding parameters x tokens, causal attention 2 x 2 x
n^2/2 x heads x head_dim x layers, the LM head for one row) / rate. Each figure is printed with its ratio to its
limit. Results and the commands used: benchmarks/README.md, "The engine on a GPU".
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from unittest import mock

import torch

from mooncake.engine import EngineConfig, LLMEngine, SamplingParams
from mooncake.engine import model as engine_model
from mooncake.engine.tiny import make_tiny

SHAPES = {
    "llama-1b": dict(
        vocab_size=128_256,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        max_position_embeddings=8192,
        rope_theta=500_000.0,
        tie_word_embeddings=True,
    ),
    "tiny": dict(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
    ),
}
PROMPT_LEN = 512
THROUGHPUT = (64, 512, 128)  # requests, prompt tokens, output tokens
LONG_PROMPT = 4096
BUDGETS = (512, 2048, 4096, 8192)
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Median seconds of ``fn`` over ``repeats`` runs after one warm-up."""
    fn()
    times = []
    for _ in range(repeats):
        sync(device)
        t = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab, (n, length), generator=g).tolist()


# -- limits ---------------------------------------------------------------------------------------


def copy_rate(device: torch.device) -> float:
    """Bytes read + written per second by a 1 GiB device copy."""
    n = 2**30 if device.type == "cuda" else 2**26
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * n / timed(lambda: dst.copy_(src), device, 10)


def matmul_rate(device: torch.device, dtype: torch.dtype) -> float:
    """FLOP/s of an 8192^3 matmul (2048^3 on the CPU)."""
    n = 8192 if device.type == "cuda" else 1024
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    return 2 * n**3 / timed(lambda: a @ b, device, 10)


class Shape:
    """What the limits need from the model: bytes read per decode step, FLOPs of a prefill."""

    def __init__(self, config: dict, dtype: torch.dtype):
        c = config
        self.elem = torch.tensor([], dtype=dtype).element_size()
        self.layers, self.heads, self.kv_heads, self.head_dim = (
            c["num_hidden_layers"],
            c["num_attention_heads"],
            c["num_key_value_heads"],
            c["head_dim"],
        )
        h, i, v = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
        per_layer = h * (self.heads + 2 * self.kv_heads) * self.head_dim + self.heads * self.head_dim * h + 3 * h * i
        self.body = self.layers * per_layer  # non-embedding parameters
        self.head = v * h  # the LM head (tied or not, it is read every step)
        self.params = self.body + self.head * (1 if c["tie_word_embeddings"] else 2)

    def decode_bytes(self, batch: int, ctx: int) -> float:
        kv = batch * ctx * self.layers * 2 * self.kv_heads * self.head_dim * self.elem
        return (self.body + self.head) * self.elem + kv

    def prefill_flops(self, n: int) -> float:
        return 2 * self.body * n + 2 * n * n * self.heads * self.head_dim * self.layers + 2 * self.head


# -- ours -----------------------------------------------------------------------------------------


def engine_for(model_dir: Path, device: str, dtype: str, **overrides) -> LLMEngine:
    cfg = dict(
        model=str(model_dir),
        device=device,
        dtype=dtype,
        kv_cache_memory_gib=8 if device.startswith("cuda") else 1,
        max_num_seqs=64,
        enable_prefix_caching=False,
    )
    cfg.update(overrides)
    return LLMEngine(EngineConfig(**cfg))


def ours_decode_step(engine: LLMEngine, batch: int, vocab: int, steps: int) -> float:
    """Mean seconds of an engine step with ``batch`` requests decoding (512-token prompts, prefilled first)."""
    params = SamplingParams(max_tokens=steps + 16, temperature=0.0, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in prompts(batch, PROMPT_LEN, vocab, seed=batch)]
    while engine.scheduler.waiting or any(r.num_output_tokens == 0 for r in engine.scheduler.running):
        engine.step()
    for _ in range(5):
        engine.step()
    t = time.perf_counter()
    for _ in range(steps):
        engine.step()
    took = (time.perf_counter() - t) / steps
    for i in ids:
        engine.abort_request(i)
    return took


def ours_throughput(engine: LLMEngine, vocab: int) -> float:
    n, p, o = THROUGHPUT
    params = SamplingParams(max_tokens=o, temperature=0.0, ignore_eos=True)
    engine.generate(prompts(4, 64, vocab, seed=7), SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    t = time.perf_counter()
    outs = engine.generate(prompts(n, p, vocab, seed=8), params)
    took = time.perf_counter() - t
    return sum(len(x.output_token_ids) for x in outs) / took


def ours_ttft(engine: LLMEngine, vocab: int, budget: int, repeats: int) -> float:
    """Median seconds from adding one LONG_PROMPT-token prompt to its first token, at step budget ``budget``."""
    engine.scheduler.max_num_batched_tokens = budget
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    times = []
    for r in range(repeats + 1):
        prompt = prompts(1, LONG_PROMPT, vocab, seed=100 + r)[0]
        t = time.perf_counter()
        engine.add_request(prompt, params)
        while engine.has_unfinished():
            engine.step()
        times.append(time.perf_counter() - t)
    return statistics.median(times[1:])


# -- transformers ---------------------------------------------------------------------------------


def hf_model(model_dir: Path, device: torch.device, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="sdpa").to(device).eval()


@torch.inference_mode()
def hf_decode_step(model, batch: int, vocab: int, steps: int, device: torch.device) -> float:
    """Mean seconds of one eager decoding forward (dynamic cache) with ``batch`` sequences, prompts prefilled first."""
    ids = torch.tensor(prompts(batch, PROMPT_LEN, vocab, seed=batch), device=device)
    out = model(ids, use_cache=True, logits_to_keep=1)
    past, nxt = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
    for i in range(steps + 3):
        if i == 3:
            sync(device)
            t = time.perf_counter()
        out = model(nxt, past_key_values=past, use_cache=True)
        past, nxt = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
    sync(device)
    return (time.perf_counter() - t) / steps


@torch.inference_mode()
def hf_compiled_decode_step(model, batch: int, vocab: int, steps: int, device: torch.device) -> float:
    """Mean seconds of one decoding forward over a static cache, compiled (torch.compile, reduce-overhead)."""
    from transformers import StaticCache

    cache = StaticCache(config=model.config, max_cache_len=PROMPT_LEN + steps + 16)
    ids = torch.tensor(prompts(batch, PROMPT_LEN, vocab, seed=batch), device=device)
    pos = torch.arange(PROMPT_LEN, device=device)
    logits = model(ids, past_key_values=cache, cache_position=pos, use_cache=True, logits_to_keep=1).logits
    nxt = logits[:, -1].argmax(-1, keepdim=True)

    def one(token, position):
        out = model(
            token,
            past_key_values=cache,
            cache_position=position,
            position_ids=position[None].expand(batch, 1),
            use_cache=True,
            return_dict=False,
        )[0]
        return out[:, -1].argmax(-1, keepdim=True)

    step = torch.compile(one, mode="reduce-overhead", fullgraph=True)
    for i in range(steps + 5):
        if i == 5:  # compiled and graphed by now
            sync(device)
            t = time.perf_counter()
        nxt = step(nxt, torch.tensor([PROMPT_LEN + i], device=device)).clone()
    sync(device)
    return (time.perf_counter() - t) / steps


@torch.inference_mode()
def hf_throughput(model, vocab: int, device: torch.device) -> float:
    n, p, o = THROUGHPUT
    ids = torch.tensor(prompts(n, p, vocab, seed=8), device=device)
    kw = dict(max_new_tokens=o, min_new_tokens=o, do_sample=False, pad_token_id=0)
    model.generate(ids[:4, :64], **{**kw, "max_new_tokens": 8, "min_new_tokens": 8})
    sync(device)
    t = time.perf_counter()
    out = model.generate(ids, **kw)
    sync(device)
    return n * (out.shape[1] - p) / (time.perf_counter() - t)


@torch.inference_mode()
def hf_prefill(model, vocab: int, device: torch.device, repeats: int) -> float:
    ids = torch.tensor(prompts(1, LONG_PROMPT, vocab, seed=100), device=device)
    return timed(lambda: model(ids, use_cache=False, logits_to_keep=1).logits.argmax(-1).tolist(), device, repeats)


# -- the run --------------------------------------------------------------------------------------


class Results:
    """Figures as they come (a failed measurement records its error and the run goes on); written after each."""

    def __init__(self, path: Path | None):
        self.path, self.data, self.errors = path, {}, {}

    def measure(self, name: str, fn: Callable[[], float]) -> float | None:
        t = time.perf_counter()
        try:
            value = fn()
        except Exception as e:  # noqa: BLE001 - one baseline failing must not lose the others
            traceback.print_exc()
            self.errors[name] = f"{type(e).__name__}: {e}"
            value = None
        self.data[name] = value
        print(f"  {name}: {value!r} ({time.perf_counter() - t:.1f} s)", flush=True)
        self.save()
        return value

    def save(self) -> None:
        if self.path is not None:
            self.path.write_text(json.dumps({"results": self.data, "errors": self.errors}, indent=1))


def report(r: dict, shape: Shape, rate: float, flops: float) -> list[tuple[str, ...]]:
    """Rows: what, ours, transformers eager, transformers compiled, limit, ours / limit, ours vs each baseline."""

    def ms(x):
        return "-" if x is None else f"{x * 1e3:.2f} ms"

    def ratio(a, b):
        return "-" if a is None or b is None else f"{a / b:.2f}x"

    rows = [
        (
            "figure",
            "ours",
            "ours eager",
            "HF eager",
            "HF compiled",
            "limit",
            "ours/limit",
            "HF eager/ours",
            "HF compiled/ours",
        )
    ]
    for batch in (1, 32):
        limit = shape.decode_bytes(batch, PROMPT_LEN + 10) / rate
        o, e, h, c = (r.get(f"{k}_decode_{batch}") for k in ("ours", "ours_eager", "hf", "hf_compiled"))
        rows.append(
            (
                f"decode step, {batch} running",
                ms(o),
                ms(e),
                ms(h),
                ms(c),
                ms(limit),
                ratio(o, limit),
                ratio(h, o),
                ratio(c, o),
            )
        )
    n, p, out = THROUGHPUT
    tput_limit = n / (shape.decode_bytes(n, p + out // 2) / rate)
    o, h = r.get("ours_throughput"), r.get("hf_throughput")
    fmt = lambda x: "-" if x is None else f"{x:,.0f} tok/s"
    rows.append(
        (
            f"{n} x {p}/{out} output tok/s",
            fmt(o),
            "-",
            fmt(h),
            "-",
            fmt(tput_limit),
            ratio(o, tput_limit),
            ratio(o, h),
            "-",
        )
    )
    limit = shape.prefill_flops(LONG_PROMPT) / flops
    prompts = [(f"ours_ttft_{b}", f"{b}-token steps") for b in BUDGETS]
    prompts += [("ours_ttft_default", "default steps"), ("ours_ttft_default_unfused", "torch's elementwise")]
    for key, what in prompts:
        o = r.get(key)
        rows.append(
            (
                f"{LONG_PROMPT}-token prompt, {what}",
                ms(o),
                "-",
                ms(r.get("hf_prefill")),
                "-",
                ms(limit),
                ratio(o, limit),
                ratio(r.get("hf_prefill"), o),
                "-",
            )
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama-1b")
    ap.add_argument("--device", default="cuda", help="cuda[:N], or cpu for a dry run of the script")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    ap.add_argument("--json", type=Path, help="write the figures here (after each measurement)")
    ap.add_argument("--model-dir", type=Path, help="where to make the model (default: a temporary directory)")
    ap.add_argument("--steps", type=int, default=50, help="decode steps timed per figure")
    ap.add_argument("--repeats", type=int, default=3, help="prefill repeats (median)")
    ap.add_argument("--no-transformers", action="store_true", help="skip transformers (eager and compiled)")
    ap.add_argument("--no-compiled", action="store_true", help="skip transformers' compiled static-cache decode")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("--device cuda: no CUDA GPU here (use --device cpu for a dry run)", file=sys.stderr)
        return 2
    dtype = DTYPES[args.dtype]
    results = Results(args.json)
    r = results.data
    model_dir = args.model_dir or Path(tempfile.mkdtemp(prefix="gpu-bench-")) / "model"
    print(f"making a random-weight {args.shape} model in {model_dir} ...", flush=True)
    make_tiny(model_dir, "llama", dtype=dtype, **SHAPES[args.shape])
    config = json.loads((model_dir / "config.json").read_text())
    shape, vocab = Shape(config, dtype), config["vocab_size"]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"{name}, torch {torch.__version__}, {shape.params / 1e9:.3f} B parameters, {args.dtype}", flush=True)
    rate = results.measure("copy_rate_bytes_per_s", lambda: copy_rate(device))
    flops = results.measure("matmul_flops_per_s", lambda: matmul_rate(device, dtype))

    sdpa_priority = None
    if device.type == "cuda":  # torch may settle its order at the first attention call: read it after one
        x = torch.zeros(1, 8, 16, 64, device=device, dtype=dtype)
        torch.nn.functional.scaled_dot_product_attention(x, x, x, is_causal=True)
        sdpa_priority = torch._C._get_sdp_priority_order()
    try:
        engine = engine_for(model_dir, args.device, args.dtype)
    except Exception as e:  # noqa: BLE001 - a failed capture still leaves the eager figures to measure
        traceback.print_exc()
        results.errors["engine"] = f"{type(e).__name__}: {e}"
        engine = engine_for(model_dir, args.device, args.dtype, enforce_eager=True)
    r["default_budget"] = engine.config.max_num_batched_tokens
    r["graphs"] = engine.runner.graphs is not None and bool(engine.runner.graphs.graphs)
    for batch in (1, 32):
        results.measure(f"ours_decode_{batch}", lambda: ours_decode_step(engine, batch, vocab, args.steps))
    graphs, engine.runner.graphs = engine.runner.graphs, None  # the eager path of the same engine
    for batch in (1, 32):
        results.measure(f"ours_eager_decode_{batch}", lambda: ours_decode_step(engine, batch, vocab, args.steps))
    engine.runner.graphs = graphs
    results.measure("ours_throughput", lambda: ours_throughput(engine, vocab))
    default = engine.config.max_num_batched_tokens
    results.measure("ours_ttft_default", lambda: ours_ttft(engine, vocab, default, args.repeats))
    with mock.patch.object(engine_model, "fused", lambda x, name: None):  # torch's kernels between the matmuls
        results.measure("ours_ttft_default_unfused", lambda: ours_ttft(engine, vocab, default, args.repeats))
    for budget in BUDGETS:
        results.measure(f"ours_ttft_{budget}", lambda: ours_ttft(engine, vocab, budget, args.repeats))
    engine = graphs = None  # freed before the baselines load their copy of the model
    if device.type == "cuda":  # the baselines must run with torch's own attention choices, as ours found them
        r["sdpa_priority_before_ours"], r["sdpa_priority_after_ours"] = (
            sdpa_priority,
            torch._C._get_sdp_priority_order(),
        )
        if sdpa_priority != r["sdpa_priority_after_ours"]:
            results.errors["sdpa_priority"] = "ours changed torch's process-wide SDPA priority order"
    if device.type == "cuda":
        torch.cuda.empty_cache()

    if not args.no_transformers:
        model = None
        try:
            model = hf_model(model_dir, device, dtype)
        except Exception as e:  # noqa: BLE001
            results.errors["transformers"] = f"{type(e).__name__}: {e}"
        if model is not None:
            for batch in (1, 32):
                results.measure(f"hf_decode_{batch}", lambda: hf_decode_step(model, batch, vocab, args.steps, device))
            results.measure("hf_prefill", lambda: hf_prefill(model, vocab, device, args.repeats))
            results.measure("hf_throughput", lambda: hf_throughput(model, vocab, device))
            if not args.no_compiled:
                for batch in (1, 32):
                    results.measure(
                        f"hf_compiled_decode_{batch}",
                        lambda: hf_compiled_decode_step(model, batch, vocab, args.steps, device),
                    )
    rows = report(r, shape, rate or float("nan"), flops or float("nan"))
    r["table"] = rows
    results.save()
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    print(
        f"\n{name}, torch {torch.__version__}, {args.shape} ({shape.params / 1e9:.3f} B parameters, {args.dtype}); "
        f"copy rate {(rate or 0) / 1e12:.2f} TB/s, matmul {(flops or 0) / 1e12:.0f} TFLOP/s; ours' default step budget "
        f"{r['default_budget']}, graphs {'on' if r['graphs'] else 'off'}"
    )
    for row in rows:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)))
    if results.errors:
        print("errors:", json.dumps(results.errors, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
