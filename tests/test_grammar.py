"""Constrained decoding and logprobs in the engine, without a server: what the grammar allows, a matcher taking
over after tokens sampled elsewhere, and logprobs against a direct computation on the logits."""

from __future__ import annotations

import json

import pytest
import torch

from mooncake.engine import EngineConfig, LLMEngine
from mooncake.engine.grammar import GrammarBook, grammar_for
from mooncake.engine.request import SamplingParams
from mooncake.engine.sampler import token_logprobs

CHOICE = {"enum": ["yes", "no"]}


@pytest.fixture(scope="module")
def book(tok) -> GrammarBook:
    return GrammarBook(tok.backend.to_str(), tok.vocab_size, tok.eos_token_ids)


def allowed(book: GrammarBook, request_id: str, vocab: int) -> set[int]:
    logits = torch.zeros(vocab)
    book.mask_(logits, request_id)
    return {i for i in range(vocab) if logits[i] == 0}


def test_the_mask_allows_exactly_the_tokens_that_continue_the_grammar(book, tok):
    book.add("r", grammar_for(json_schema=CHOICE))
    first = allowed(book, "r", tok.vocab_size)
    assert first and all(tok.decode([t]).startswith('"') or '"'.startswith(tok.decode([t])) for t in first)
    book.drop("r")


def test_a_matcher_takes_over_after_tokens_sampled_elsewhere(book, tok):
    ids = tok.encode('"ye', add_special_tokens=False)
    book.add("a", grammar_for(json_schema=CHOICE))
    for t in ids:
        book.accept("a", t)
    book.add("b", grammar_for(json_schema=CHOICE), ids)  # the decode worker's view: replayed
    assert allowed(book, "a", tok.vocab_size) == allowed(book, "b", tok.vocab_size)
    assert all("s" in tok.decode([t]) or tok.decode([t]) == "" for t in allowed(book, "b", tok.vocab_size))
    with pytest.raises(ValueError, match="do not follow the grammar"):
        book.add("c", grammar_for(json_schema=CHOICE), tok.encode("{", add_special_tokens=False))


def test_a_schema_llguidance_cannot_compile_is_a_value_error_saying_why():
    with pytest.raises(ValueError, match="nowhere"):
        grammar_for(json_schema={"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}})
    with pytest.raises(ValueError):
        grammar_for(lark="start: (")


def test_the_engine_samples_only_what_the_schema_allows_at_temperature_1(tiny_dir, tok):
    engine = LLMEngine(
        EngineConfig(model=str(tiny_dir), block_size=16, num_kv_blocks=128, max_model_len=512), tokenizer=tok
    )
    schema = {
        "type": "object",
        "properties": {"k": {"enum": [1, 2, 3]}, "v": {"type": "boolean"}},
        "required": ["k", "v"],
        "additionalProperties": False,
    }
    grammar = grammar_for(json_schema=schema)
    outs = engine.generate(
        [tok.encode("x")] * 8,
        [SamplingParams(max_tokens=40, temperature=1.0, seed=s, grammar=grammar) for s in range(8)],
    )
    for out in outs:
        value = json.loads(tok.decode(out.output_token_ids))
        assert value["k"] in (1, 2, 3) and isinstance(value["v"], bool)
    assert engine.runner.grammars is not None and not engine.runner.grammars._matchers  # finished requests let go


def test_token_logprobs_are_the_log_softmax_of_the_raw_logits_with_the_top_k():
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    out = token_logprobs(logits, [7, 8, 9], [3, None, 0])
    direct = logits.log_softmax(-1)
    assert out[1] is None
    assert out[0].logprob == pytest.approx(direct[0, 7].item(), abs=1e-6)
    assert [t for t, _ in out[0].top] == direct[0].topk(3).indices.tolist()
    assert [v for _, v in out[0].top] == pytest.approx(direct[0].topk(3).values.tolist(), abs=1e-6)
    assert out[2].token_id == 9 and out[2].top == ()
