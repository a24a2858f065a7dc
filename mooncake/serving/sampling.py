"""A request's sampling on the wire: the engine's SamplingParams -> ``worker.proto``'s Sampling -> SamplingParams again.

One type on both sides: the gateway makes a request's SamplingParams (checked there, once,
``GenerationRequest.sampling``) and writes it (``sampling_to_pb``); the decode worker and the prefill worker
read it with ``params_from_pb``, so both halves of a disaggregated request sample with the
same penalties, biases and ``min_tokens`` (the prefill samples the first token, the decode
worker the rest).
"""

from __future__ import annotations

from mooncake.engine.request import SamplingParams, TokenLogprob
from protos import worker_pb2 as wpb


def sampling_to_pb(req: SamplingParams) -> wpb.Sampling:
    # a seed of 2**63 or more travels as the int64 of the same 64 bits (torch.Generator.manual_seed takes either alike)
    seed = req.seed - 2**64 if req.seed is not None and req.seed >= 2**63 else req.seed
    return wpb.Sampling(
        max_tokens=req.max_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=req.top_k,
        min_p=req.min_p,
        seed=seed,
        stop=list(req.stop),
        stop_token_ids=list(req.stop_token_ids),
        ignore_eos=req.ignore_eos,
        include_stop_str_in_output=req.include_stop_str_in_output,
        presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty,
        repetition_penalty=req.repetition_penalty,
        logit_bias=dict(req.logit_bias),
        min_tokens=req.min_tokens,
        logprobs=req.logprobs,
        grammar=req.grammar or "",
        prompt_logprobs=req.prompt_logprobs,
        keep_special_tokens=not req.skip_special_tokens,
    )


def params_from_pb(s: wpb.Sampling, **overrides) -> SamplingParams:
    """The engine's SamplingParams (``overrides`` replace fields: the prefill's max_tokens). ValueError if refused."""
    fields = dict(
        max_tokens=s.max_tokens,
        temperature=s.temperature,
        top_p=s.top_p or 1.0,
        top_k=s.top_k,
        min_p=s.min_p,
        seed=s.seed if s.HasField("seed") else None,
        stop=tuple(s.stop),
        stop_token_ids=tuple(s.stop_token_ids),
        ignore_eos=s.ignore_eos,
        include_stop_str_in_output=s.include_stop_str_in_output,
        presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty,
        repetition_penalty=s.repetition_penalty or 1.0,
        logit_bias=tuple(sorted(s.logit_bias.items())),
        min_tokens=s.min_tokens,
        logprobs=s.logprobs if s.HasField("logprobs") else None,
        grammar=s.grammar or None,
        prompt_logprobs=s.prompt_logprobs if s.HasField("prompt_logprobs") else None,
        skip_special_tokens=not s.keep_special_tokens,
    )
    fields.update(overrides)
    return SamplingParams(**fields)


def logprob_to_pb(lp: TokenLogprob) -> wpb.TokenLogprob:
    return wpb.TokenLogprob(
        token_id=lp.token_id, logprob=lp.logprob, top_ids=[t for t, _ in lp.top], top_logprobs=[v for _, v in lp.top]
    )


def logprob_from_pb(m: wpb.TokenLogprob) -> TokenLogprob:
    return TokenLogprob(m.token_id, m.logprob, tuple(zip(m.top_ids, m.top_logprobs)))
