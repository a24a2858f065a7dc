"""What constrained decoding costs: decode throughput of our engine with a JSON schema against without, same run.

    python -m benchmarks.structured_bench [--quick] [--model NAME|DIR] [--requests 8] [--items 40] [--repeats 3]

N concurrent requests (sampled at temperature 1, seeded) are constrained to a JSON array
of exactly ``--items`` integers in [0, 999] (llguidance, mooncake/engine/grammar.py), so
every output has a known shape and ends on its own. The baseline is the same requests
without the grammar, each held to the constrained run's token count (``ignore_eos``), so
both generate the same number of tokens. Reported: output tokens/s of each, their ratio,
the grammar's time per masked token (the engine's mask + accept, measured around the
runner), and how many outputs parsed as the schema says. Results: benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.benchutil import describe_machine, resolve_model
from mooncake.engine import EngineConfig, LLMEngine
from mooncake.engine.grammar import GrammarBook, grammar_for
from mooncake.engine.request import SamplingParams
from mooncake.engine.tokenizer import Tokenizer


class TimedBook(GrammarBook):
    """The engine's GrammarBook, timing its masks and accepts."""

    seconds = 0.0
    masks = 0

    def mask_(self, logits, request_id):
        t = time.perf_counter()
        super().mask_(logits, request_id)
        self.seconds += time.perf_counter() - t
        self.masks += 1

    def accept(self, request_id, token_id):
        t = time.perf_counter()
        super().accept(request_id, token_id)
        self.seconds += time.perf_counter() - t


def run(engine: LLMEngine, prompts: list[list[int]], params: list[SamplingParams]) -> tuple[list[list[int]], float]:
    t = time.perf_counter()
    outs = engine.generate(prompts, params)
    return [list(o.output_token_ids) for o in outs], time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="a model directory or registry name (default smollm2-135m)")
    ap.add_argument("--quick", action="store_true", help="a tiny random model, fewer items: a smoke run")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--items", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=3, help="pairs of (constrained, baseline) runs; medians reported")
    ap.add_argument("--json", type=Path, help="write the results here")
    args = ap.parse_args()
    items = 8 if args.quick else args.items
    with tempfile.TemporaryDirectory() as tmp:
        model_dir, model_name = resolve_model(args, Path(tmp))
        tok = Tokenizer.from_dir(model_dir)
        engine = LLMEngine(
            EngineConfig(model=str(model_dir), dtype="float32", num_kv_blocks=1024, max_model_len=2048), tokenizer=tok
        )
        engine.runner.grammars = book = TimedBook(tok.backend.to_str(), engine.runner.vocab_size, engine.eos_token_ids)
        schema = {
            "type": "array",
            "items": {"type": "integer", "minimum": 0, "maximum": 999},
            "minItems": items,
            "maxItems": items,
        }
        grammar = grammar_for(json_schema=schema)
        prompts = [tok.encode(f"List {items} numbers as a JSON array ({i}):") for i in range(args.requests)]
        run(engine, prompts[:1], [SamplingParams(max_tokens=8)])  # warm-up
        constrained_s, baseline_s, grammar_s, tokens, valid = [], [], [], 0, 0
        for r in range(args.repeats):
            book.seconds = 0.0
            params = [
                SamplingParams(max_tokens=16 * items, temperature=1.0, seed=1000 * r + i, grammar=grammar)
                for i in range(args.requests)
            ]
            outs, seconds = run(engine, prompts, params)
            constrained_s.append(seconds)
            grammar_s.append(book.seconds)
            tokens = sum(len(o) for o in outs)
            for o in outs:
                try:
                    value = json.loads(tok.decode(o))
                    valid += isinstance(value, list) and len(value) == items and all(isinstance(v, int) for v in value)
                except json.JSONDecodeError:
                    pass
            base = [
                SamplingParams(max_tokens=len(o), temperature=1.0, seed=1000 * r + i, ignore_eos=True)
                for i, o in enumerate(outs)
            ]
            _, seconds = run(engine, prompts, base)
            baseline_s.append(seconds)
        c, b, g = statistics.median(constrained_s), statistics.median(baseline_s), statistics.median(grammar_s)
        result = {
            "model": model_name,
            "requests": args.requests,
            "items": items,
            "output_tokens": tokens,
            "constrained_tok_s": round(tokens / c, 1),
            "baseline_tok_s": round(tokens / b, 1),
            "ratio": round(b / c, 3),
            "grammar_us_per_token": round(1e6 * g / tokens, 1),
            "valid": f"{valid}/{args.requests * args.repeats}",
            "machine": describe_machine(),
        }
    print(json.dumps(result, indent=2))
    print(
        f"\nconstrained {result['constrained_tok_s']} tok/s vs unconstrained {result['baseline_tok_s']} tok/s: "
        f"ratio {result['ratio']} (1.0 = free); grammar {result['grammar_us_per_token']} "
        f"us/token; valid {result['valid']}"
    )
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
