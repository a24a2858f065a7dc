"""Command-line flags read off a pydantic config: the model's field is the one place a setting's type, default,
choices and help are written; a component's argparse parser only names the flag.

    field_arg(parser, DecodeConfig, "detect_s", "--detect-s")      # type float, default 2.0, the field's help
    field_arg(parser, EngineConfig, "max_num_seqs", default=32)    # a worker's own default for the engine's field

The flag's dest is argparse's own (``--detect-s`` -> ``args.detect_s``); the caller builds the config from ``args``.
"""

from __future__ import annotations

import argparse
import enum
import types
import typing
from typing import Any

from pydantic import BaseModel

_MISSING = object()


def field_arg(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    model: type[BaseModel],
    field: str,
    flag: str | None = None,
    *,
    default: Any = _MISSING,
    **extra: Any,
) -> argparse.Action:
    """Add ``flag`` (default ``--field-name``) for ``model.field``: a bool is a switch that turns on what defaults to
    off, an enum or Literal offers its values, ``X | None`` takes an X. ``extra`` goes to ``add_argument`` as is."""
    info = model.model_fields[field]
    kind = info.annotation
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        kind = next(a for a in typing.get_args(kind) if a is not type(None))
    kwargs: dict[str, Any] = {"help": info.description}
    value = info.get_default(call_default_factory=True) if default is _MISSING else default
    if kind is bool:
        if value:
            raise ValueError(f"{model.__name__}.{field} defaults to on: name the flag that turns it off yourself")
        kwargs["action"] = "store_true"
    else:
        kwargs["default"] = value.value if isinstance(value, enum.Enum) else value
        if isinstance(kind, type) and issubclass(kind, enum.Enum):
            kwargs["choices"] = [member.value for member in kind]
        elif typing.get_origin(kind) is typing.Literal:
            kwargs["choices"] = list(typing.get_args(kind))
        elif kind in (int, float, str):
            kwargs["type"] = kind
    kwargs.update(extra)
    return parser.add_argument(flag or "--" + field.replace("_", "-"), **kwargs)
