"""Rendering Hugging Face chat templates (Jinja) the way transformers renders them.

Chat templates ship inside model files and are untrusted code, so they run in Jinja's
``ImmutableSandboxedEnvironment``. The environment matches transformers'
``apply_chat_template`` so a prompt renders to the same string here and there:

- ``trim_blocks`` and ``lstrip_blocks`` on; the ``loopcontrols`` extension
  (``{% break %}`` / ``{% continue %}``) and a ``{% generation %}`` block tag that
  just renders its body;
- globals ``raise_exception(msg)``, ``strftime_now(fmt)``, ``dict``, ``namespace``
  (refusing underscore-prefixed attributes), filter ``tojson`` that does not escape
  HTML and accepts ``indent`` / ``separators`` / ``sort_keys``;
- variables ``messages``, ``tools``, ``documents``, ``add_generation_prompt`` and the
  special tokens (``bos_token``, ``eos_token``, ...), plus caller keywords;
- messages are copied to plain JSON data first, and a message's reasoning given as
  ``reasoning_content`` / ``thinking`` / ``reasoning`` is visible under the first two
  names, as transformers does.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Mapping
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class _GenerationBlock(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: marks assistant text; renders the body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


class _TemplateDict:
    """``dict(...)`` for templates, without exposing the ``dict`` type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """Jinja's ``namespace`` refusing underscore-prefixed names (no reach into internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - same trick as Namespace
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot set underscore-prefixed attributes on a namespace, got {name!r}"
            )


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False
) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=32)
def compile_chat_template(source: str) -> jinja2.Template:
    """Compile a chat template in the sandbox (cached per source string).

    Raises ``ValueError`` for a template with a syntax error.
    """
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as exc:
        raise ValueError(f"chat template has a syntax error (line {exc.lineno}): {exc.message}") from exc


def plain_template_data(value: Any) -> Any:
    """A deep copy of ``value`` made only of JSON-like types (what templates may see).

    Dataclasses and pydantic models become dicts; anything else non-plain becomes a
    placeholder string like ``"<ndarray>"``, since templates only test media for presence.
    """
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {plain_template_data(k): plain_template_data(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain_template_data(item) for item in value]
    if isinstance(value, tuple):
        return tuple(plain_template_data(item) for item in value)
    if hasattr(value, "item") and callable(value.item) and getattr(value, "shape", None) == ():
        return plain_template_data(value.item())  # numpy / torch scalars
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain_template_data(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return plain_template_data(value.model_dump())
    return f"<{type(value).__name__}>"


def _alias_reasoning(message: dict[str, Any]) -> dict[str, Any]:
    reasoning = next((message[key] for key in _REASONING_FIELDS if message.get(key) is not None), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


def render_chat_template(
    source: str, messages: list[dict[str, Any]], add_generation_prompt: bool, variables: Mapping[str, Any]
) -> str:
    """Render one conversation with a chat template.

    ``variables`` holds the special tokens and any extra template keywords (``tools``
    and ``documents`` default to None, as in transformers). Raises ``ValueError`` for
    messages that are not dicts or when the template calls ``raise_exception``.
    """
    if not isinstance(messages, list):
        raise ValueError(f"messages must be a list of dicts, got {type(messages).__name__}")
    chat = plain_template_data(messages)
    for message in chat:
        if not isinstance(message, dict):
            raise ValueError(f"chat messages must be dicts, got {message!r}")
    chat = [_alias_reasoning(message) for message in chat]
    extra = plain_template_data(dict(variables))
    tools = extra.pop("tools", None)
    documents = extra.pop("documents", None)
    template = compile_chat_template(source)
    try:
        return template.render(
            messages=chat, tools=tools, documents=documents, add_generation_prompt=add_generation_prompt, **extra
        )
    except jinja2.exceptions.TemplateError as exc:
        raise ValueError(f"chat template rejected the conversation: {exc}") from exc
