"""Reading tool calls out of a model's output, in the format its family was trained on (vLLM's tool-call parsers).

- ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any number, anywhere
  (Qwen, Hermes, and every model whose template does not render tools: tools.py renders
  them in this format then);
- ``llama3_json``: the output is ``{"name": ..., "parameters": {...}}`` (``arguments`` is read
  too), optionally after ``<|python_tag|>``, several separated by ``;``;
- ``mistral``: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` after any text, or the
  newer ``[TOOL_CALLS]name[ARGS]{...}`` (``[TOOL_CALLS]`` is a special token: a request
  with tools keeps special tokens in its text, as vLLM does);
- ``pythonic``: the output is a Python list of calls, ``[f(a=1), g(b="x")]`` (Llama 3.2 and 4),
  optionally inside ``<|python_start|>...<|python_end|>``; arguments must be literals.

A call naming no given tool, or whose arguments are not an object, stays text. A forced
call (``tool_choice`` required or named) is always written in the Hermes format, which the
grammar imposes (tools.lark_grammar), so it is read with ``hermes`` whatever the model.

``detect`` picks the format from the chat template. Streams hold text back from where a
call may start (``may_open_call``) and parse it whole at the end. Pure functions.
"""

from __future__ import annotations

import ast
import enum
import json
import re
import uuid
from typing import Any

from mooncake.gateway import tools
from mooncake.gateway.protocol import FunctionCall, ToolCall
from mooncake.gateway.tools import ToolPlan

PYTHON_TAG = "<|python_tag|>"
MISTRAL_CALLS, MISTRAL_ARGS = "[TOOL_CALLS]", "[ARGS]"
PYTHON_START, PYTHON_END = "<|python_start|>", "<|python_end|>"


class ToolCallParser(str, enum.Enum):
    """The gateway's ``--tool-call-parser``: a format, or ``auto`` (from the chat template)."""

    AUTO = "auto"
    HERMES = "hermes"
    LLAMA3_JSON = "llama3_json"
    MISTRAL = "mistral"
    PYTHONIC = "pythonic"


def detect(chat_template: str | None) -> ToolCallParser:
    """The format a chat template teaches its model (HERMES when it renders no tools: tools.py then renders them
    in Hermes' format)."""
    template = chat_template or ""
    if not tools.template_supports_tools(template):
        return ToolCallParser.HERMES
    if "[func_name1(" in template or PYTHON_START in template:
        return ToolCallParser.PYTHONIC
    if MISTRAL_CALLS in template:
        return ToolCallParser.MISTRAL
    if tools.CALL_OPEN in template:
        return ToolCallParser.HERMES
    if (
        PYTHON_TAG in template
        or '"parameters"' in template
        or ("parameters" in template and "function name" in template)
    ):
        return ToolCallParser.LLAMA3_JSON
    return ToolCallParser.HERMES


def effective(parser: ToolCallParser, plan: ToolPlan) -> ToolCallParser:
    """The format to read a request's output in: a forced call's is always Hermes (the grammar writes it)."""
    return ToolCallParser.HERMES if plan.choice != "auto" else parser


def parse(text: str, plan: ToolPlan, parser: ToolCallParser) -> tuple[str | None, list[ToolCall]]:
    """Split the output into its text (None when it held only calls) and its tool calls."""
    parser = effective(parser, plan)
    if parser == ToolCallParser.HERMES:
        return tools.parse(text, plan)
    if parser == ToolCallParser.MISTRAL:
        at = text.find(MISTRAL_CALLS)
        if at == -1:
            return text, []
        before, bodies = text[:at], _mistral_calls(text[at:])
    elif parser == ToolCallParser.LLAMA3_JSON:
        before, bodies = "", _llama3_calls(text)
    else:
        before, bodies = "", _pythonic_calls(text)
    names = {t.function.name for t in plan.tools}
    good = [(n, a) for n, a in bodies or () if n in names and isinstance(a, dict)]
    if not bodies or len(good) != len(bodies):  # not a well-formed list of calls of given tools: it is text
        return text, []
    if not plan.parallel:
        good = good[:1]
    calls = [
        ToolCall(id=f"call_{uuid.uuid4().hex[:24]}", function=FunctionCall(name=n, arguments=json.dumps(a)))
        for n, a in good
    ]
    return before.strip() or None, calls


def may_open_call(text: str, parser: ToolCallParser) -> bool:
    """Whether ``text`` (the output so far) could still turn into a tool call (a stream holds it back until it
    knows)."""
    if parser == ToolCallParser.HERMES:
        return tools.may_open_call(text)
    if parser == ToolCallParser.MISTRAL:
        return MISTRAL_CALLS in text or _ends_with_start_of(text, MISTRAL_CALLS)
    head = text.lstrip()
    starts = ("{", PYTHON_TAG) if parser == ToolCallParser.LLAMA3_JSON else ("[", PYTHON_START)
    return any(head.startswith(s) or s.startswith(head) for s in starts)


def _ends_with_start_of(text: str, tag: str) -> bool:
    tail = text[-len(tag) :]
    return any(tag.startswith(tail[i:]) for i in range(len(tail)))


def _mistral_calls(text: str) -> list[tuple[Any, Any]] | None:
    """``[TOOL_CALLS][{...}, ...]`` or ``[TOOL_CALLS]name[ARGS]{...}`` (repeated); None when malformed."""
    pieces = [p.strip() for p in text.split(MISTRAL_CALLS) if p.strip()]
    calls: list[tuple[Any, Any]] = []
    for piece in pieces:
        if MISTRAL_ARGS in piece:
            name, _, args = piece.partition(MISTRAL_ARGS)
            body = _json(args)
            if body is None:
                return None
            calls.append((name.strip(), body))
            continue
        body = _json(piece)
        for call in body if isinstance(body, list) else [body]:
            if not isinstance(call, dict):
                return None
            calls.append((call.get("name"), call.get("arguments", {})))
    return calls


def _llama3_calls(text: str) -> list[tuple[Any, Any]] | None:
    """``{"name": ..., "parameters": {...}}``, several separated by ``;``, optionally after ``<|python_tag|>``."""
    body = text.strip()
    if body.startswith(PYTHON_TAG):
        body = body[len(PYTHON_TAG) :].strip()
    if not body.startswith("{"):
        return None
    calls: list[tuple[Any, Any]] = []
    decoder = json.JSONDecoder()
    at = 0
    while at < len(body):
        try:
            call, end = decoder.raw_decode(body, at)
        except json.JSONDecodeError:
            return None
        if not isinstance(call, dict):
            return None
        calls.append((call.get("name"), call.get("parameters", call.get("arguments", {}))))
        at = end
        rest = re.match(r"\s*;?\s*", body[at:])
        at += rest.end()
    return calls


def _pythonic_calls(text: str) -> list[tuple[Any, Any]] | None:
    """``[f(a=1), g(b="x")]``: a list of calls by name with literal keyword arguments; None otherwise."""
    body = text.strip()
    if body.startswith(PYTHON_START):
        body = body[len(PYTHON_START) :]
        body = body[: body.rfind(PYTHON_END)] if PYTHON_END in body else body
    body = body.strip()
    if not (body.startswith("[") and body.endswith("]")):
        return None
    try:
        tree = ast.parse(body, mode="eval").body
    except SyntaxError:
        return None
    if not isinstance(tree, ast.List):
        return None
    calls: list[tuple[Any, Any]] = []
    for node in tree.elts:
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
            return None
        try:
            arguments = {k.arg: ast.literal_eval(k.value) for k in node.keywords if k.arg is not None}
        except (ValueError, TypeError, SyntaxError, RecursionError):
            return None
        calls.append((node.func.id, arguments))
    return calls


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None
