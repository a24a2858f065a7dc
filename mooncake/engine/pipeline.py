"""Chunked pipeline parallelism in one process: X PipelineStages on X threads, chunk k on stage i while chunk k + 1
is on stage i - 1 (Mooncake §5.1).

    chunks:  c0  c1  c2  c3
    stage 0: c0  c1  c2  c3
    stage 1:     c0  c1  c2  c3        -> after c3: the first token (last stage)

``chunk_bounds`` cuts a prompt's uncached part (pure); ``LocalPipeline.prefill`` runs it
and returns the first token and the prompt's KV in the pool layout (each stage's layers
concatenated). With ``torch.set_num_threads(1)`` each stage's thread computes on a core
of its own (torch releases the GIL inside its kernels). The prefill workers' process
group (a stage per process, hidden states through the transfer engine) drives stages
the same way.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass

import torch

from mooncake.engine.request import SamplingParams, TokenLogprob
from mooncake.engine.stage import PipelineStage


def chunk_bounds(start: int, end: int, chunk: int) -> list[tuple[int, int]]:
    """[start, end) cut into consecutive [a, b) of at most ``chunk`` tokens."""
    if chunk < 1:
        raise ValueError(f"chunk must be at least 1 token, got {chunk}")
    return [(a, min(a + chunk, end)) for a in range(start, end, chunk)]


@dataclass(slots=True)
class PipelinePrefill:
    first_token: int
    kv: torch.Tensor | None  # [n, L, 2, block_size, Hkv, D]: the prompt's blocks, every layer (the last block partial)
    logprob: TokenLogprob | None = None  # the first token's, when the sampling asked
    prompt_logprobs: list[TokenLogprob] | None = None  # prompt tokens 1.., when the sampling asked


class LocalPipeline:
    """The stages of one pipeline group, in order (their layer ranges must tile the model). One prefill at a time."""

    def __init__(self, stages: list[PipelineStage]) -> None:
        if not stages or not stages[0].is_first or not stages[-1].is_last:
            raise ValueError("the stages must run from the first layer to the last")
        for a, b in zip(stages, stages[1:]):
            if a.layers.stop != b.layers.start:
                raise ValueError(f"stage layers {a.layers} and {b.layers} are not contiguous")
        self.stages = stages

    def prefill(
        self,
        request_id: str,
        prompt: list[int],
        params: SamplingParams,
        chunk: int,
        prefix_kv: torch.Tensor | None = None,
        num_prefix_tokens: int = 0,
    ) -> PipelinePrefill:
        """Run ``prompt`` through the pipeline in chunks of ``chunk`` tokens; its first token and KV.

        ``prefix_kv`` [n, L, 2, bs, Hkv, D] holds the KV of its first ``num_prefix_tokens`` (a reused prefix), split
        among the stages by layer. Raises what a stage raised.
        """
        if not 0 <= num_prefix_tokens < len(prompt):
            raise ValueError(f"num_prefix_tokens must be in [0, {len(prompt) - 1}], got {num_prefix_tokens}")
        if num_prefix_tokens:
            for stage in self.stages:
                stage.import_prefix(request_id, prefix_kv[:, stage.layers.start : stage.layers.stop], num_prefix_tokens)
        bounds = chunk_bounds(num_prefix_tokens, len(prompt), chunk)
        inboxes: list[queue.Queue] = [queue.Queue() for _ in self.stages]
        last_hidden: list[torch.Tensor] = []
        errors: list[BaseException] = []

        def run(i: int, stage: PipelineStage) -> None:
            try:
                for a, b in bounds:
                    hidden = inboxes[i].get() if i else None
                    if hidden is _STOP:
                        return
                    out = stage.run_chunk(request_id, a, token_ids=prompt[a:b] if i == 0 else None, hidden=hidden)
                    if i + 1 < len(self.stages):
                        inboxes[i + 1].put(out)
                    elif b == len(prompt):
                        last_hidden.append(out[-1])
            except BaseException as e:  # a stage's failure ends the prefill; the next stage stops waiting
                errors.append(e)
                if i + 1 < len(self.stages):
                    inboxes[i + 1].put(_STOP)

        threads = [threading.Thread(target=run, args=(i, s), name=f"cpp-stage-{i}") for i, s in enumerate(self.stages)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        try:
            if errors:
                raise errors[0]
            token, logprob = self.stages[-1].sample_first(last_hidden[0], params, prompt)
            kv = torch.cat([stage.export(request_id) for stage in self.stages], dim=1)  # [n, L, 2, bs, Hkv, D]
            return PipelinePrefill(token, kv, logprob)
        finally:
            for stage in self.stages:
                stage.release(request_id)


_STOP = object()
