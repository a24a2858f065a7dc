"""``mooncake chat`` and ``mooncake generate``: one engine in this process, no cluster.

This is what ``make up`` runs until the disaggregated serving stack exists: it pulls
the model if needed, builds an LLMEngine and streams tokens to the terminal.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.console import Console

from mooncake.engine.registry import KNOWN_MODELS, default_cache_dir, pull, resolve_model
from mooncake.engine.request import SamplingParams
from mooncake.engine.tokenizer import IncrementalDetokenizer, Tokenizer

if TYPE_CHECKING:
    from mooncake.engine import LLMEngine

console = Console(stderr=True)

ModelOpt = typer.Option(
    "smollm2-135m",
    "--model",
    "-m",
    help="A known model name (pulled on first use), a Hugging Face model directory, or a hub id "
    "(org/name: from huggingface_hub's cache, downloaded where the hub is reachable)",
)
CacheOpt = typer.Option(None, "--cache-dir", help="Model cache directory [default: ~/.cache/mooncake/models]")
MaxTokOpt = typer.Option(256, "--max-tokens", min=1, help="Most tokens to generate per reply")
TempOpt = typer.Option(0.0, "--temperature", "-t", min=0.0, help="0 = greedy")
TopPOpt = typer.Option(1.0, "--top-p", min=0.0, max=1.0)
SeedOpt = typer.Option(None, "--seed", help="Seed for sampling (reproducible output)")
DeviceOpt = typer.Option("cpu", "--device", help="cpu or cuda[:N]")


def _model_dir(model: str, cache_dir: Path | None) -> Path:
    cache = cache_dir or default_cache_dir()
    if model in KNOWN_MODELS:
        return pull(model, cache, progress=True)
    return resolve_model(model, cache)


def _load(model: str, cache_dir: Path | None, device: str) -> tuple[LLMEngine, Tokenizer]:
    path = _model_dir(model, cache_dir)
    with console.status(f"loading {path.name} (the first start compiles a kernel, about a minute)"):
        tokenizer = Tokenizer.from_dir(path)
        from mooncake.engine import EngineConfig, LLMEngine  # here: the CLI's other commands start without torch

        engine = LLMEngine(EngineConfig(model=str(path), device=device), tokenizer=tokenizer)
    return engine, tokenizer


def _stream(engine: LLMEngine, tokenizer: Tokenizer, prompt_ids: list[int], params: SamplingParams) -> str:
    """Generate one reply, printing text as it arrives; return the whole reply."""
    rid = engine.add_request(prompt_ids, params)
    detok = IncrementalDetokenizer(tokenizer, prompt_ids)
    start = time.perf_counter()
    first = None
    n = 0
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id != rid:
                continue
            first = first or time.perf_counter()
            n = len(out.output_token_ids)
            new = [t for t in out.new_token_ids if t not in tokenizer.eos_token_ids]
            sys.stdout.write(detok.push(new))
            sys.stdout.flush()
    sys.stdout.write(detok.flush() + "\n")
    end = time.perf_counter()
    if first is not None:
        tbt = (end - first) / max(1, n - 1)
        console.print(f"[dim]{n} tokens, TTFT {first - start:.2f} s, {1 / tbt if tbt else 0:.1f} tokens/s[/dim]")
    return detok.text


def chat(
    model: str = ModelOpt,
    cache_dir: Path = CacheOpt,
    system: str = typer.Option(None, "--system", help="System prompt"),
    max_tokens: int = MaxTokOpt,
    temperature: float = TempOpt,
    top_p: float = TopPOpt,
    seed: int = SeedOpt,
    device: str = DeviceOpt,
) -> None:
    """Chat with a model in this terminal (single engine, no cluster). Ctrl-D or /exit quits."""
    engine, tokenizer = _load(model, cache_dir, device)
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed)
    messages: list[dict[str, str]] = [{"role": "system", "content": system}] if system else []
    console.print("[bold green]ready[/bold green]: type a message (/reset clears the history, /exit quits)")
    while True:
        try:
            line = input("you> ").strip()
        except (EOFError, KeyboardInterrupt):
            console.print()
            return
        if line in ("/exit", "/quit"):
            return
        if line == "/reset":
            messages = messages[:1] if system else []
            continue
        if not line:
            continue
        messages.append({"role": "user", "content": line})
        ids = tokenizer.encode_chat(messages)
        if len(ids) >= engine.max_model_len:
            console.print("[red]the conversation no longer fits the context; /reset to start over[/red]")
            messages.pop()
            continue
        sys.stdout.write("assistant> ")
        reply = _stream(engine, tokenizer, ids, params)
        messages.append({"role": "assistant", "content": reply})


def generate(
    prompt: str = typer.Argument(..., help="The user message (rendered with the chat template unless --raw)"),
    model: str = ModelOpt,
    cache_dir: Path = CacheOpt,
    raw: bool = typer.Option(False, "--raw", help="Send the prompt as plain text, without the chat template"),
    max_tokens: int = MaxTokOpt,
    temperature: float = TempOpt,
    top_p: float = TopPOpt,
    seed: int = SeedOpt,
    device: str = DeviceOpt,
) -> None:
    """Generate one reply to PROMPT and print it."""
    engine, tokenizer = _load(model, cache_dir, device)
    ids = tokenizer.encode(prompt) if raw else tokenizer.encode_chat([{"role": "user", "content": prompt}])
    try:
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed)
        _stream(engine, tokenizer, ids, params)
    except ValueError as e:
        console.print(f"[red]error:[/red] {e}")
        raise typer.Exit(2) from None
