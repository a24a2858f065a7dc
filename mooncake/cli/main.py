"""The ``mooncake`` console script: one Typer app with a sub-app per area."""

from __future__ import annotations

import logging

import typer

from mooncake.cli import chat_cmd, model_cmd, pool_cmd, up_cmd

app = typer.Typer(
    help="Mooncake-style disaggregated LLM serving: the cluster (up, serve), models, and a single-engine chat.",
    no_args_is_help=True,
)
app.add_typer(model_cmd.app, name="model")
app.command("chat")(chat_cmd.chat)
app.command("generate")(chat_cmd.generate)
app.command("up")(up_cmd.up)
app.command("status")(pool_cmd.status)
app.command("plan")(pool_cmd.plan)
app.add_typer(pool_cmd.app, name="pool")
app.command(
    "serve", context_settings={"allow_extra_args": True, "ignore_unknown_options": True, "help_option_names": []}
)(up_cmd.serve)


@app.callback()
def _main(verbose: bool = typer.Option(False, "--verbose", "-v", help="Log at INFO level")) -> None:
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )


if __name__ == "__main__":
    app()
