"""Mooncake's conversation trace (traces/README.md) and the requests a replay makes of it.

**How the trace is scaled** (printed with every result, and stored in the JSON):

- Each hash id (one per 512-token block of the trace) becomes a fixed pseudo-random run of
  ``--block-tokens`` token ids, seeded by the id alone: the same id gives the same tokens
  in every run and against every system, so prompts that share leading hash ids share
  that prefix token for token. Ids are drawn from ``[100, vocab)`` (the lowest ids are
  special tokens); the vocabulary size comes from ``--model-dir``'s config.json, else
  ``--vocab-size`` (49,152: SmolLM2's).
- Lengths are scaled by ``block_tokens / 512``: a prompt is the concatenation of its
  blocks, cut to ``round(input_length * block_tokens / 512)`` tokens (at least 1, at most
  ``--max-input``; the cut keeps the leading tokens, so prefixes stay shared). The output
  is ``round(output_length * --output-scale)`` tokens, clamped to ``[1, --max-output]``,
  forced with ``ignore_eos``.
- Time: the trace's timestamps come in steps of ~3 s (1,180 distinct values for 12,031
  requests, ~10 a step); sending a step's requests together would make bursts the trace
  never recorded, so request j of the n stamped t arrives at ``t + j * (t_next - t) / n``
  (``--no-spread``: all at t). Request i is then sent ``arrival_i / speed`` seconds after
  the start (open loop: nothing waits for an earlier request); only the first ``--limit``
  records are used. A sweep runs the replay once per rate factor f at speed ``speed * f``; rate factor k of
  the sweep (in increasing order) salts the token mapping with k, so every rate starts
  with prompts no cache has seen while keeping the trace's sharing within the run (k = 0,
  the first or only rate, is the unsalted mapping).

Defaults (SmolLM2-135M on one CPU thread a worker): ``--block-tokens 16`` (the trace's
~12k-token mean prompt becomes ~380 tokens, and a trace block is exactly one 16-token KV
block), ``--output-scale 0.0625`` (the trace's ~350-token mean output becomes ~22 tokens;
``--max-output 32``), ``--max-input 1024`` (a prompt alone then prefills in ~4 s, inside the
TTFT SLO; uncut, the trace's longest would be ~4k tokens, 15 s: 8% of the first 200 are
cut), ``--speed 0.25`` (the first 200 requests, 72 s of trace, arrive over 4.8 minutes:
0.7 req/s, ~250 prompt tokens/s, about what one prefill thread computes; see
benchmarks/README.md). SLOs: TTFT 10 s (2.5x the ~4 s prefill of the longest prompt, 1,024
tokens, on one thread) and TBT 0.5 s (5 to 9x a lone decode step, 55 to 90 ms; with two
prefill workers and a decode worker on 2 cores the decode step under load is 100 to 200
ms, and at 0.25 s the decode worker capped its batch at 2 and the cluster turned most
requests away).
"""

from __future__ import annotations

import argparse
import collections
import functools
import gzip
import json
import random
from dataclasses import dataclass
from pathlib import Path

DEFAULT_TRACE = Path(__file__).resolve().parent / "traces" / "conversation_trace.jsonl.gz"  # traces/README.md
TRACE_BLOCK_TOKENS = 512  # tokens behind one hash id in a Mooncake trace
MIN_TOKEN_ID = 100  # ids under this are left to special tokens
SMOLLM2_VOCAB = 49152

DEFAULTS = dict(
    block_tokens=16,
    output_scale=0.0625,
    max_input=1024,
    max_output=32,
    speed=0.25,
    limit=200,
    ttft_slo_s=10.0,
    tbt_slo_s=0.5,
    effective_target=0.9,
)
# compare.py --device cuda: the trace nearer its own scale, for one GPU serving a model of a billion parameters or so
# (longer prompts, real time, SLOs a GPU can be held to). A first guess, not yet run on a GPU; each is a flag.
GPU_SCALE = dict(block_tokens=128, max_input=8192, speed=1.0, ttft_slo_s=2.0, tbt_slo_s=0.1)
# Output scalings by workload (``--preset``): the conversation trace as compare.py has always scaled it, and a
# prefill-heavy one (outputs of 1 to 8 tokens: the prefill pool and the Conductor's TTFT predictions are what binds)
PRESETS = {
    "conversation": dict(output_scale=0.0625, max_output=32),
    "prefill-heavy": dict(output_scale=1 / 64, max_output=8),
}


def open_trace(path: Path | str):
    """A trace's lines as text: gzip-compressed (``.gz``, as the repository keeps Mooncake's) or plain JSON lines."""
    path = Path(path)
    return gzip.open(path, "rt") if path.suffix == ".gz" else open(path)


# -- the trace ----------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Scaling:
    """How trace records become requests for a small model (see the module docstring)."""

    block_tokens: int = DEFAULTS["block_tokens"]
    output_scale: float = DEFAULTS["output_scale"]
    max_input: int = DEFAULTS["max_input"]
    max_output: int = DEFAULTS["max_output"]
    vocab_size: int = SMOLLM2_VOCAB
    limit: int | None = None
    spread: bool = True  # requests of one trace timestamp spread over the step to the next

    def __post_init__(self) -> None:
        if self.block_tokens < 1 or self.max_input < 1 or self.max_output < 1 or self.output_scale <= 0:
            raise ValueError(f"block_tokens, max_input and max_output must be >= 1 and output_scale > 0: {self}")
        if self.vocab_size <= MIN_TOKEN_ID + 1:
            raise ValueError(
                f"vocab_size must be above {MIN_TOKEN_ID + 1} (ids under {MIN_TOKEN_ID} are "
                f"avoided), got {self.vocab_size}"
            )
        if self.limit is not None and self.limit < 1:
            raise ValueError(f"limit must be positive, got {self.limit}")

    @property
    def length_factor(self) -> float:
        return self.block_tokens / TRACE_BLOCK_TOKENS

    def input_tokens(self, input_length: int) -> int:
        return min(self.max_input, max(1, round(input_length * self.length_factor)))

    def output_tokens(self, output_length: int) -> int:
        return min(self.max_output, max(1, round(output_length * self.output_scale)))

    def describe(self, speed: float | None = None) -> str:
        """One line saying exactly how the trace was scaled."""
        time_part = f"; time x{1 / speed:g} (speed {speed:g})" if speed else ""
        time_part += (
            "; arrivals spread within each 3-s timestamp step" if self.spread else "; arrivals as stamped (no spread)"
        )
        return (
            f"trace scaled: {self.block_tokens} tokens a hash id (lengths x{self.length_factor:g} = "
            f"{self.block_tokens}/512), prompt <= {self.max_input} tokens, output x{self.output_scale:g} clamped to "
            f"[1, {self.max_output}], token ids in [{MIN_TOKEN_ID}, {self.vocab_size}){time_part}; "
            f"{'all records' if self.limit is None else f'first {self.limit} records'}"
        )


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One trace record, scaled: arrival in trace seconds (before --speed), the prompt's blocks and lengths."""

    index: int
    arrival_s: float
    hash_ids: tuple[int, ...]
    input_length: int  # the trace's
    output_length: int  # the trace's
    prompt_tokens: int  # scaled
    max_tokens: int  # scaled
    block_tokens: int
    vocab_size: int

    def prompt(self, salt: int = 0) -> list[int]:
        return build_prompt(self.hash_ids, self.prompt_tokens, self.block_tokens, self.vocab_size, salt)


@functools.lru_cache(maxsize=1 << 16)
def block_token_ids(hash_id: int, block_tokens: int, vocab_size: int, salt: int = 0) -> tuple[int, ...]:
    """The fixed token ids standing for trace block ``hash_id``: the same arguments, the same ids, in every process."""
    rng = random.Random(
        f"trace-block/{salt}/{hash_id}"
    )  # a str seed hashes with SHA-512: stable across runs and machines
    return tuple(rng.randrange(MIN_TOKEN_ID, vocab_size) for _ in range(block_tokens))


def build_prompt(
    hash_ids: tuple[int, ...] | list[int], num_tokens: int, block_tokens: int, vocab_size: int, salt: int = 0
) -> list[int]:
    """The blocks of ``hash_ids`` concatenated, cut to ``num_tokens`` (never more than the blocks hold)."""
    out: list[int] = []
    for h in hash_ids:
        if len(out) >= num_tokens:
            break
        out.extend(block_token_ids(int(h), block_tokens, vocab_size, salt))
    return out[:num_tokens]


def trace_from_args(args, vocab_size: int, limit: int | None) -> tuple[list[TraceRequest], Scaling]:
    """The requests :func:`add_trace_args`'s flags ask for, from ``args.trace``, and the scaling that made them."""
    scaling = Scaling(
        args.block_tokens, args.output_scale, args.max_input, args.max_output, vocab_size, limit, not args.no_spread
    )
    requests = load_trace(
        args.trace,
        scaling.block_tokens,
        output_scale=scaling.output_scale,
        max_input=scaling.max_input,
        max_output=scaling.max_output,
        limit=scaling.limit,
        vocab_size=scaling.vocab_size,
        spread=scaling.spread,
    )
    return requests, scaling


def load_trace(
    path: Path | str,
    block_tokens: int = DEFAULTS["block_tokens"],
    *,
    output_scale: float = DEFAULTS["output_scale"],
    max_input: int = DEFAULTS["max_input"],
    max_output: int = DEFAULTS["max_output"],
    limit: int | None = None,
    vocab_size: int = SMOLLM2_VOCAB,
    spread: bool = True,
) -> list[TraceRequest]:
    """Read a Mooncake trace (JSON lines) and scale its first ``limit`` records (see ``Scaling``).

    ``spread``: the trace's timestamps come in steps of about 3 s, ~10 requests a step;
    the requests of one timestamp get arrivals spread evenly over the interval to the
    next timestamp (the last one's: the interval before it), instead of all at once.
    """
    scaling = Scaling(block_tokens, output_scale, max_input, max_output, vocab_size, limit, spread)
    records: list[dict] = []
    next_ts: float | None = None  # the first timestamp after the records kept (to spread the last group)
    with open_trace(path) as f:
        for line in f:
            if not line.strip():
                continue
            rec = json.loads(line)
            if limit is not None and len(records) >= limit:
                if rec["timestamp"] > records[-1]["timestamp"] or not spread:
                    next_ts = rec["timestamp"]
                    break
                records.append(rec)  # the rest of the last group: counted for spreading, dropped below
                continue
            records.append(rec)
    if not records:
        raise ValueError(f"{path}: no trace records")
    arrivals = (
        _spread_arrivals([r["timestamp"] for r in records], next_ts) if spread else [r["timestamp"] for r in records]
    )
    out: list[TraceRequest] = []
    for rec, arrival_ms in zip(records[:limit], arrivals):
        ids = tuple(int(h) for h in rec["hash_ids"])
        if not ids:
            raise ValueError(f"{path}: record {len(out)} has no hash_ids")
        tokens = min(scaling.input_tokens(int(rec["input_length"])), len(ids) * block_tokens)
        out.append(
            TraceRequest(
                len(out),
                arrival_ms / 1000.0,
                ids,
                int(rec["input_length"]),
                int(rec["output_length"]),
                tokens,
                scaling.output_tokens(int(rec["output_length"])),
                block_tokens,
                vocab_size,
            )
        )
    return out


def _spread_arrivals(timestamps: list[float], next_ts: float | None) -> list[float]:
    """Request j of the n sharing timestamp t arrives at t + j * (t_next - t) / n (ms; timestamps sorted)."""
    if any(b < a for a, b in zip(timestamps, timestamps[1:])):
        raise ValueError("trace timestamps must be sorted")
    distinct = sorted(set(timestamps))
    following = {t: u for t, u in zip(distinct, distinct[1:])}
    last_step = distinct[-1] - distinct[-2] if len(distinct) > 1 else 0.0
    following[distinct[-1]] = next_ts if next_ts is not None else distinct[-1] + last_step
    sizes = collections.Counter(timestamps)
    out: list[float] = []
    j = 0  # the request's place in its group
    for i, t in enumerate(timestamps):
        j = j + 1 if i and timestamps[i - 1] == t else 0
        out.append(t + j * (following[t] - t) / sizes[t])
    return out


def vocab_size_of(model_dir: Path | str) -> int:
    """``vocab_size`` from a Hugging Face model directory's config.json."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    size = config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size")
    if not size:
        raise ValueError(f"{model_dir}/config.json has no vocab_size")
    return int(size)


def apply_preset(args: argparse.Namespace, scale: dict | None = None) -> None:
    """Fill --output-scale and --max-output from --preset, and --block-tokens, --max-input and the SLOs from ``scale``
    (default: DEFAULTS, this CPU's; GPU_SCALE for a GPU), where they were not given."""
    scale = {**DEFAULTS, **(scale or {})}
    given = {
        "block_tokens": scale["block_tokens"],
        "max_input": scale["max_input"],
        "ttft_slo": scale["ttft_slo_s"],
        "tbt_slo": scale["tbt_slo_s"],
        **PRESETS[args.preset],
    }
    for name, value in given.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
