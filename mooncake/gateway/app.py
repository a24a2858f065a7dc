"""The gateway's FastAPI app: thin routes over OpenAIServing, errors in OpenAI's shape.

    app = create_app(backend, tokenizer, GatewayConfig(served_model_name="tiny", api_key="sk-..."))
    uvicorn.run(app, host="0.0.0.0", port=8000)

Routes: POST /v1/chat/completions, POST /v1/completions, GET /v1/models, POST /tokenize,
POST /detokenize (behind the API key when one is configured), GET /health, GET /metrics
(always open). ``/openapi.json`` documents every status they answer (mooncake.gateway.openapi).

A client that goes away cancels its request. The routes race the backend work against
the ASGI ``http.disconnect`` message (``_unless_disconnected``); a stream's response
(``_EventStreamResponse``) listens for it while streaming, whatever ASGI version the
server speaks, and closes the EventStream, hence the backend's iterator, however the
response ends.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import re
import time
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from typing import TypeVar

import anyio
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from mooncake.engine.tokenizer import Tokenizer
from mooncake.gateway import openapi, tenants
from mooncake.gateway.errors import ApiError
from mooncake.gateway.generation_defaults import GenerationDefaults
from mooncake.gateway.metrics import GatewayMetrics
from mooncake.gateway.protocol import (
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)
from mooncake.gateway.reasoning import ReasoningParser
from mooncake.gateway.responses import EventStream, PreparedRequest
from mooncake.gateway.serving import OpenAIServing
from mooncake.gateway.tenants import Tenants
from mooncake.gateway.tool_parsers import ToolCallParser
from mooncake.serving.types import BackendError, GenerationBackend, Quote

log = logging.getLogger(__name__)

T = TypeVar("T")

CLIENT_CLOSED = 499  # nginx's "client closed request": the status a request gets in the metrics when its client left
_STATUS_KEY = "mooncake_status"  # in scope["state"]: a stream's outcome, which its HTTP status (200) cannot say
_ENDPOINTS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics"})
_GENERATION = frozenset({"/v1/chat/completions", "/v1/completions"})  # what tenants' limits count


class GatewayConfig(BaseModel):
    """How the gateway presents the backend. ``max_model_len`` comes from the backend."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    served_model_name: str = Field(description="The name clients send as `model`")
    api_key: str | None = Field(
        None, description="when set, /v1/* needs `Authorization: Bearer <api_key>` (one key, shared cache)"
    )
    tenants_file: str | None = Field(
        None,
        description="API keys by tenant, in YAML or JSON, instead of api_key: each tenant's requests get a cache of "
        "their own (no KV shared between tenants), its own rate limit and cap on requests in flight (429 with "
        "Retry-After); format: mooncake/gateway/tenants.py",
    )
    default_max_tokens: int = Field(
        4096, ge=1, description="max_tokens when a request leaves it out: the rest of the context, at most this"
    )
    reasoning_parser: ReasoningParser = Field(
        ReasoningParser.AUTO,
        description="how reasoning is split from the answer into reasoning_content: qwen3, deepseek_r1, none, or "
        "auto (from the model's tokenizer: <think> tokens)",
    )
    tool_call_parser: ToolCallParser = Field(
        ToolCallParser.AUTO,
        description="the format tool calls are read in: hermes, llama3_json, mistral, pythonic, or auto (from the "
        "chat template)",
    )
    generation_config: str | None = Field(
        None,
        description="a model directory whose generation_config.json gives the sampling defaults of what requests "
        "leave unset (vLLM's --generation-config auto); None: neutral defaults",
    )


def create_app(backend: GenerationBackend, tokenizer: Tokenizer, config: GatewayConfig) -> FastAPI:
    """The OpenAI-compatible app over ``backend``; it closes the backend when the app shuts down.

    Metrics live in a registry of the app's own (``app.state.metrics``).
    """
    if config.api_key is not None and config.tenants_file is not None:
        raise ValueError("give an API key or a tenants file, not both (a tenants file can hold any number of keys)")
    roster = (
        Tenants.load(config.tenants_file)
        if config.tenants_file is not None
        else (Tenants.single(config.api_key) if config.api_key is not None else None)
    )
    metrics = GatewayMetrics()
    serving = OpenAIServing(
        backend,
        tokenizer,
        config.served_model_name,
        metrics,
        config.default_max_tokens,
        reasoning_parser=config.reasoning_parser,
        tool_call_parser=config.tool_call_parser,
        defaults=GenerationDefaults.from_dir(config.generation_config),
    )

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        await backend.close()

    started = int(time.time())
    app = FastAPI(title="mooncake gateway", lifespan=lifespan, dependencies=[Depends(_text_only_body)])
    app.state.serving = serving
    app.state.metrics = metrics

    @app.post(
        "/v1/chat/completions",
        response_model=None,
        responses=openapi.generation(ChatCompletionResponse, ChatCompletionChunk),
    )
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await _respond(serving, request, await serving.prepare_chat(body))

    @app.post(
        "/v1/completions", response_model=None, responses=openapi.generation(CompletionResponse, CompletionResponse)
    )
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await _respond(serving, request, await serving.prepare_completion(body))

    @app.get("/v1/models")
    async def models() -> ModelList:
        card = ModelCard(id=config.served_model_name, created=started, max_model_len=backend.max_model_len)
        return ModelList(data=[card])

    @app.post("/tokenize", responses=openapi.errors(400, 404))
    async def tokenize(body: TokenizeRequest) -> TokenizeResponse:
        return await serving.tokenize(body)

    @app.post("/detokenize", responses=openapi.errors(400, 404))
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        return await serving.detokenize(body)

    @app.get("/health", response_model=None, responses=openapi.HEALTH)
    async def health() -> JSONResponse:
        return JSONResponse(await backend.health())

    @app.get("/metrics", response_model=None, response_class=PlainTextResponse)
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=metrics.content_type)

    _install_error_handlers(app)
    openapi.document(app, guarded=_is_guarded if roster is not None else None)
    if roster is not None:
        app.add_middleware(_BearerAuth, roster=roster, metrics=metrics)
    app.add_middleware(_CountRequests, metrics=metrics)  # outermost: counts the 401s too
    return app


# -- routes' helpers ----------------------------------------------------------------------


# the Conductor's quote for the request (mooncake.serving.types.Quote), in seconds: on a cluster's responses
PREDICTED_TTFT_HEADER = "x-mooncake-predicted-ttft"
PREDICTED_TBT_HEADER = "x-mooncake-predicted-tbt"


class _ClientGone(Exception):
    """The client disconnected before the response was ready."""


async def _respond(serving: OpenAIServing, request: Request, prepared: PreparedRequest) -> Response:
    headers = {"x-request-id": prepared.request_id}
    if prepared.stream:
        stream = await _unless_disconnected(request, serving.open_stream(prepared))
        return _EventStreamResponse(stream, headers=headers | _quote_headers(stream.quote))
    body, quote = await _unless_disconnected(request, serving.complete(prepared))
    return JSONResponse(body, headers=headers | _quote_headers(quote))


def _quote_headers(quote: Quote | None) -> dict[str, str]:
    """What the Conductor predicted for the request, a promise a client can plan on (benchmarks compare it with what
    they measure)."""
    if quote is None:
        return {}
    return {PREDICTED_TTFT_HEADER: f"{quote.ttft_s:.4f}", PREDICTED_TBT_HEADER: f"{quote.tbt_s:.4f}"}


async def _wait_for_disconnect(receive: Receive) -> None:
    # The body was read already, so the next message is the disconnect (uvicorn holds it until then).
    while (await receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """``await work``, unless the client disconnects first: then cancel it and raise _ClientGone.

    Cancelling a task that awaits the backend's iterator closes it, which cancels the request.
    """
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_wait_for_disconnect(request.receive))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
            await asyncio.wait({task})  # let it close the backend stream before we go on
    if task.cancelled():
        raise _ClientGone
    return task.result()


class _EventStreamResponse(StreamingResponse):
    """``text/event-stream`` over an EventStream, which it always closes when it ends.

    Starlette stops iterating when the client goes away but leaves the iterator to the
    garbage collector, and on ASGI 2.4 servers only notices at the next write; this
    listens for ``http.disconnect`` throughout and closes the stream in ``finally``.
    """

    media_type = "text/event-stream"

    def __init__(self, stream: EventStream, headers: dict[str, str]) -> None:
        super().__init__(stream, headers={**headers, "Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._stream = stream

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as group:

                async def stream_then_stop() -> None:
                    try:
                        await self.stream_response(send)
                    except OSError:  # ASGI 2.4 servers raise on a write to a closed connection
                        pass
                    group.cancel_scope.cancel()

                group.start_soon(stream_then_stop)
                await self.listen_for_disconnect(receive)
                group.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                await self._stream.aclose()
            scope.setdefault("state", {})[_STATUS_KEY] = self._stream.status


# -- errors ---------------------------------------------------------------------------------


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")  # \uD800-\uDFFF: in pairs they spell one character


async def _text_only_body(request: Request) -> None:
    """Refuse (400) a JSON body with a lone UTF-16 surrogate in a string (``"\\ud800"``): valid JSON syntax, but not
    text, and the tokenizer, protobuf and the error response itself would fail on it (a 500).

    Runs on every route, after FastAPI has read the body (so it costs a scan of bytes read anyway; only a body
    with a surrogate escape is decoded again).
    """
    body = await request.body()
    if not _SURROGATE_ESCAPE.search(body):
        return
    try:
        json.dumps(json.loads(body), ensure_ascii=False).encode()
    except UnicodeEncodeError as e:
        raise ApiError(
            400,
            f"The body has a lone UTF-16 surrogate ({e.object[e.start : e.end]!a}), which is not text",
            code="invalid_unicode",
        ) from None
    except ValueError:
        pass  # not JSON: the body's validation says so


def _error_response(error: ApiError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})


def _param_of(loc: tuple[int | str, ...]) -> str | None:
    """``messages[0].content`` from pydantic's ``("body", "messages", 0, "content", "str")``.

    Pydantic puts the tried member of a union into the location ("str", "list[int]",
    "ContentPart"); no field here looks like one, so they are dropped.
    """
    parts = loc[1:] if loc and loc[0] == "body" else loc
    param = ""
    for part in parts:
        if isinstance(part, int):
            param += f"[{part}]"
        elif part in _TYPE_TAGS or part[:1].isupper() or any(c in part for c in "[]-("):
            continue
        else:
            param += f".{part}" if param else part
    return param or None


def _validation_error(exc: RequestValidationError) -> ApiError:
    errors = exc.errors()
    if not errors:
        return ApiError(400, "Invalid request body")
    first = errors[0]
    if first.get("type") == "json_invalid":
        reason = first.get("ctx", {}).get("error", "")
        return ApiError(400, f"The body is not valid JSON: {reason}".rstrip(": "), code="invalid_json")
    unknown = [str(e["loc"][-1]) for e in errors if e.get("type") == "extra_forbidden" and e.get("loc")]
    if unknown:  # neither OpenAI's API nor vLLM's knows it: say so, rather than generate as if it were not sent
        plural = "s" if len(unknown) > 1 else ""
        return ApiError(
            400,
            f"Unrecognized request argument{plural} supplied: {', '.join(unknown)}",
            param=unknown[0],
            code="unknown_parameter",
        )
    param = _param_of(tuple(first.get("loc", ())))
    msg = str(first.get("msg", "invalid value"))
    others = len({_param_of(tuple(e.get("loc", ()))) for e in errors}) - 1  # a union's members repeat one field
    more = f" (and {others} more invalid parameters)" if others > 0 else ""
    if param is None:
        return ApiError(400, f"Invalid request body: {msg}")
    if first.get("type") == "missing":
        return ApiError(400, f"Missing required parameter: '{param}'", param=param, code="missing_required_parameter")
    return ApiError(400, f"Invalid value for '{param}': {msg}{more}", param=param, code="invalid_value")


def _install_error_handlers(app: FastAPI) -> None:
    """Every error, ours or the framework's, as ``{"error": {...}}``; the user's mistakes as 4xx."""

    async def on_api_error(_: Request, exc: ApiError) -> Response:
        return _error_response(exc)

    async def on_backend_error(_: Request, exc: BackendError) -> Response:
        return _error_response(ApiError.from_backend(exc))

    async def on_validation_error(_: Request, exc: RequestValidationError) -> Response:
        return _error_response(_validation_error(exc))

    async def on_http_error(_: Request, exc: StarletteHTTPException) -> Response:
        error_type = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return _error_response(ApiError(exc.status_code, str(exc.detail), error_type=error_type, headers=exc.headers))

    async def on_client_gone(_: Request, __: Exception) -> Response:
        return Response(status_code=CLIENT_CLOSED)  # nobody reads it; the metrics do

    async def on_bug(request: Request, exc: Exception) -> Response:
        log.error("%s %s failed", request.method, request.url.path, exc_info=exc)
        return _error_response(ApiError(500, "Internal server error", error_type="server_error"))

    app.add_exception_handler(ApiError, on_api_error)
    app.add_exception_handler(BackendError, on_backend_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
    app.add_exception_handler(_ClientGone, on_client_gone)
    app.add_exception_handler(Exception, on_bug)


# -- ASGI middleware (plain ASGI: BaseHTTPMiddleware would get between us and http.disconnect) --


GUARDED_PATHS = frozenset({"/tokenize", "/detokenize"})  # besides /v1/*: they use the model's tokenizer


def _is_guarded(path: str) -> bool:
    """Whether ``path`` needs the API key (when one is configured): /v1/* and GUARDED_PATHS."""
    return path == "/v1" or path.startswith("/v1/") or path in GUARDED_PATHS


class _BearerAuth:
    """Answers 401 to /v1/*, /tokenize and /detokenize requests without ``Authorization: Bearer <key>`` of a tenant,
    and 429 to a tenant's generation request over its limits; serves the rest as its tenant (``tenants.current``)."""

    def __init__(self, app: ASGIApp, roster: Tenants, metrics: GatewayMetrics) -> None:
        self.app = app
        self._tenants = roster
        self._metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not _is_guarded(scope["path"]):
            await self.app(scope, receive, send)
            return
        header = dict(scope["headers"]).get(b"authorization")
        tenant = None
        if header is None:
            error = "Missing API key: send it as 'Authorization: Bearer <key>'"
        else:
            scheme, _, token = header.partition(b" ")
            tenant = self._tenants.authenticate(token.strip()) if scheme.lower() == b"bearer" else None
            error = None if tenant is not None else "Incorrect API key provided"
        if tenant is None:
            denial = ApiError(
                401,
                error,
                error_type="authentication_error",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )
            await _error_response(denial)(scope, receive, send)
            return
        limit = self._tenants.limit(tenant) if scope["path"] in _GENERATION else None
        if limit is not None and (refused := limit.take(time.monotonic())) is not None:
            reason, wait_s = refused
            self._metrics.tenant_rejections.labels(tenant.name, reason).inc()
            what = "rate limit" if reason == "tenant_rate_limit" else "cap on requests in flight"
            denial = ApiError(
                429,
                f"Tenant '{tenant.name}' is over its {what}; retry after {wait_s:.1f} s",
                error_type="rate_limit_error",
                code=reason,
                headers={"Retry-After": str(max(1, math.ceil(wait_s)))},
            )
            await _error_response(denial)(scope, receive, send)
            return
        served_as = tenants.current.set(tenant)
        try:
            await self.app(scope, receive, send)
        finally:
            tenants.current.reset(served_as)
            if limit is not None:
                limit.release()


class _CountRequests:
    """Counts every HTTP request in ``mooncake_gateway_requests_total{endpoint,status}``.

    The status is the response's, except for a stream, whose outcome the response leaves
    in ``scope["state"]`` (its HTTP status was 200 before it failed or its client left),
    and for a request whose client left before any response (499).
    """

    def __init__(self, app: ASGIApp, metrics: GatewayMetrics) -> None:
        self.app = app
        self._metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        state = scope.setdefault("state", {})  # shared with the response, which may write the outcome
        status = CLIENT_CLOSED
        arrived = time.perf_counter()

        async def send_and_see(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                if status == 429:
                    self._metrics.shedding.observe(time.perf_counter() - arrived)
            await send(message)

        try:
            await self.app(scope, receive, send_and_see)
        except Exception:
            status = 500
            raise
        finally:
            endpoint = scope["path"] if scope["path"] in _ENDPOINTS else "other"
            self._metrics.requests.labels(endpoint, str(state.get(_STATUS_KEY, status))).inc()
