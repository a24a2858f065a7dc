"""A request's recovery decisions (mooncake.gateway.recovery), driven directly with round-number clocks."""

from __future__ import annotations

from mooncake.gateway.recovery import Action, Fault, Phase, RecoveryConfig, RequestProgress

CONFIG = RecoveryConfig(hold_s=10.0, retry_budget_s=30.0, max_attempts=4, backoff_s=0.5, backoff_max_s=2.0)


def progress() -> RequestProgress:
    return RequestProgress(arrival=100.0, config=CONFIG)


def test_a_prefill_worker_failing_before_the_first_token_is_retried_at_once_and_reported():
    p = progress()
    p.placed()
    step = p.failure(Fault.PREFILL, 101.0, "prefill-0")
    assert step.action is Action.RETRY and step.delay_s == 0.0
    assert p.failed == ["prefill-0"] and p.phase is Phase.SCHEDULING
    assert p.report_failed() == ["prefill-0"]
    assert p.report_failed() == []  # told once: once restarted, it may be chosen again
    p.placed()
    p.received([7], "a", finished=False)
    assert p.phase is Phase.STREAMING


def test_a_decode_worker_dying_mid_stream_resumes_with_the_tokens_and_text_the_client_has():
    p = progress()
    p.placed()
    p.received([5], "He", finished=False)
    p.received([6, 8], "llo", finished=False)
    step = p.failure(Fault.DECODE, 103.0, "decode-1")
    assert step.action is Action.RESUME and step.delay_s == 0.0
    assert p.output_token_ids == [5, 6, 8] and p.text_shown == 5 and p.failed == ["decode-1"]
    p.placed()
    assert p.resumed == 1 and p.phase is Phase.STREAMING
    p.received([9], "!", finished=True)
    assert p.phase is Phase.FINISHED and p.output_token_ids == [5, 6, 8, 9]


def test_while_the_conductor_is_away_a_new_request_waits_backing_off_then_gives_up_at_hold_s():
    p = progress()
    delays = []
    now = 100.0
    while True:
        step = p.failure(Fault.CONDUCTOR, now)
        if step.action is Action.GIVE_UP:
            break
        assert step.action is Action.RETRY
        delays.append(step.delay_s)
        now += step.delay_s + 1.0  # each Schedule attempt takes a second to fail
    assert delays[:4] == [0.5, 1.0, 2.0, 2.0]  # doubling up to backoff_max_s
    assert now >= 110.0 and p.phase is Phase.FAILED
    assert len(p.faults) == 1  # one outage, however many tries
    assert 1.0 <= p.retry_after_s <= CONFIG.hold_s


def test_the_retry_budget_runs_from_the_failure_not_from_the_arrival():
    p = progress()
    p.placed()
    p.received([1], "x", finished=False)
    # streamed for 100 s, then the decode worker dies: the budget is 30 s from there
    assert p.failure(Fault.DECODE, 200.0, "decode-0").action is Action.RESUME
    assert p.failure(Fault.NO_INSTANCE, 215.0).action is Action.RESUME
    assert p.failure(Fault.NO_INSTANCE, 231.0).action is Action.GIVE_UP


def test_a_token_that_arrives_ends_the_outage_and_its_backoff():
    p = progress()
    p.placed()
    p.failure(Fault.DECODE, 101.0, "decode-0")
    p.placed()
    second = p.failure(Fault.DECODE, 102.0, "decode-1")
    assert second.delay_s == 0.5  # a second failure in a row backs off
    p.placed()
    p.received([3], "y", finished=False)
    third = p.failure(Fault.DECODE, 150.0, "decode-0")
    assert third.delay_s == 0.0 and third.action is Action.RESUME


def test_placements_are_capped():
    p = progress()
    for i in range(CONFIG.max_attempts):
        p.placed()
        step = p.failure(Fault.PREFILL, 101.0 + i, f"prefill-{i}")
    assert step.action is Action.GIVE_UP and p.phase is Phase.FAILED
    assert p.failed == [f"prefill-{i}" for i in range(CONFIG.max_attempts)]


def test_a_resumed_text_stream_shows_exactly_the_text_the_dead_worker_had_not(tmp_path):
    """The new decode worker rebuilds the text of the tokens the client has: the client must see no character twice
    and miss none, even where a character's bytes are split across tokens (random ids of a byte-fallback vocabulary)."""
    import random

    from mooncake.engine.engine import RequestOutput
    from mooncake.engine.request import FinishReason, SamplingParams
    from mooncake.engine.tiny import make_tiny
    from mooncake.engine.tokenizer import Tokenizer
    from mooncake.serving.text import OutputText

    tok = Tokenizer.from_dir(make_tiny(tmp_path / "model", "llama"))
    prompt = tok.encode("Once upon a time")
    rng = random.Random(3)
    ids = [rng.randrange(3, tok.vocab_size) for _ in range(120)]
    params = SamplingParams(max_tokens=len(ids), ignore_eos=True)

    def out(n: int) -> RequestOutput:  # the engine's output of token n (the last one ends the request: length)
        last = n == len(ids) - 1
        return RequestOutput("r", ids[: n + 1], [ids[n]], last, FinishReason.LENGTH if last else None, len(prompt), 0)

    def texts(text: OutputText, start: int, end: int) -> str:
        return "".join(text.add(out(n)).text for n in range(start, end))

    full = texts(OutputText(tok, prompt, params), 0, len(ids))
    for k in range(1, len(ids)):
        shown = texts(OutputText(tok, prompt, params), 0, k)  # what the client had when its decode worker died
        rest = texts(OutputText(tok, prompt, params, output_ids=ids[:k], shown=len(shown)), k, len(ids))
        assert shown + rest == full, k
