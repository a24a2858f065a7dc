"""The one detokenizer (mooncake.serving.text.OutputText): text, stop strings and the ending token's text, for every
engine's outputs alike, the prefill's first token included; and no stop or length decision made anywhere else.

The outputs here are RequestOutputs as an engine emits them (token ids), built by hand so that each case is exact: a
tokenizer whose tokens have fixed text."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from mooncake.engine.engine import RequestOutput
from mooncake.engine.request import FinishReason, SamplingParams
from mooncake.serving.text import OutputText

ROOT = Path(__file__).resolve().parents[1]


class Pieces:
    """A tokenizer whose token t decodes to ``texts[t]`` (special token 0: "<eos>", left out unless asked)."""

    def __init__(self, texts: dict[int, str]) -> None:
        self.texts = {0: "<eos>", **texts}

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(self.texts[i] for i in ids if not (skip_special_tokens and i == 0))


TOK = Pieces({1: "Hel", 2: "lo", 3: " wor", 4: "ld", 5: "!", 6: "\n", 7: "\n", 9: "p"})


def outputs(ids: list[int], finish: FinishReason | None = None, stop_token: int | None = None):
    """The engine's outputs of ``ids``, one token each; the last finished with ``finish`` (and its stop token)."""
    for n in range(len(ids)):
        last = n == len(ids) - 1 and finish is not None
        yield RequestOutput(
            "r", ids[: n + 1], [ids[n]], last, finish if last else None, 3, 0, stop_token if last else None
        )


def run(params: SamplingParams, ids: list[int], finish=None, stop_token=None) -> tuple[list[str], object]:
    text = OutputText(TOK, [9, 9, 9], params)
    shown, last = [], None
    for out in outputs(ids, finish, stop_token):
        last = text.add(out)
        shown.append(last.text)
        if last.finish is not None:
            break
    return shown, last


def test_text_is_held_back_while_it_could_start_a_stop_string_and_cut_before_it():
    params = SamplingParams(stop=(" world",))
    shown, end = run(params, [1, 2, 3, 4, 5])
    assert "".join(shown) == "Hello"
    assert end.finish is FinishReason.STOP and end.stop == " world" and end.num_tokens == 1
    assert all(not piece.endswith(" wor") for piece in shown)  # never shown past where the stop string starts
    shown, _ = run(SamplingParams(stop=(" world",), include_stop_str_in_output=True), [1, 2, 3, 4, 5])
    assert "".join(shown) == "Hello world"


def test_the_prefills_first_token_completes_a_stop_string_like_any_other():
    shown, end = run(SamplingParams(stop=("Hel",)), [1, 2])
    assert shown == [""] and end.stop == "Hel" and end.num_tokens == 1  # the request ends at its first token


def test_a_stop_string_across_two_tokens_is_found_when_the_second_comes():
    shown, end = run(SamplingParams(stop=("\n\n",)), [1, 2, 6, 7, 5])
    assert "".join(shown) == "Hello" and end.stop == "\n\n" and end.num_tokens == 1


def test_the_ending_tokens_text_shows_only_when_asked():
    params = SamplingParams(skip_special_tokens=False)
    shown, end = run(params, [1, 2, 0], FinishReason.STOP, stop_token=0)
    assert "".join(shown) == "Hello" and end.finish is FinishReason.STOP and end.stop is None
    shown, _ = run(
        SamplingParams(skip_special_tokens=False, include_stop_str_in_output=True), [1, 2, 0], FinishReason.STOP, 0
    )
    assert "".join(shown) == "Hello<eos>"
    shown, end = run(SamplingParams(), [1, 2, 3], FinishReason.LENGTH)
    assert "".join(shown) == "Hello wor" and end.finish is FinishReason.LENGTH


def test_nothing_comes_out_after_the_end():
    text = OutputText(TOK, [], SamplingParams(stop=("lo",)))
    outs = list(outputs([1, 2, 3]))
    assert text.add(outs[0]).text == "He" and text.add(outs[1]).stop == "lo"
    assert text.add(outs[2]).text == "" and text.add(outs[2]).finish is None


@pytest.mark.parametrize("name", ["match_stop_string", "shown_output_ids"])
def test_no_stop_or_length_decision_outside_the_scheduler_and_the_detokenizer(name):
    """Stop strings are found in mooncake/serving/text.py alone; stop tokens, EOS and max_tokens in the scheduler's
    ``token_finish`` alone (our engine's scheduler, vLLM's own, and the vLLM engine's ``land`` calling ours)."""
    owners = {"mooncake/serving/text.py"}
    for path in [*ROOT.glob("mooncake/**/*.py"), *ROOT.glob("decode/*.py"), *ROOT.glob("prefill/*.py")]:
        rel = str(path.relative_to(ROOT))
        tree = ast.parse(path.read_text())
        defines = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
        uses = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} | {
            n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)
        }
        if rel not in owners:
            assert name not in defines and name not in uses, f"{rel} decides stop strings ({name})"
    assert sorted(_finish_deciders()) == ["mooncake/engine/scheduler.py:token_finish"]


def _finish_deciders() -> list[str]:
    """Functions that compare a token or a count with what ends a request (stop or EOS token ids, max_tokens) and name
    a finish reason: where a stop or length decision is made."""
    found = []
    for path in [*ROOT.glob("mooncake/**/*.py"), *ROOT.glob("decode/*.py"), *ROOT.glob("prefill/*.py")]:
        for fn in ast.walk(ast.parse(path.read_text())):
            if not isinstance(fn, ast.FunctionDef):
                continue
            compared = {
                n.attr
                for c in ast.walk(fn)
                if isinstance(c, ast.Compare)
                for n in ast.walk(c)
                if isinstance(n, ast.Attribute)
            }
            reasons = {n.attr for n in ast.walk(fn) if isinstance(n, ast.Attribute) and n.attr in ("STOP", "LENGTH")}
            returned = [n for r in ast.walk(fn) if isinstance(r, ast.Return) and r.value for n in ast.walk(r.value)]
            reasons |= {n.value for n in returned if isinstance(n, ast.Constant) and n.value in ("stop", "length")}
            if reasons and compared & {"max_tokens", "stop_token_ids", "eos_token_ids"}:
                found.append(f"{path.relative_to(ROOT)}:{fn.name}")
    return found
