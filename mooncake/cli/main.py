"""The ``mooncake`` console script: one Typer app with a sub-app per area."""

from __future__ import annotations

import logging

import typer

from mooncake.cli import chat_cmd, model_cmd

app = typer.Typer(
    help="Mooncake-style disaggregated LLM serving: models, a single-engine chat, and (later) the cluster.",
    no_args_is_help=True,
)
app.add_typer(model_cmd.app, name="model")
app.command("chat")(chat_cmd.chat)
app.command("generate")(chat_cmd.generate)


@app.callback()
def _main(verbose: bool = typer.Option(False, "--verbose", "-v", help="Log at INFO level")) -> None:
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")


if __name__ == "__main__":
    app()
