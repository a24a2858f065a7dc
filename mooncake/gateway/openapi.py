"""The gateway's OpenAPI document (``/openapi.json``): every status a route answers, with its body.

FastAPI documents a route's 200 from its return type and, for every route that takes a
body, a 422 with FastAPI's own validation-error body. This gateway answers differently:
every error is OpenAI's ``{"error": {"message", "type", "param", "code"}}``
(ErrorResponse), a request that fails validation is a 400, a completion with ``stream``
is ``text/event-stream``, and the API key is checked by a middleware FastAPI never sees.

So the routes declare their responses from the tables here (``errors``, ``generation``,
``HEALTH``), and :func:`document` rewrites what a decorator cannot say: it drops the 422s,
adds the stream chunks' schemas, spells out the models serialized by hand, and puts the
Bearer scheme and its 401 on exactly the paths the middleware guards (the same predicate
decides both).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from mooncake.gateway.protocol import AssistantMessage, ChatCompletionChunk, CompletionResponse, Delta, ErrorResponse

BEARER = "bearerAuth"  # the security scheme's name in components.securitySchemes
_REF = "#/components/schemas/{model}"
# Their model_serializer drops the keys left unset, which pydantic documents as "any object"; their fields (the
# dropped ones optional) say what they hold.
_SERIALIZED_BY_HAND = (AssistantMessage, Delta)

_ERRORS = {
    400: "Invalid request: malformed JSON, a missing or invalid parameter, one this server does not support, or a "
    "prompt and max_tokens over the model's context",
    401: "Missing or incorrect API key (`Authorization: Bearer <key>`)",
    404: "The `model` named is not the one this server serves",
    429: "Turned away to keep the latency SLOs; retry after `Retry-After` seconds",
    503: "Nothing can serve the request now (no live worker, or the Conductor is away); retry later",
}
_RETRY_AFTER = {"description": "Seconds to wait before retrying", "schema": {"type": "integer", "minimum": 1}}
_HEADERS: dict[int, dict[str, Any]] = {
    401: {"WWW-Authenticate": {"description": "`Bearer`", "required": True, "schema": {"type": "string"}}},
    429: {"Retry-After": {**_RETRY_AFTER, "required": True}},
    503: {"Retry-After": _RETRY_AFTER},  # when the backend can say
}

HEALTH: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "The backend can serve: what is alive (the cluster's instances per role, its policy)",
        "content": {
            "application/json": {
                "schema": {
                    "type": "object",
                    "required": ["status"],
                    "properties": {"status": {"const": "ok"}},
                }
            }
        },
    },
    503: {"model": ErrorResponse, "description": _ERRORS[503]},
}


def _ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": _REF.format(model=model.__name__)}


def _error(status: int) -> dict[str, Any]:
    headers = _HEADERS.get(status)
    return {"description": _ERRORS[status], **({"headers": headers} if headers else {})}


def errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """``responses=`` entries for these error statuses: OpenAI's error body, and the headers that come with it."""
    return {status: {"model": ErrorResponse, **_error(status)} for status in statuses}


def _event(chunk: type[BaseModel]) -> dict[str, Any]:
    """One server-sent event of a stream: ``data:`` a chunk, an error (a failure mid-stream), or ``[DONE]``."""
    payload = {"anyOf": [_ref(chunk), _ref(ErrorResponse)]}
    data = {
        "type": "string",
        "description": f"A {chunk.__name__} as JSON; an error as JSON if the request fails mid-stream; `[DONE]` last",
        "if": {"const": "[DONE]"},
        "else": {"contentMediaType": "application/json", "contentSchema": payload},
    }
    return {"type": "object", "required": ["data"], "properties": {"data": data}}


def generation(response: type[BaseModel], chunk: type[BaseModel]) -> dict[int | str, dict[str, Any]]:
    """``responses=`` of /v1/chat/completions and /v1/completions: ``response`` as JSON, or (``stream: true``)
    ``chunk`` after ``chunk`` as server-sent events."""
    ok = {
        "model": response,
        "description": f"A {response.__name__}; with `stream: true`, server-sent events of {chunk.__name__} objects",
        "content": {"text/event-stream": {"itemSchema": _event(chunk)}},
    }
    return {200: ok, **errors(400, 404, 429, 503)}


def document(app: FastAPI, guarded: Callable[[str], bool] | None) -> None:
    """Make ``app.openapi()`` (hence ``/openapi.json``) FastAPI's document rewritten as this module says.

    ``guarded``: whether a path needs the API key (None: no key is configured). Call once,
    after the routes are added; the document is built on the first request for it.
    """
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if not app.openapi_schema:
            app.openapi_schema = _rewrite(build(), guarded)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _rewrite(schema: dict[str, Any], guarded: Callable[[str], bool] | None) -> dict[str, Any]:
    components = schema.setdefault("components", {})
    models = components.setdefault("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):  # only FastAPI's 422 used them
        models.pop(name, None)
    _add_models(models)
    if guarded is not None:
        components["securitySchemes"] = {BEARER: {"type": "http", "scheme": "bearer", "description": "The API key"}}
    for path, item in schema.get("paths", {}).items():
        for operation in item.values():
            operation["responses"].pop("422", None)  # validation errors are 400s (see errors())
            if guarded is not None and guarded(path):
                operation["security"] = [{BEARER: []}]
                operation["responses"]["401"] = {
                    **_error(401),
                    "content": {"application/json": {"schema": _ref(ErrorResponse)}},
                }
    return schema


def _add_models(models: dict[str, Any]) -> None:
    """The stream events' models (no route returns them, so FastAPI left them out), and the true shapes of the
    models serialized by hand."""
    _, streamed = models_json_schema(
        [
            (ChatCompletionChunk, "serialization"),
            (CompletionResponse, "serialization"),
            (ErrorResponse, "serialization"),
        ],
        ref_template=_REF,
    )
    for name, model in streamed["$defs"].items():
        models.setdefault(name, model)
    _, shaped = models_json_schema([(model, "validation") for model in _SERIALIZED_BY_HAND], ref_template=_REF)
    by_hand = {model.__name__ for model in _SERIALIZED_BY_HAND}
    for name, model in shaped["$defs"].items():
        if name in by_hand:
            models[name] = model
        else:
            models.setdefault(name, model)
