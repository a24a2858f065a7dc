"""A chat message as the chat template takes it: text content (text parts joined by newlines, as vLLM does), the
tool calls' arguments as JSON objects; ApiError (400) for what the templates cannot take."""

from __future__ import annotations

import json
from typing import Any

from mooncake.gateway.errors import ApiError
from mooncake.gateway.protocol import ChatMessage


def template_message(message: ChatMessage, index: int) -> dict[str, Any]:
    """The chat template's view of a message: text content (text parts joined by newlines, as vLLM does)."""
    content = message.content
    if content is None:
        text = ""
    elif isinstance(content, str):
        text = content
    else:
        texts = []
        for j, part in enumerate(content):
            if part.type != "text" or part.text is None:
                raise ApiError(
                    400,
                    f"Content parts of type '{part.type}' are not supported; only 'text' parts are",
                    param=f"messages[{index}].content[{j}]",
                )
            texts.append(part.text)
        text = "\n".join(texts)
    rendered: dict[str, Any] = {"role": message.role, "content": text}
    if message.name is not None:
        rendered["name"] = message.name
    thought = (message.model_extra or {}).get("reasoning_content")
    if message.role == "assistant" and isinstance(thought, str):  # an earlier turn's, for templates that show it
        rendered["reasoning_content"] = thought
    if message.tool_call_id is not None:
        rendered["tool_call_id"] = message.tool_call_id
    if message.tool_calls:
        rendered["tool_calls"] = [
            {
                "id": c.id,
                "type": "function",
                "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments, index, k)},
            }
            for k, c in enumerate(message.tool_calls)
        ]
    return rendered


def _arguments(arguments: str, index: int, call: int) -> Any:
    """A call's arguments as the templates take them (a JSON object); ApiError when they are not JSON."""
    try:
        return json.loads(arguments)
    except json.JSONDecodeError:
        raise ApiError(
            400,
            "A tool call's arguments are not JSON",
            param=f"messages[{index}].tool_calls[{call}].function.arguments",
        ) from None
