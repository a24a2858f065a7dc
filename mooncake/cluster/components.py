"""The cluster's components by name: the module ``python -m`` runs for each, its flags, and the command that starts
it with given values (``mooncake up`` and ``mooncake run``)."""

from __future__ import annotations

import argparse
import functools
import importlib
import sys
from typing import Any

from mooncake.cliargs import to_argv

# Each component: the module ``python -m`` runs, and the module whose ``main()`` and ``parser()`` it calls
COMPONENTS = {
    "conductor": ("conductor", "conductor.__main__"),
    "kvstore": ("kvstore", "kvstore.__main__"),
    "prefill": ("prefill", "prefill.server"),
    "prefill-stage": ("prefill.stage", "prefill.stage"),
    "decode": ("decode", "decode.server"),
    "gateway": ("mooncake.gateway", "mooncake.gateway.__main__"),
}


@functools.cache
def component_parser(name: str) -> argparse.ArgumentParser:
    """Component ``name``'s flags (imported on first use: the workers' modules import the engine)."""
    return importlib.import_module(COMPONENTS[name][1]).parser()


def component_argv(name: str, **values: Any) -> list[str]:
    """The command that starts component ``name`` with ``values`` as its flags (by dest: mooncake.cliargs.to_argv)."""
    return [sys.executable, "-m", COMPONENTS[name][0], *to_argv(component_parser(name), **values)]
