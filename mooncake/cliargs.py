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


def to_argv(parser: argparse.ArgumentParser, **values: Any) -> list[str]:
    """The argv that gives ``values`` (by each flag's dest) to the component whose flags ``parser`` holds: the flag's
    spelling comes from the parser, so a launcher that starts the component says only what it sets. ``None`` and a
    switch's ``False`` leave the flag out; a list repeats an ``append`` flag. The argv is parsed back before it is
    returned, so a value the component would refuse fails here, in the launcher, with the parser's message.

        to_argv(conductor.__main__.parser(), port=7000, tbt_slo=0.1)   # ['--port', '7000', '--tbt-slo', '0.1']
    """
    flags = {a.dest: a for a in parser._actions if a.option_strings}
    argv: list[str] = []
    for dest, value in values.items():
        action = flags.get(dest)
        if action is None:
            raise ValueError(f"{parser.prog} has no flag for {dest!r}")
        flag = max(action.option_strings, key=len)
        if value is None or value is False:
            continue
        if value is True and action.nargs == 0:
            argv.append(flag)
        elif isinstance(value, (list, tuple)):
            argv += [part for item in value for part in (flag, _text(item))]
        else:
            argv += [flag, _text(value)]
    try:
        parser.parse_args(argv)
    except SystemExit:
        raise ValueError(f"{parser.prog} refuses {' '.join(argv)} (its message is above)") from None
    return argv


def _text(value: Any) -> str:
    return str(value.value if isinstance(value, enum.Enum) else value)
