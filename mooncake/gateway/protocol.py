"""The OpenAI wire format: request and response schemas of the gateway (pydantic).

A chat or completion request may carry every field of OpenAI's API and of vLLM's
extensions, and nothing else: a field neither knows is a 400 naming it (app.py), never
silence. Of the known fields, each is one of:

- honoured (most of them, vLLM's ``top_k``, ``min_p``, ``repetition_penalty``,
  ``min_tokens``, ``stop_token_ids``, ``chat_template_kwargs``, ``guided_*`` ... included);
- ``IGNORED``: accepted because it cannot change what this server generates
  (``store``, ``metadata``, ``service_tier``, ``prediction`` ...);
- ``UNSUPPORTED``: declared so that serving.py refuses it (400, ``unsupported_parameter``)
  when set to anything but its no-op value, instead of silently generating something else.

Our own extensions: ``ignore_eos``, ``cache_salt``, ``priority`` (as vLLM names them), and the request's SLO:
``slo_class`` (one of the Conductor's ``--slo-class``), ``ttft_slo_s`` and ``tbt_slo_s`` (its own targets, no
looser than its class's).
Messages, tools and the other nested objects still accept fields they do not know.

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


class ErrorOffer(BaseModel):
    """What a refused request (429) could have instead, as the Conductor predicts it now: a start ``start_in_s`` from
    now (the Retry-After, exact), or the SLO class ``slo_class`` at once (absent: none would)."""

    start_in_s: float
    slo_class: str | None = None


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None
    offer: ErrorOffer | None = None  # a 429 from a cluster's Conductor: what it could serve instead


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


# Known fields that cannot change what this server generates: accepted and ignored.
IGNORED: frozenset[str] = frozenset(
    {
        # OpenAI's
        "store",
        "metadata",
        "service_tier",
        "prediction",  # a latency hint: the output is the same without it
        "modalities",  # text is what this server answers with
        "audio",
        "web_search_options",
        "reasoning_effort",
        "verbosity",
        "prompt_cache_key",  # a routing hint; our prefix cache needs none
        "prompt_cache_retention",
        "prompt_cache_options",
        "safety_identifier",
        "moderation",
        # vLLM's
        "guided_decoding_backend",
        "guided_whitespace_pattern",
        "mm_processor_kwargs",
        "kv_transfer_params",  # vLLM's own disaggregation; ours is the cluster's
        "vllm_xargs",
        "request_id",
        "spaces_between_special_tokens",  # has no effect on fast tokenizers (ours), nor in vLLM
    }
)

# Known fields this server cannot honour: (their no-op values, what to say). serving.py refuses any other value.
UNSUPPORTED: dict[str, tuple[tuple[Any, ...], str]] = {
    "functions": ((None, []), "the deprecated 'functions' are not supported; send 'tools'"),
    "function_call": ((None, "none"), "the deprecated 'function_call' is not supported; send 'tool_choice'"),
    "use_beam_search": ((None, False), "beam search is not supported by this server"),
    "length_penalty": ((None, 1, 1.0), "length_penalty applies to beam search, which this server does not support"),
    "allowed_token_ids": ((None,), "allowed_token_ids is not supported; use logit_bias or a grammar (guided_*)"),
    "bad_words": ((None, []), "bad_words is not supported by this server"),
    "logits_processors": ((None, []), "custom logits processors are not supported by this server"),
    "prompt_logprobs": ((None,), "prompt_logprobs is not supported; completions with echo and logprobs show them"),
    "return_tokens_as_token_ids": ((None, False), "return_tokens_as_token_ids is not supported by this server"),
    "return_token_ids": ((None, False), "return_token_ids is not supported by this server"),
    "chat_template": ((None,), "a request's own chat template is not accepted; the model's is used"),
    "continue_final_message": ((None, False), "continue_final_message is not supported by this server"),
    "prompt_embeds": ((None,), "prompt_embeds are not supported by this server"),
    "structural_tag": ((None,), "structural_tag is not supported; use response_format or guided_json"),
}


class _SamplingFields(_Request):
    """What chat and completion requests share. Unknown fields are refused (the module docstring)."""

    model_config = ConfigDict(extra="forbid")

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
    slo_class: str | None = Field(
        None,
        min_length=1,
        max_length=64,
        description="Extension: the SLO class it is admitted by (the Conductor's --slo-class NAME=TTFT,TBT; unknown: "
        "400); default: 'default'",
    )
    ttft_slo_s: float | None = Field(
        None,
        gt=0,
        le=3600,
        description="Extension: its own time-to-first-token target in seconds: admitted only when predicted to meet "
        "it (429 otherwise). A target looser than its class's is its class's: a request may ask for less time, never "
        "more",
    )
    tbt_slo_s: float | None = Field(
        None, gt=0, le=60, description="Extension: its own time-between-tokens target in seconds, as ttft_slo_s"
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
    min_p: float | None = Field(
        None, ge=0, le=1, description="Extension (vLLM's): drop tokens less likely than min_p times the likeliest"
    )
    stop_token_ids: list[int] | None = Field(None, description="Extension (vLLM's): token ids that end the output")
    include_stop_str_in_output: bool = Field(
        False, description="Extension (vLLM's): the stop string (or stop token's text) that ended the output is shown"
    )
    skip_special_tokens: bool = Field(True, description="Extension (vLLM's): special tokens' text is left out")
    truncate_prompt_tokens: int | None = Field(
        None, ge=1, description="Extension (vLLM's): keep only the prompt's last k tokens"
    )
    add_special_tokens: bool | None = Field(
        None,
        description="Extension (vLLM's): add the tokenizer's BOS/EOS to the prompt (completions' default: true; "
        "chat's: false, the template has them)",
    )
    guided_json: dict[str, Any] | str | None = Field(None, description="Extension (vLLM's): output valid JSON for it")
    guided_regex: str | None = Field(None, description="Extension (vLLM's): output matching this regex")
    guided_choice: list[str] | None = Field(None, description="Extension (vLLM's): output exactly one of these")
    guided_grammar: str | None = Field(None, description="Extension (vLLM's): output in this Lark grammar")
    structured_outputs: dict[str, Any] | None = Field(
        None, description="Extension (vLLM's newer name): {json|regex|choice|grammar: ...}"
    )
    # accepted, ignored (IGNORED) or refused unless a no-op (UNSUPPORTED): declared so they are known
    store: Any = None
    metadata: Any = None
    service_tier: Any = None
    prompt_cache_key: Any = None
    prompt_cache_retention: Any = None
    prompt_cache_options: Any = None
    safety_identifier: Any = None
    moderation: Any = None
    guided_decoding_backend: Any = None
    guided_whitespace_pattern: Any = None
    mm_processor_kwargs: Any = None
    kv_transfer_params: Any = None
    vllm_xargs: Any = None
    request_id: Any = None
    spaces_between_special_tokens: Any = None
    use_beam_search: Any = None
    length_penalty: Any = None
    allowed_token_ids: Any = None
    bad_words: Any = None
    logits_processors: Any = None
    prompt_logprobs: Any = None
    return_tokens_as_token_ids: Any = None
    return_token_ids: Any = None
    structural_tag: Any = None

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
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="Extension (vLLM's): extra variables for the chat template (Qwen3's enable_thinking)"
    )
    add_generation_prompt: bool = Field(True, description="Extension (vLLM's): end the prompt with the reply's opening")
    documents: list[dict[str, Any]] | None = Field(None, description="Extension (vLLM's): for RAG chat templates")
    include_reasoning: bool = Field(True, description="Extension (vLLM's): false drops reasoning_content")
    echo: bool | None = None  # vLLM's chat echo: UNSUPPORTED
    # OpenAI's, accepted and ignored or refused (IGNORED, UNSUPPORTED)
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    web_search_options: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None
    functions: Any = None
    function_call: Any = None
    chat_template: Any = None
    continue_final_message: Any = None


class CompletionRequest(_SamplingFields):
    # Text, token ids, or a batch of either: each prompt gets n choices (index = prompt * n + choice).
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(None, ge=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_COMPLETION_LOGPROBS)
    echo: bool | None = None
    best_of: int | None = Field(None, ge=1, le=MAX_CHOICES)
    suffix: str | None = None
    response_format: ResponseFormat | None = Field(None, description="Extension (vLLM's): as chat's")
    prompt_embeds: Any = None  # UNSUPPORTED


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
    reasoning_content: str | None = None  # vLLM's: the model's reasoning, apart from its answer (reasoning.py)

    @model_serializer(mode="wrap")
    def _drop_no_calls(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        out = handler(self)
        for key in ("tool_calls", "reasoning_content"):
            if out.get(key) is None:
                out.pop(key, None)
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
    reasoning_content: str | None = None
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
    chat_template_kwargs: dict[str, Any] | None = None  # as in a chat request


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
