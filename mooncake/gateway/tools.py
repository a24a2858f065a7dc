"""Tool calling: tools into the prompt, ``tool_choice`` into a grammar, the output back into ``tool_calls``.

Where the model's chat template handles tools (it reads a ``tools`` variable), the tools
and the conversation's tool calls and results go to it as they are. Otherwise (SmolLM2's
template, for one) we use the Hermes format, which many open models are trained on, and
say so in README:

- a system message lists the tools as JSON inside ``<tools></tools>`` and asks for each
  call as ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``;
- an assistant turn's earlier tool calls are rendered that way in its content;
- a tool result (role ``tool``) becomes a user turn ``<tool_response>...</tool_response>``.

``tool_choice``: ``none`` leaves the tools out; ``auto`` lets the model choose, and a
``<tool_call>`` in its output is parsed; ``required`` and a named function constrain the
output with a grammar (mooncake.engine.grammar), so it is always a well-formed call whose
arguments validate against the function's ``parameters`` schema.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from mooncake.engine.grammar import JSON_LAYOUT
from mooncake.gateway.protocol import FunctionCall, ToolCall, ToolDefinition

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

_SYSTEM = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """What a request's tools do to it: extra template variables or messages, a grammar, and how to read the output."""

    tools: tuple[ToolDefinition, ...]
    choice: str  # "auto" | "required" | "named"
    named: str | None  # the function a named tool_choice forces
    parallel: bool


def plan(
    tools: list[ToolDefinition] | None, tool_choice: str | dict[str, Any] | None, parallel: bool | None
) -> ToolPlan | None:
    """The request's ToolPlan, or None when no tool can be called. ValueError (the param first) for a bad choice."""
    if tool_choice is None:
        tool_choice = "auto" if tools else "none"
    if tool_choice == "none" or not tools:
        if isinstance(tool_choice, dict) or tool_choice == "required":
            raise ValueError("tool_choice\ttool_choice asks for a tool call, but no tools are given")
        return None
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise ValueError("tools\ttwo tools have the same function name")
    if isinstance(tool_choice, dict):
        name = (tool_choice.get("function") or {}).get("name") if tool_choice.get("type") == "function" else None
        if not isinstance(name, str):
            raise ValueError(
                'tool_choice\ttool_choice must be "none", "auto", "required" or {"type": "function", '
                '"function": {"name": ...}}'
            )
        if name not in names:
            raise ValueError(f"tool_choice\ttool_choice names the function '{name}', which is not among the tools")
        return ToolPlan(tuple(tools), "named", name, False)
    if tool_choice not in ("auto", "required"):
        raise ValueError(
            f'tool_choice\ttool_choice must be "none", "auto", "required" or a named function, got {tool_choice!r}'
        )
    return ToolPlan(tuple(tools), tool_choice, None, parallel is not False)


def template_supports_tools(chat_template: str | None) -> bool:
    return bool(chat_template) and "tools" in chat_template


def render_messages(
    messages: list[dict[str, Any]], plan: ToolPlan | None, native: bool
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The messages and template variables to render: as given to a template that handles tools (``native``),
    else in the Hermes format (the module docstring)."""
    specs = [t.function.model_dump(exclude_none=True) for t in plan.tools] if plan else []
    if native:
        return messages, ({"tools": [t.model_dump(exclude_none=True) for t in plan.tools]} if plan else {})
    out = []
    for m in messages:
        if m["role"] == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"})
        elif m["role"] == "assistant" and m.get("tool_calls"):
            calls = "\n".join(
                f"{CALL_OPEN}\n{json.dumps({'name': c['function']['name'], 'arguments': c['function']['arguments']})}"
                f"\n{CALL_CLOSE}"
                for c in m["tool_calls"]
            )
            out.append({"role": "assistant", "content": f"{m['content']}\n{calls}".strip()})
        else:
            out.append({k: v for k, v in m.items() if k != "tool_calls"})
    if specs:
        system = _SYSTEM.format(tools="\n".join(json.dumps(s) for s in specs))
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{system}"}
        else:
            out.insert(0, {"role": "system", "content": system})
    return out, {}


def lark_grammar(plan: ToolPlan) -> str | None:
    """A Lark grammar (llguidance's dialect) forcing the output to be tool calls, for ``required`` and a named
    choice; None for ``auto``."""
    if plan.choice == "auto":
        return None
    tools = [t for t in plan.tools if plan.named is None or t.function.name == plan.named]
    options = [
        {
            "type": "object",
            "properties": {
                "name": {"const": t.function.name},
                "arguments": t.function.parameters or {"type": "object"},
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    schema = {**(options[0] if len(options) == 1 else {"anyOf": options}), "x-guidance": JSON_LAYOUT}
    call = f'call: "{CALL_OPEN}\\n" %json {json.dumps(schema)} "\\n{CALL_CLOSE}"'
    return f"start: call{'+' if plan.parallel else ''}\n{call}\n"


def parse(text: str, plan: ToolPlan) -> tuple[str | None, list[ToolCall]]:
    """Split the output into its text and its tool calls (calls naming no given tool, or whose arguments are
    not a JSON object, stay text)."""
    names = {t.function.name for t in plan.tools}
    calls: list[ToolCall] = []
    kept: list[str] = []
    last = 0
    for match in _CALL.finditer(text):
        try:
            body = json.loads(match.group(1))
        except json.JSONDecodeError:
            continue
        if (
            not isinstance(body, dict)
            or body.get("name") not in names
            or not isinstance(body.get("arguments", {}), dict)
        ):
            continue
        if calls and not plan.parallel:
            break
        kept.append(text[last : match.start()])
        last = match.end()
        calls.append(
            ToolCall(
                id=f"call_{uuid.uuid4().hex[:24]}",
                function=FunctionCall(name=body["name"], arguments=json.dumps(body.get("arguments", {}))),
            )
        )
    kept.append(text[last:])
    content = "".join(kept).strip()
    return (content or None) if calls else text, calls


def may_open_call(text: str) -> bool:
    """Whether ``text`` (the output so far) could still turn into a tool call: it holds, or ends with the start
    of, ``<tool_call>`` (a stream holds such text back until it knows)."""
    if CALL_OPEN in text:
        return True
    tail = text[-len(CALL_OPEN) :]
    return any(CALL_OPEN.startswith(tail[i:]) for i in range(len(tail)) if tail[i:])
