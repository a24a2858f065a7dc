"""LocalBackend: one engine in this process serving the gateway, prefill and decode coupled.

The coupled baseline (a single engine, no pool, no Conductor: the paper's vLLM-shaped
baseline) and the simplest way to serve a model. The disaggregated path is
mooncake.gateway.cluster_backend.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator

from mooncake.engine.config import EngineConfig
from mooncake.engine.engine import RequestOutput
from mooncake.engine.interface import EngineKind
from mooncake.engine.request import RequestOptions
from mooncake.engine.tokenizer import Tokenizer
from mooncake.serving.build import build_engine
from mooncake.serving.engine_loop import EngineLoop
from mooncake.serving.text import OutputText
from mooncake.serving.types import GenerationBackend, GenerationChunk, GenerationRequest, InvalidRequest, Unavailable


class LocalBackend(GenerationBackend):
    """Serves ``model_name`` from one engine (ours, or vLLM's with ``engine``) on a thread of this process."""

    def __init__(
        self,
        config: EngineConfig,
        model_name: str,
        tokenizer: Tokenizer | None = None,
        engine: EngineKind = EngineKind.NATIVE,
        vllm_args: dict | None = None,
    ) -> None:
        self.tokenizer = tokenizer or Tokenizer.from_dir(config.model)
        self.engine = build_engine(engine, config, vllm_args=vllm_args, tokenizer=self.tokenizer)
        self.loop = EngineLoop(self.engine, name="local-engine")
        self.model_name = model_name
        self.max_model_len = self.engine.max_model_len

    async def generate(self, request: GenerationRequest) -> AsyncGenerator[GenerationChunk, None]:
        queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        loop = asyncio.get_running_loop()

        def sink(out: RequestOutput | BaseException) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, out)

        try:
            rid = await self.loop.submit(
                sink,
                prompt_token_ids=request.prompt_token_ids,
                sampling_params=request.sampling,
                request_id=request.request_id,
                options=RequestOptions(cache_salt=request.cache_salt),
            )
        except ValueError as e:
            raise InvalidRequest(str(e)) from None
        except asyncio.CancelledError:  # the client left while the request was being added: it may be in already
            self.loop.abort(request.request_id)
            raise
        text = OutputText(self.tokenizer, request.prompt_token_ids, request.sampling)  # the one detokenizer
        finished = sent = False
        try:
            while not finished:
                out = await queue.get()
                if isinstance(out, BaseException):
                    raise Unavailable(f"the engine failed: {out}")
                piece = text.add(out)
                finished = piece.finish is not None  # a stop string found there ends it (the finally aborts it)
                yield GenerationChunk(
                    token_ids=list(out.new_token_ids[: piece.num_tokens]),
                    text=piece.text,
                    finish_reason=piece.finish.value if finished else None,
                    prompt_tokens=out.num_prompt_tokens,
                    completion_tokens=len(out.output_token_ids) - len(out.new_token_ids) + piece.num_tokens,
                    cached_tokens=out.num_cached_tokens,
                    cached_tokens_by_tier={"engine": out.num_cached_tokens} if out.num_cached_tokens else {},
                    logprobs=out.new_logprobs[: piece.num_tokens] if out.new_logprobs is not None else None,
                    prompt_logprobs=out.prompt_logprobs if not sent else None,
                )
                sent = True
        finally:
            if not finished or not out.finished:
                self.loop.abort(rid)

    async def health(self) -> dict:
        return {"status": "ok", "backend": "local", "running": self.loop.num_running}

    async def close(self) -> None:
        self.loop.close()
        self.engine.close()  # a tensor-parallel engine's other ranks end with it
