"""OpenAIServing: the gateway's logic, written against GenerationBackend and nothing else.

For every request, called once from its route (app.py):

    prepared = await serving.prepare_chat(body)      # or prepare_completion: check, tokenize,
                                                     # size max_tokens -> a GenerationRequest per
                                                     # choice (n, best_of, a batch of prompts)
    body, quote = await serving.complete(prepared)   # not streaming: the whole response, or
    stream   = await serving.open_stream(prepared)   # streaming: waits for the first chunk, so
                                                     # a rejection is still an HTTP status
    async for event in stream: ...                   # SSE lines, "data: [DONE]" last
    await stream.aclose()                            # always; closes the backend's stream

Every mistake of the caller is an ApiError (status, OpenAI error type, param), never a
500. This module owns preparing (checking, rendering, tokenizing, sampling); what happens
from the first chunk on (reasoning and tool-call output, best_of, echo, SSE events, a
BackendError before or after the first event) is responses.py's.

Choices run as separate backend generations that share the prompt's KV (runs.Fanout).
Log-probabilities, response_format and forced tool calls are the engine's (a grammar,
mooncake.engine.grammar); tools are rendered here (tools.py) and their calls parsed in responses.py.

Closing the backend's iterator early (``aclose``, or cancelling the task awaiting it)
cancels the request everywhere: that is how a client that goes away stops its request.

``max_tokens`` left out: the rest of the context, capped at ``default_max_tokens``
(4096 by default), for chat and completions alike (OpenAI's legacy completions default is
16, which surprises more users than it helps).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any

from mooncake.engine.grammar import JSON_OBJECT_SCHEMA, grammar_for
from mooncake.engine.request import SamplingParams
from mooncake.engine.tokenizer import Tokenizer
from mooncake.gateway import reasoning, responses, tenants, tool_parsers, tools
from mooncake.gateway.errors import ApiError
from mooncake.gateway.formats import ChatFormat, CompletionFormat, TokenTexts
from mooncake.gateway.generation_defaults import GenerationDefaults
from mooncake.gateway.messages import template_message
from mooncake.gateway.metrics import GatewayMetrics
from mooncake.gateway.protocol import (
    SEED_MAX,
    UNSUPPORTED,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ResponseFormat,
    TokenizeRequest,
    TokenizeResponse,
)
from mooncake.gateway.reasoning import ReasoningParser
from mooncake.gateway.responses import EventStream, PreparedRequest
from mooncake.gateway.runs import Fanout
from mooncake.gateway.tool_parsers import ToolCallParser
from mooncake.serving.types import GenerationBackend, GenerationRequest, Quote

MAX_PROMPTS = 64  # generations per request: prompts x (best_of or n)
INLINE_CHARS = 16_384  # shorter texts tokenize on the event loop (see _off_loop_if_long)
TOP_K_MAX = 2**31 - 1  # a top_k over the vocabulary cuts nothing; larger ones are clamped to fit the wire


# -- the serving class ----------------------------------------------------------------------


class OpenAIServing:
    """Chat and text completions over ``backend``. One per app; called concurrently from one event loop."""

    def __init__(
        self,
        backend: GenerationBackend,
        tokenizer: Tokenizer,
        model_name: str,
        metrics: GatewayMetrics,
        default_max_tokens: int = 4096,
        reasoning_parser: ReasoningParser = ReasoningParser.AUTO,
        tool_call_parser: ToolCallParser = ToolCallParser.AUTO,
        defaults: GenerationDefaults | None = None,
    ) -> None:
        """``reasoning_parser`` and ``tool_call_parser``: the model's family, or AUTO (from its tokenizer and chat
        template); ``defaults``: its generation_config.json's, for what requests leave unset."""
        self.backend = backend
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.metrics = metrics
        self.defaults = defaults or GenerationDefaults()
        self.default_max_tokens = min(default_max_tokens, self.defaults.max_tokens or default_max_tokens)
        self.token_texts = TokenTexts(tokenizer)
        self.reasoning_parser = reasoning.resolve(ReasoningParser(reasoning_parser), tokenizer)
        tool_call_parser = ToolCallParser(tool_call_parser)
        self.tool_call_parser = (
            tool_parsers.detect(tokenizer.chat_template)
            if tool_call_parser == ToolCallParser.AUTO
            else tool_call_parser
        )

    # -- preparing --------------------------------------------------------------------------

    async def prepare_chat(self, req: ChatCompletionRequest) -> PreparedRequest:
        """Check ``req``, render its conversation (with its tools) and tokenize it (a long one on a thread). Raises
        ApiError."""
        arrival = time.monotonic()
        self._check_common(req)
        if req.echo:
            raise ApiError(
                400, "'echo' is not supported for chat completions", param="echo", code="unsupported_parameter"
            )
        self._refuse_if_shedding()
        try:
            tool_plan = tools.plan(req.tools, req.tool_choice, req.parallel_tool_calls)
        except ValueError as e:
            param, message = str(e).split("\t", 1)
            raise ApiError(400, message, param=param) from None
        native = tools.template_supports_tools(self.tokenizer.chat_template)
        messages, variables = tools.render_messages(
            [template_message(m, i) for i, m in enumerate(req.messages)], tool_plan, native
        )
        kwargs = dict(req.chat_template_kwargs or {})
        reserved = sorted(set(kwargs) & {"messages", "add_generation_prompt"})
        if reserved:
            raise ApiError(400, f"chat_template_kwargs cannot set {', '.join(reserved)}", param="chat_template_kwargs")
        if req.documents is not None:
            kwargs["documents"] = req.documents
        variables = {**kwargs, **variables}  # the request's tools win over a 'tools' keyword
        try:
            chars = sum(len(str(m.get("content") or "")) for m in messages)
            text, prompt = await _off_loop_if_long(
                chars, self._render_chat, messages, req.add_generation_prompt, bool(req.add_special_tokens), variables
            )
        except ValueError as e:
            raise ApiError(400, f"The chat template cannot render these messages: {e}", param="messages") from None
        prompt = _truncated(prompt, req.truncate_prompt_tokens)
        if req.max_completion_tokens is not None:
            max_tokens, max_param = req.max_completion_tokens, "max_completion_tokens"
        else:
            max_tokens, max_param = req.max_tokens, "max_tokens"
        max_tokens = self._max_tokens(len(prompt), max_tokens, "messages", max_param)
        grammar = self._chat_grammar(req, tool_plan)
        if req.top_logprobs and not req.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        parser = tool_parsers.effective(self.tool_call_parser, tool_plan) if tool_plan is not None else None
        # [TOOL_CALLS] is a special token: a request that may call tools keeps special tokens in its text (as vLLM)
        keep_special = parser == ToolCallParser.MISTRAL
        prepared = self._prepared(
            req,
            [prompt],
            max_tokens,
            ChatFormat,
            arrival,
            logprobs=logprobs,
            grammar=grammar,
            keep_special=keep_special,
        )
        prepared.tools = tool_plan
        prepared.tool_parser = parser or ToolCallParser.HERMES
        if self.reasoning_parser != ReasoningParser.NONE:
            prepared.reasoning = reasoning.opens_reasoning(self.reasoning_parser, text)
            prepared.include_reasoning = req.include_reasoning
        return prepared

    def _render_chat(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool, add_special_tokens: bool, variables: dict
    ) -> tuple[str, list[int]]:
        """The conversation's prompt text and its token ids (BOS/EOS added only when asked: the template has
        them). ValueError when the template refuses it."""
        try:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt, **variables)
        except (TypeError, AttributeError, KeyError, IndexError, ArithmeticError) as e:
            # a template fed odd chat_template_kwargs or documents (ints where it iterates): the caller's mistake
            raise ValueError(f"{type(e).__name__}: {e}") from None
        return text, self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def _guided_grammar(self, req: ChatCompletionRequest | CompletionRequest) -> tuple[str, str] | None:
        """vLLM's guided_json / guided_regex / guided_choice / guided_grammar (or structured_outputs' json, regex,
        choice, grammar) as (the param, a grammar); None when none is set. ApiError when two are set or one does not
        compile."""
        asked = [
            (name, value)
            for name, value in (
                ("guided_json", req.guided_json),
                ("guided_regex", req.guided_regex),
                ("guided_choice", req.guided_choice),
                ("guided_grammar", req.guided_grammar),
            )
            if value is not None
        ]
        for key, value in (req.structured_outputs or {}).items():
            if value is not None and key in ("json", "regex", "choice", "grammar"):
                asked.append((f"structured_outputs.{key}", value))
            elif value is not None and key not in ("disable_fallback", "disable_any_whitespace", "whitespace_pattern"):
                raise ApiError(
                    400,
                    f"structured_outputs.{key} is not supported",
                    param=f"structured_outputs.{key}",
                    code="unsupported_parameter",
                )
        if not asked:
            return None
        if len(asked) > 1:
            raise ApiError(400, "Give at most one guided_* constraint", param=asked[1][0])
        param, value = asked[0]
        kind = param.rsplit(".", 1)[-1].removeprefix("guided_")
        try:
            if kind == "json":
                schema = json.loads(value) if isinstance(value, str) else value
                return param, grammar_for(json_schema=schema)
            if kind == "regex":
                return param, grammar_for(regex=value)
            if kind == "choice":
                if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
                    raise ValueError("the choices must be a non-empty list of strings")
                return param, grammar_for(regex="|".join(_regex_literal(c) for c in value))
            return param, grammar_for(lark=value)
        except (ValueError, TypeError) as e:
            raise ApiError(400, f"The {param} constraint cannot be compiled into a grammar: {e}", param=param) from None

    def _chat_grammar(self, req: ChatCompletionRequest, tool_plan: tools.ToolPlan | None) -> str | None:
        """The grammar the output must follow (response_format, a guided_* constraint, or a forced tool call);
        ApiError when it does not compile."""
        fmt = req.response_format
        lark = tools.lark_grammar(tool_plan) if tool_plan is not None else None
        if lark is not None and fmt is not None and fmt.type != "text":
            raise ApiError(
                400, "response_format cannot be combined with a tool_choice that forces a call", param="response_format"
            )
        guided = self._guided_grammar(req)
        if guided is not None and (lark is not None or (fmt is not None and fmt.type != "text")):
            raise ApiError(
                400, f"{guided[0]} cannot be combined with response_format or a forced tool call", param=guided[0]
            )
        if guided is not None:
            return guided[1]
        return self._format_grammar(fmt, lark)

    def _format_grammar(self, fmt: ResponseFormat | None, lark: str | None = None) -> str | None:
        """The grammar of a response_format (or of a forced tool call's ``lark``); ApiError when it does not
        compile."""
        try:
            if lark is not None:
                return grammar_for(lark=lark)
            if fmt is None or fmt.type == "text":
                return None
            if fmt.type == "json_object":
                return grammar_for(json_schema=JSON_OBJECT_SCHEMA)
            if fmt.json_schema is None:
                raise ApiError(
                    400, "response_format of type json_schema needs 'json_schema'", param="response_format.json_schema"
                )
            return grammar_for(json_schema=fmt.json_schema.schema_ if fmt.json_schema.schema_ is not None else {})
        except ValueError as e:
            param = "tools" if lark is not None else "response_format"
            raise ApiError(
                400,
                f"The {'tools' if lark is not None else 'schema'} cannot be compiled into a grammar: {e}",
                param=param,
            ) from None

    async def prepare_completion(self, req: CompletionRequest) -> PreparedRequest:
        """Check ``req`` and tokenize its prompts (long text on a thread; token ids as given). Raises ApiError."""
        arrival = time.monotonic()
        self._check_common(req)
        guided = self._guided_grammar(req)
        if guided is not None and req.response_format is not None and req.response_format.type != "text":
            raise ApiError(400, f"{guided[0]} cannot be combined with response_format", param=guided[0])
        grammar = guided[1] if guided is not None else self._format_grammar(req.response_format)
        self._refuse_if_shedding()
        if req.suffix:
            raise ApiError(
                400,
                "'suffix' (insertion) is not supported by this server",
                param="suffix",
                code="unsupported_parameter",
            )
        prompts = req.prompt
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not prompts:
            raise ApiError(400, "The prompt is empty: at least one token is required", param="prompt")
        if len(prompts) > MAX_PROMPTS:
            raise ApiError(400, f"At most {MAX_PROMPTS} prompts per request, got {len(prompts)}", param="prompt")
        ids_list = []
        vocab = self.tokenizer.vocab_size
        for prompt in prompts:
            if isinstance(prompt, str):
                special = req.add_special_tokens is not False
                ids = await _off_loop_if_long(len(prompt), self.tokenizer.encode, prompt, special) if prompt else []
            else:
                ids = list(prompt)
                bad = [i for i in ids if not 0 <= i < vocab]
                if bad:
                    raise ApiError(400, f"Token ids {bad[:5]} are outside the vocabulary [0, {vocab})", param="prompt")
            ids_list.append(_truncated(ids, req.truncate_prompt_tokens))
        max_tokens = min(self._max_tokens(len(ids), req.max_tokens, "prompt", "max_tokens") for ids in ids_list)
        # echo with logprobs: the prompt's too (each prompt is then computed whole, never from a cache)
        prompt_logprobs = req.logprobs if req.echo else None
        prepared = self._prepared(
            req,
            ids_list,
            max_tokens,
            CompletionFormat,
            arrival,
            logprobs=req.logprobs,
            grammar=grammar,
            best_of=req.best_of,
            prompt_logprobs=prompt_logprobs,
        )
        if req.echo:
            prepared.echo = [p if isinstance(p, str) else self.tokenizer.decode(p) for p in prompts]
        return prepared

    def _refuse_if_shedding(self) -> None:
        """A 429 before any work (template, tokens, keys) while the backend knows every request is refused now."""
        rejected = self.backend.shedding()
        if rejected is not None:
            self.metrics.rejections.labels(rejected.code or rejected.error_type).inc()
            raise ApiError.from_backend(rejected)

    def _check_common(self, req: ChatCompletionRequest | CompletionRequest) -> None:
        if req.model != self.model_name:
            raise ApiError(
                404,
                f"The model '{req.model}' does not exist; this server serves '{self.model_name}'",
                param="model",
                code="model_not_found",
            )
        for name, (no_ops, reason) in UNSUPPORTED.items():
            value = getattr(req, name, None)
            if not any(value == v and type(value) is type(v) or value is v for v in no_ops):
                raise ApiError(400, f"'{name}': {reason}", param=name, code="unsupported_parameter")

    def _max_tokens(self, num_prompt: int, max_tokens: int | None, prompt_param: str, max_param: str) -> int:
        """The completion's token budget; ApiError when the prompt or prompt + max_tokens overflows the context."""
        limit = self.backend.max_model_len
        if num_prompt == 0:
            raise ApiError(400, "The prompt is empty: at least one token is required", param=prompt_param)
        if num_prompt >= limit:
            raise ApiError(
                400,
                f"This model's maximum context length is {limit} tokens, and the {prompt_param} have "
                f"{num_prompt} tokens, which leaves no room for the completion. Shorten the {prompt_param}.",
                param=prompt_param,
                code="context_length_exceeded",
            )
        if max_tokens is None:
            return min(limit - num_prompt, self.default_max_tokens)
        if num_prompt + max_tokens > limit:
            raise ApiError(
                400,
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{num_prompt + max_tokens} tokens ({num_prompt} in the {prompt_param}, {max_tokens} in the "
                f"completion). Shorten the {prompt_param} or the completion.",
                param=max_param,
                code="context_length_exceeded",
            )
        return max_tokens

    def _prepared(
        self,
        req: ChatCompletionRequest | CompletionRequest,
        prompts: list[list[int]],
        max_tokens: int,
        format_cls: type[ChatFormat] | type[CompletionFormat],
        arrival: float,
        *,
        logprobs: int | None,
        grammar: str | None = None,
        best_of: int | None = None,
        prompt_logprobs: int | None = None,
        keep_special: bool = False,
    ) -> PreparedRequest:
        request_id = f"{format_cls.id_prefix}{uuid.uuid4().hex}"
        bias = tuple(sorted((int(t), float(b)) for t, b in (req.logit_bias or {}).items()))
        vocab = self.tokenizer.vocab_size
        if any(not 0 <= t < vocab for t, _ in bias):
            raise ApiError(400, f"logit_bias names token ids outside the vocabulary [0, {vocab})", param="logit_bias")
        stop_ids = tuple(req.stop_token_ids or ())
        if any(not 0 <= t < vocab for t in stop_ids):
            raise ApiError(
                400, f"stop_token_ids names token ids outside the vocabulary [0, {vocab})", param="stop_token_ids"
            )
        d = self.defaults  # the model's generation_config.json, for what the request leaves unset
        if (req.min_tokens or 0) > max_tokens:
            raise ApiError(
                400, f"min_tokens ({req.min_tokens}) is more than max_tokens ({max_tokens})", param="min_tokens"
            )
        n = req.n or 1
        per_prompt = best_of or n
        if per_prompt < n:
            raise ApiError(400, f"best_of ({best_of}) must be at least n ({n})", param="best_of")
        stream = bool(req.stream)
        if stream and per_prompt > n:
            raise ApiError(
                400, "best_of > n cannot be streamed: the best choices are known only at the end", param="best_of"
            )
        if per_prompt * len(prompts) > MAX_PROMPTS:
            raise ApiError(
                400,
                f"At most {MAX_PROMPTS} generations per request, got {len(prompts)} prompts x {per_prompt}",
                param="n",
            )
        # best_of ranks its candidates by their summed log-probabilities
        sampled_logprobs = logprobs if per_prompt == n else max(logprobs or 0, 0)
        try:  # one choice's sampling (the seeds differ: _choice_seed); the engine's own checks, as a 400
            sampling = [
                SamplingParams(
                    max_tokens=max_tokens,
                    temperature=_first(req.temperature, d.temperature, 1.0),
                    top_p=_first(req.top_p, d.top_p, 1.0),
                    top_k=min(max(_first(req.top_k, d.top_k, 0), 0), TOP_K_MAX),
                    min_p=_first(req.min_p, d.min_p, 0.0),
                    seed=_choice_seed(req.seed, j),
                    stop=req.stop_sequences(),
                    stop_token_ids=stop_ids,
                    ignore_eos=req.ignore_eos,
                    include_stop_str_in_output=req.include_stop_str_in_output,
                    skip_special_tokens=req.skip_special_tokens and not keep_special,
                    presence_penalty=req.presence_penalty or 0.0,
                    frequency_penalty=req.frequency_penalty or 0.0,
                    repetition_penalty=_first(req.repetition_penalty, d.repetition_penalty, 1.0),
                    logit_bias=bias,
                    min_tokens=req.min_tokens or 0,
                    logprobs=sampled_logprobs,
                    grammar=grammar,
                    prompt_logprobs=prompt_logprobs,
                )
                for j in range(per_prompt)
            ]
        except ValueError as e:
            raise ApiError(400, str(e)) from None
        salt = tenants.salt_for(req.cache_salt)
        priority, tenant, weight = tenants.admission_for(req.priority)
        try:
            slo_class, ttft_slo_s, tbt_slo_s = tenants.slo_for(req.slo_class, req.ttft_slo_s, req.tbt_slo_s)
        except tenants.SloNotAllowed as e:
            raise ApiError(
                403, str(e), error_type="permission_error", param="slo_class", code="slo_class_not_allowed"
            ) from None
        generations = [
            GenerationRequest(
                request_id=request_id if len(prompts) * per_prompt == 1 else f"{request_id}-{p}-{j}",
                prompt_token_ids=prompt,
                sampling=sampling[j],
                cache_salt=salt,
                slo_class=slo_class,
                priority=priority,
                tenant=tenant,
                tenant_weight=weight,
                ttft_slo_s=ttft_slo_s,
                tbt_slo_s=tbt_slo_s,
            )
            for p, prompt in enumerate(prompts)
            for j in range(per_prompt)
        ]
        include_usage = stream and req.include_usage
        fmt = format_cls(request_id, int(time.time()), self.model_name, include_usage, self.token_texts, logprobs)
        return PreparedRequest(request_id, generations, per_prompt, n, fmt, stream, include_usage, arrival)

    # -- vLLM's /tokenize and /detokenize ----------------------------------------------------

    async def tokenize(self, req: TokenizeRequest) -> TokenizeResponse:
        """The token ids of a prompt or a conversation (as the completions would see them). Raises ApiError."""
        self._check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise ApiError(
                400, "Send either 'prompt' (text) or 'messages' (a conversation), not both or neither", param="prompt"
            )
        if req.messages is not None:
            messages = [template_message(m, i) for i, m in enumerate(req.messages)]
            try:
                kwargs = {
                    k: v
                    for k, v in (req.chat_template_kwargs or {}).items()
                    if k not in ("messages", "add_generation_prompt")
                }
                ids = await asyncio.to_thread(self.tokenizer.encode_chat, messages, req.add_generation_prompt, **kwargs)
            except ValueError as e:
                raise ApiError(400, f"The chat template cannot render these messages: {e}", param="messages") from None
        else:
            ids = (
                await asyncio.to_thread(self.tokenizer.encode, req.prompt, req.add_special_tokens) if req.prompt else []
            )
        return TokenizeResponse(count=len(ids), max_model_len=self.backend.max_model_len, tokens=ids)

    async def detokenize(self, req: DetokenizeRequest) -> DetokenizeResponse:
        """The text of token ids. Raises ApiError for ids outside the vocabulary."""
        self._check_model(req.model)
        vocab = self.tokenizer.vocab_size
        bad = [i for i in req.tokens if not 0 <= i < vocab]
        if bad:
            raise ApiError(400, f"Token ids {bad[:5]} are outside the vocabulary [0, {vocab})", param="tokens")
        return DetokenizeResponse(prompt=await asyncio.to_thread(self.tokenizer.decode, req.tokens))

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise ApiError(
                404,
                f"The model '{model}' does not exist; this server serves '{self.model_name}'",
                param="model",
                code="model_not_found",
            )

    # -- generating -------------------------------------------------------------------------

    def _fanout(self, prepared: PreparedRequest) -> Fanout:
        return Fanout(self.backend, self.metrics, prepared.generations, prepared.per_prompt, prepared.arrival)

    async def complete(self, prepared: PreparedRequest) -> tuple[dict[str, Any], Quote | None]:
        """Generate every choice whole; the response body (responses.complete) and the Conductor's quote for the first
        choice (a cluster backend's; None elsewhere). Raises ApiError (the backend's errors included).

        Cancelling the awaiting task cancels the request in the backend.
        """
        fanout = self._fanout(prepared)
        return await responses.complete(prepared, fanout), fanout.quote

    async def open_stream(self, prepared: PreparedRequest) -> EventStream:
        """Start generating and wait for the first chunk; the SSE events from there on (responses.open_stream).

        Raises ApiError if the backend refuses the request before its first chunk (so a
        rejection is still a 429, not an event). The caller must ``aclose()`` the stream.
        """
        return await responses.open_stream(prepared, self._fanout(prepared))


async def _off_loop_if_long(chars: int, fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` on a thread for a text of ``INLINE_CHARS`` or more, else here on the event loop.

    A short text tokenizes in well under a millisecond; handing it to a thread costs more
    than that under load (the event loop waits for the GIL back while other requests'
    threads run; a profile of a burst, benchmarks/overload_bench.py, showed the loop
    there). A long one would stall every other request on the loop, so it goes to a thread.
    """
    if chars < INLINE_CHARS:
        return fn(*args, **kwargs)
    return await asyncio.to_thread(fn, *args, **kwargs)


def _first(*values):
    """The first value that is not None (a request's field, then the model's default, then the neutral one)."""
    return next(v for v in values if v is not None)


def _truncated(ids: list[int], keep: int | None) -> list[int]:
    """vLLM's truncate_prompt_tokens: the prompt's last ``keep`` tokens (all of them when None)."""
    return ids[-keep:] if keep is not None and len(ids) > keep else ids


def _regex_literal(text: str) -> str:
    """``text`` as a regex matching exactly it (llguidance's regex dialect has no \\Q...\\E)."""
    return "".join("\\" + c if c in r".^$*+?()[]{}|\/-" else c for c in text)


def _choice_seed(seed: int | None, choice: int) -> int | None:
    """Choice ``choice``'s seed: the request's plus its index (kept in range), so each choice has its own stream."""
    if seed is None:
        return None
    return seed + choice if seed + choice <= SEED_MAX else seed - choice
