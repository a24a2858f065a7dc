"""The OpenAI wire format: request and response schemas of the gateway (pydantic).

Requests accept and ignore fields they do not know (clients send things like
``service_tier``); a field OpenAI defines that this server cannot honour (``suffix``) is
declared here so that serving.py can refuse it when set, instead of silently generating
something else.
Extensions beyond OpenAI: ``top_k``, ``ignore_eos``, ``cache_salt``, and vLLM's
``repetition_penalty`` and ``min_tokens``.

Responses are built here and dumped with ``model_dump()``; their shapes follow OpenAI's
exactly (``finish_reason: null`` and ``logprobs: null`` are present, a stream's deltas
carry only the keys that changed).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, field_validator, model_serializer

MAX_STOP_SEQUENCES = 4
MAX_CHOICES = 16  # n and best_of, per prompt
MAX_TOP_LOGPROBS = 20  # chat's top_logprobs (OpenAI's limit)
MAX_COMPLETION_LOGPROBS = 5  # completions' logprobs (OpenAI's limit)
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # what torch.Generator.manual_seed takes

# -- errors -----------------------------------------------------------------------------


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


# -- requests ---------------------------------------------------------------------------


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow")


class StreamOptions(_Request):
    include_usage: bool = False


class ContentPart(_Request):
    """One part of a message's content; only ``{"type": "text", "text": ...}`` is served."""

    type: str
    text: str | None = None


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None  # an assistant turn's calls
    tool_call_id: str | None = None  # a tool result: the call it answers


class FunctionCallIn(_Request):
    name: str
    arguments: str = "{}"  # JSON


class ToolCallIn(_Request):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCallIn


class FunctionDefinition(_Request):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None


class ToolDefinition(_Request):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class _SamplingFields(_Request):
    """What chat and completion requests share."""

    model: str
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, description="Extension: sample among the k likeliest; 0 or -1: off")
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    stop: str | list[str] | None = None
    n: int | None = Field(1, ge=1, le=MAX_CHOICES)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted, ignored
    ignore_eos: bool = Field(False, description="Extension: keep generating past EOS (for benchmarks)")
    cache_salt: str | None = Field(None, description="Extension: keeps this tenant's prefix cache apart")
    priority: int | None = Field(
        None,
        ge=-100,
        le=100,
        description="Extension: under load higher goes first and below 0 is refused first (sheddable); default: the "
        "tenant's, which is also the most it may ask for",
    )
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = Field(
        None, description="token id (as a string) -> added to its logit, -100 to 100"
    )
    repetition_penalty: float | None = Field(
        None,
        gt=0,
        description="Extension (vLLM's): prompt and output tokens' logits "
        "divided by it (multiplied, if negative); 1: off",
    )
    min_tokens: int | None = Field(
        None, ge=0, description="Extension (vLLM's): no EOS or stop token before this many tokens"
    )

    @field_validator("logit_bias")
    @classmethod
    def _check_logit_bias(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        for token, value in (bias or {}).items():
            if not token.lstrip("-").isdigit():
                raise ValueError(f"logit_bias keys are token ids, got {token!r}")
            if not -100 <= value <= 100:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {value} for token {token}")
        return bias

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, stop: str | list[str] | None) -> str | list[str] | None:
        sequences = [stop] if isinstance(stop, str) else stop or []
        if len(sequences) > MAX_STOP_SEQUENCES:
            raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences are allowed, got {len(sequences)}")
        if any(not s for s in sequences):
            raise ValueError("stop sequences must be non-empty strings")
        return stop

    def stop_sequences(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class JsonSchemaFormat(_Request):
    name: str = Field(max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Request):
    """``text``; ``json_object`` (any JSON object); ``json_schema`` (JSON valid against ``json_schema.schema``)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1, description="Wins over max_tokens")
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[ToolDefinition] | None = Field(None, max_length=128)
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None


class CompletionRequest(_SamplingFields):
    # Text, token ids, or a batch of either: each prompt gets n choices (index = prompt * n + choice).
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(None, ge=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_COMPLETION_LOGPROBS)
    echo: bool | None = None
    best_of: int | None = Field(None, ge=1, le=MAX_CHOICES)
    suffix: str | None = None


# -- responses --------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprobEntry(BaseModel):
    """One token of chat's ``logprobs.content``."""

    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprobEntry] | None
    refusal: None = None


class CompletionLogprobs(BaseModel):
    """Legacy completions' logprobs: parallel lists, one entry per token."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    refusal: str | None = None
    tool_calls: list[ToolCall] | None = None

    @model_serializer(mode="wrap")
    def _drop_no_calls(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        out = handler(self)
        if out.get("tool_calls") is None:
            out.pop("tool_calls", None)
        return out


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ToolCallDelta(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: dict[str, str]  # "name" in the first delta of a call, "arguments" (a piece of JSON) in each


class Delta(BaseModel):
    """A stream's change to the message: only the keys that are set appear."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: Delta
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None  # present (null until the last chunk) only with stream_options.include_usage


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    """A completion, and also one event of a completion stream (same object name, as in OpenAI)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "mooncake"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# -- vLLM's /tokenize and /detokenize ---------------------------------------------------------


class TokenizeRequest(_Request):
    """Either ``prompt`` (text) or ``messages`` (a conversation, rendered with the chat template)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool = True


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


ChatMessage.model_rebuild()
