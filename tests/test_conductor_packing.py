"""The packed queue (conductor.policies.pack): a prefill worker's engine computes its prompts in steps of its step
budget, chunk by chunk, first come first served, and the Conductor predicts it so.

Numbers by hand: 1 ms a prompt token and 100 ms of fixed cost (the prefill predictor's
constant), a step budget of 512 tokens.
"""

from __future__ import annotations

import pytest
from conductor_helpers import KEYS, ROUND, conductor

from conductor.predictors import Predictors
from conductor.types import Decision, Instance, Load, Role, ScheduleRequest

PACKED = ROUND.model_copy(update={"prefill_overhead_s": 0.1})


def prefill(load: Load, capacity: int = 512, stages: int = 1) -> Instance:
    return Instance(
        "p0",
        Role.PREFILL,
        "10.0.0.1:7000",
        node="kv0",
        capacity=capacity,
        load=load,
        pipeline_stages=stages,
        pipeline_chunk=capacity if stages > 1 else 0,
    )


def place(c, prompt: int) -> Decision:
    c.register(Instance("d0", Role.DECODE, "10.0.1.1:7000", node="kv9"), 0.0)
    d = c.schedule(ScheduleRequest("new", KEYS[: prompt // 16], prompt, 16), 0.0)  # no block cached anywhere
    assert isinstance(d, Decision)
    return d


def test_a_prompt_behind_a_queue_ends_with_the_step_that_holds_its_last_token():
    """700 tokens of two prompts ahead (0.9 s one after the other), 100 new: 800 tokens are 2 steps of 512, so two
    fixed costs where one prompt after the other counts three: 1.0 s, not 1.1 s. Its first chunk rides on the second
    step, after one full step of 0.1 s and 512 tokens."""
    c = conductor("none", predictors=PACKED)
    c.register(prefill(Load()), 0.0)
    c.heartbeat("p0", Load(queued_requests=2, queued_s=0.9, queued_tokens=700), 0.0)
    d = place(c, 100)
    assert d.predicted.ttft_s == pytest.approx(1.0)
    assert d.predicted.queue_s == pytest.approx(0.1 + 0.512)
    assert d.predicted.prefill_s == pytest.approx(1.0 - 0.612)
    # it adds its own prefill alone to the queue (as the worker reports it: one prompt after the other)
    assert c.instances["p0"].load.queued_s == pytest.approx(0.9 + 0.2)
    assert c.instances["p0"].load.queued_tokens == 800


def test_an_idle_worker_a_pipeline_group_and_a_worker_that_reports_no_tokens_are_one_prompt_after_the_other():
    for inst, load in (
        (prefill(Load()), Load()),
        (prefill(Load(), stages=2), Load(queued_requests=2, queued_s=0.9, queued_tokens=700)),
        (prefill(Load()), Load(queued_requests=2, queued_s=0.9)),
    ):
        c = conductor("none", predictors=PACKED)
        c.register(inst, 0.0)
        queued = load.queued_s
        c.heartbeat("p0", load, 0.0)
        d = place(c, 100)
        alone = c.predictors.prefill_for(inst.pipeline_stages, inst.pipeline_chunk).predict(100, 0)
        assert d.predicted.ttft_s == pytest.approx(queued + alone)
        assert d.predicted.queue_s == pytest.approx(queued)


def test_the_queue_drains_its_tokens_at_the_pace_of_its_seconds():
    c = conductor("none", predictors=PACKED)
    c.register(prefill(Load()), 0.0)
    c.heartbeat("p0", Load(queued_requests=2, queued_s=0.8, queued_tokens=600), 0.0)
    c.instances["p0"].drain(0.4)  # half of it computed
    assert c.instances["p0"].load.queued_s == pytest.approx(0.4)
    assert c.instances["p0"].load.queued_tokens == 300


def test_requests_on_their_way_count_their_tokens_in_the_queue():
    """Placed but not yet received by the worker (its heartbeat says how many it received): their tokens join what
    it reports."""
    c = conductor("none", predictors=PACKED)
    c.register(prefill(Load()), 0.0)
    place(c, 200)  # received: its heartbeat counts it
    c.schedule(ScheduleRequest("next", KEYS[: 300 // 16], 300, 16), 0.0)  # on its way
    c.heartbeat("p0", Load(queued_requests=1, queued_s=0.5, queued_tokens=150, received_requests=1), 0.1)
    load = c.instances["p0"].load
    assert load.queued_tokens == 150 + 300 and load.queued_requests == 2
    assert load.queued_s == pytest.approx(0.5 + 0.4)


def test_pack_never_makes_a_prompt_cheaper_than_its_steps_fixed_costs():
    from conductor.policies import pack

    preds = Predictors.from_config(PACKED, 1)
    inst = prefill(Load(queued_requests=50, queued_s=0.2, queued_tokens=100))  # 50 tiny prompts: 5 s of fixed costs
    queue, prefill_s = pack(inst, 10, 0.2, 0.11, preds)
    assert queue == 0.0 and prefill_s == pytest.approx(0.1)  # one step of 110 tokens: one fixed cost


def test_the_prediction_log_has_each_part_predicted_and_measured_and_the_load_it_was_placed_under(tmp_path):
    """conductor.audit: the request of the first test, its first chunk behind 700 tokens on the one busy worker; its
    decode worker measures 0.7 s of queue and 0.5 s of prefill in a TTFT of 1.5 s (0.3 s the rest)."""
    import json

    from conductor.audit import PredictionLog

    c = conductor("none", predictors=PACKED)
    c.audit = PredictionLog(tmp_path / "logs" / "predictions.jsonl")
    c.register(prefill(Load()), 0.0)
    c.heartbeat("p0", Load(queued_requests=2, queued_s=0.9, queued_tokens=700), 0.0)
    place(c, 100)
    c.decode_started("new", 2.0, measured_ttft_s=1.5, queue_s=0.7, prefill_s=0.5)
    c.decode_started("new", 3.0, measured_ttft_s=9.0)  # a second report is not a second line
    c.audit.close()
    (line,) = (tmp_path / "logs" / "predictions.jsonl").read_text().splitlines()
    row = json.loads(line)
    assert (row["request"], row["instance"], row["prompt_tokens"], row["compute_tokens"]) == ("new", "p0", 100, 100)
    assert (row["ahead_tokens"], row["busy"], row["after_s"], row["slowdown"]) == (700, 1, 2.0, 1.0)
    assert row["predicted"] == pytest.approx({"ttft": 1.0, "queue": 0.612, "prefill": 0.388, "transfer": 0.0})
    assert row["measured"] == pytest.approx({"ttft": 1.5, "queue": 0.7, "prefill": 0.5, "transfer": 0.3})


def test_a_retry_goes_ahead_of_the_queue_and_is_predicted_so_where_a_new_request_is_refused():
    """A request placed again after a failure (ScheduleRequest.retry) is run before the prompts waiting at its prefill
    worker (Decision.ahead): it waits for the prompt in progress only, one of the 5 queued (1 s of the 5 s). Against
    a 2 s TTFT SLO a new request behind the whole queue is refused, the retry admitted; its own work still joins the
    queue the others see."""
    c = conductor("early", predictors=PACKED)
    c.register(prefill(Load()), 0.0)
    c.register(Instance("d0", Role.DECODE, "10.0.1.1:7000", node="kv9"), 0.0)
    c.heartbeat("p0", Load(queued_requests=5, queued_s=5.0, queued_tokens=2500), 0.0)
    new = c.schedule(ScheduleRequest("new", KEYS[:6], 100, 16), 0.0)
    assert not isinstance(new, Decision) and new.reason.value == "ttft_slo"
    retry = c.schedule(ScheduleRequest("again", KEYS[:6], 100, 16, retry=True), 0.0)
    assert isinstance(retry, Decision) and retry.ahead and retry.prefill == "p0"
    # the prompt in progress (1 s, 500 tokens) and its own 100 tokens (0.2 s): 600 tokens, two steps of 512
    assert retry.predicted.ttft_s == pytest.approx(1.2)
    assert c.instances["p0"].load.queued_s == pytest.approx(5.0 + 0.2)
    assert c.instances["p0"].load.queued_requests == 6
    plain = c.schedule(ScheduleRequest("later", KEYS[:6], 100, 16), 0.0)
    assert not isinstance(plain, Decision) and not getattr(plain, "ahead", False)
