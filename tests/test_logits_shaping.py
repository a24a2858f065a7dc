"""Penalties, biases and min_tokens (mooncake/engine/sampler.py): each equal to its formula computed directly."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import make_engine

from mooncake.engine import SamplingParams
from mooncake.engine.sampler import History, shape_logits

VOCAB = 12


def logits() -> torch.Tensor:
    return torch.linspace(-3.0, 2.5, VOCAB)  # negative and positive values, all distinct


def reference(x: list[float], p: SamplingParams, h: History) -> list[float]:
    """The formulas, one token at a time (vLLM's order: repetition, frequency and presence, bias, min_tokens)."""
    out = list(x)
    for t in range(VOCAB):
        if t in h.prompt_token_ids or t in h.output_token_ids:
            out[t] = out[t] / p.repetition_penalty if out[t] > 0 else out[t] * p.repetition_penalty
        count = list(h.output_token_ids).count(t)
        out[t] -= p.frequency_penalty * count + p.presence_penalty * (count > 0)
        out[t] += dict(p.logit_bias).get(t, 0.0)
        ends = set(p.stop_token_ids) | (set() if p.ignore_eos else set(h.eos_token_ids))
        if len(h.output_token_ids) < p.min_tokens and t in ends:
            out[t] = -math.inf
    return out


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(repetition_penalty=1.3),
        SamplingParams(repetition_penalty=0.7),
        SamplingParams(frequency_penalty=0.5),
        SamplingParams(presence_penalty=-1.5),
        SamplingParams(
            frequency_penalty=1.0, presence_penalty=0.5, repetition_penalty=1.2, logit_bias={3: 5.0, 11: -100.0}
        ),
        SamplingParams(min_tokens=5, stop_token_ids=(4,)),
        SamplingParams(min_tokens=5, stop_token_ids=(4,), ignore_eos=True),
        SamplingParams(min_tokens=3),  # already 3 outputs: nothing banned
    ],
)
def test_shaped_logits_equal_the_formulas(params):
    history = History(prompt_token_ids=[1, 2, 2, 9], output_token_ids=[2, 5, 5], eos_token_ids=frozenset({7}))
    got = shape_logits(logits(), params, history).tolist()
    assert got == pytest.approx(reference(logits().tolist(), params, history))


def test_bad_values_are_refused():
    for bad in (
        dict(presence_penalty=2.5),
        dict(frequency_penalty=-3),
        dict(repetition_penalty=0),
        dict(logit_bias={1: 101}),
        dict(min_tokens=20, max_tokens=10),
    ):
        with pytest.raises(ValueError):
            SamplingParams(**bad)


def test_a_biased_token_is_always_picked_and_min_tokens_holds_off_eos(tiny_llama):
    engine = make_engine(tiny_llama.path)
    prompt = [5, 17, 42, 8, 99]
    (out,) = engine.generate(
        [prompt], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logit_bias={123: 100.0})
    )
    assert out.output_token_ids == [123] * 6
    eos = next(iter(engine.eos_token_ids))
    (out,) = engine.generate(
        [prompt], SamplingParams(temperature=0.0, max_tokens=20, min_tokens=4, logit_bias={eos: 100.0})
    )
    assert out.output_token_ids[:4] != [eos] * 4 and eos not in out.output_token_ids[:4]
    assert out.output_token_ids[4] == eos and out.finish_reason.value == "stop" and len(out.output_token_ids) == 5


def test_penalties_change_greedy_output_and_a_neutral_one_does_not(tiny_llama):
    engine = make_engine(tiny_llama.path)
    prompt = [5, 17, 42, 8, 99, 5, 17]
    plain = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))[
        0
    ].output_token_ids
    neutral = engine.generate(
        [prompt],
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, presence_penalty=0.0, repetition_penalty=1.0),
    )[0].output_token_ids
    penalised = engine.generate(
        [prompt], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, frequency_penalty=2.0)
    )[0].output_token_ids
    assert neutral == plain
    assert penalised != plain
    # a token generated many times is penalised: the most repeated token is repeated less
    top = max(set(plain), key=plain.count)
    assert penalised.count(top) < plain.count(top)


def test_counts_kept_from_step_to_step_shape_exactly_as_counted_afresh():
    """A PenaltyBook grows a request's counts by its new tokens only; each step's shaped logits equal those from its
    whole history counted again (bit for bit), ids outside the vocabulary ignored, and outputs taken back (a
    shorter history) are counted afresh."""
    from mooncake.engine.sampler import PenaltyBook

    params = SamplingParams(frequency_penalty=0.7, presence_penalty=0.3, repetition_penalty=1.4)
    book = PenaltyBook(VOCAB)
    prompt = [1, 2, 2, 9, VOCAB + 5]
    outputs: list[int] = []
    for token in (2, 5, 5, 11, 0, 5):
        outputs.append(token)
        history = History(prompt, list(outputs))
        kept = shape_logits(logits(), params, history, book.counts("r", history))
        assert torch.equal(kept, shape_logits(logits(), params, history))
        assert kept.tolist() == pytest.approx(reference(logits().tolist(), params, history))
    shorter = History(prompt, outputs[:2])
    assert torch.equal(
        shape_logits(logits(), params, shorter, book.counts("r", shorter)), shape_logits(logits(), params, shorter)
    )
    assert len(book) == 1
    book.drop("r")
    assert len(book) == 0


def test_an_engine_keeps_counts_only_while_a_penalized_request_runs(tiny_llama):
    engine = make_engine(tiny_llama.path)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, frequency_penalty=1.0)
    engine.generate([[5, 17, 42, 8, 99, 5, 17], [3, 4, 5]], params)
    assert len(engine.runner.penalties) == 0
