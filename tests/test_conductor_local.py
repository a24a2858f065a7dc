"""The Conductor's choice between a prefill worker and the decode worker itself (issue 35, conductor.local), by hand.

Round numbers (tests/conductor_helpers.py): prefill 1 ms a token, transfer 1 ms a block, a decode step 10 ms + 10 ms
a running request; TBT SLO 100 ms; a decode worker's chunk here is 64 tokens; the hand-off is learnt as 50 ms. The
decode worker reports a batch cap of 4 (its own TBT budget's): its steps may grow to 50 ms while a prompt rides on
them, so a chunk may add 50 ms (50 tokens); under auto it computes prompts while its step is at most 50 ms (half the
TBT limit).
"""

from __future__ import annotations

import pytest
from conductor_helpers import KEYS, PARENTS, cluster, conductor, decode, prefill, request

from conductor.types import Decision, Load, Rejection
from kvstore.events import Tier


def local_conductor(mode: str = "auto", running: int = 2, queued_s: float = 0.5, prefix_blocks: int = 0, cap: int = 4):
    c = conductor("early", local_prefill=mode, local_chunk_tokens=64)
    cluster(c)
    c.heartbeat("p0", Load(queued_s=queued_s), 0.0)
    c.heartbeat("d0", Load(running_requests=running, batch_cap=max(cap, running + 1)), 0.0)
    for i in range(prefix_blocks):  # a prefix in kv0's DRAM
        c.stored("kv0", KEYS[i], Tier.DRAM, PARENTS[i])
    c.handoff_sample(0.05)
    return c


def test_a_short_new_part_after_a_pooled_prefix_is_computed_on_the_decode_worker():
    c = local_conductor(prefix_blocks=40)
    d = c.schedule(request("chat-turn", blocks=41, prompt=660), 0.0)
    # prefill worker: 0.5 s queue + 20 tokens (40 blocks of its own node reused) + 50 ms hand-off = 0.57 s
    # decode worker: 40 blocks read (0.04 s) + 20 tokens (0.02 s) riding on one step of its batch of 2 (0.03 s) = 0.09 s
    assert isinstance(d, Decision) and d.local and d.prefill == "" and d.decode == "d0"
    assert d.predicted.ttft_s == pytest.approx(0.09)
    # its TBT: a step of the batch it joins (3); the step its chunk rides on (the batch grown to its cap, 0.05 s, and
    # the chunk, 0.02 s) is held to the SLO on its own
    assert d.predicted.tbt_s == pytest.approx(0.04)
    assert d.node == "kv0" and (d.plan.fetch_node, d.plan.fetch_blocks, d.plan.compute_tokens) == ("kv0", 40, 20)
    assert c.counters.local == 1 and c.served["d0"].decisions == 1
    assert c.instances["d0"].local_queue_s == pytest.approx(0.09)  # the next one it computes waits for this one


def test_a_long_prompt_goes_to_a_prefill_worker():
    c = local_conductor(queued_s=0.0)
    d = c.schedule(request("long", blocks=50, prompt=800), 0.0)
    # prefill worker: 0.8 s + 50 ms hand-off = 0.85 s; decode worker: 0.8 s + 16 chunks of 50 tokens, the first on a
    # 0.03 s step of its batch as it is, the other 15 on 0.05 s steps of the batch grown to its cap = 1.58 s
    assert isinstance(d, Decision) and not d.local and d.prefill == "p0"
    assert d.predicted.ttft_s == pytest.approx(0.85)
    assert d.predicted.transfer_s == pytest.approx(0.05)  # the hand-off counts with the transfers: fixed, not scaled
    assert c.instances["p0"].load.queued_s == pytest.approx(0.8)  # the prefill worker's queue grows by its own part


def test_a_decode_batch_near_its_tbt_limit_sends_the_prompt_to_a_prefill_worker():
    c = local_conductor(running=8)
    d = c.schedule(request("short", blocks=10, prompt=160), 0.0)
    # the batch's step takes 0.09 s of the 0.1 s TBT limit, over half of it: no time to spare for a prompt; a prefill
    # worker: 0.5 s queue + 0.16 s + 0.05 s hand-off
    assert isinstance(d, Decision) and not d.local and d.prefill == "p0"
    assert d.predicted.ttft_s == pytest.approx(0.71)


def test_a_decode_worker_whose_measured_steps_are_over_the_tbt_limit_computes_no_prompt_until_they_are_back():
    """The step model says the batch of 2 steps in 0.03 s; the worker measured 0.12 s a step since its last heartbeat
    (the chunks of a prompt it computed rode on them, or its cores are shared): over the 0.1 s limit, so auto sends
    the chat turn to the prefill worker. Once it measures 0.04 s again, the turn is computed there."""
    c = local_conductor(prefix_blocks=40)
    c.heartbeat("d0", Load(running_requests=2, batch_cap=4, step_s=0.12, step_batch=2), 0.0)
    d = c.schedule(request("slow-steps", blocks=41, prompt=660), 0.0)
    assert isinstance(d, Decision) and not d.local and d.prefill == "p0"
    c.heartbeat("p0", Load(queued_s=0.5), 0.1)
    c.heartbeat("d0", Load(running_requests=2, batch_cap=4, step_s=0.04, step_batch=2), 0.1)
    d = c.schedule(request("back", blocks=41, prompt=660), 0.1)
    assert isinstance(d, Decision) and d.local and d.decode == "d0"


def test_a_batch_that_may_grow_to_its_tbt_limit_leaves_no_room_for_a_prompts_chunks():
    c = local_conductor(prefix_blocks=40, cap=9)
    d = c.schedule(request("chat-turn", blocks=41, prompt=660), 0.0)
    # the batch of 2 steps in 0.03 s now, but its cap of 9 steps in 0.1 s: a chunk of even one token would take a step
    # of the grown batch over the SLO, so the short new part goes to the prefill worker after all
    assert isinstance(d, Decision) and not d.local and d.prefill == "p0"


def test_a_decode_worker_holds_its_prompts_chunks_to_what_its_batch_can_carry():
    c = local_conductor("always", running=5)
    d = c.schedule(request("chunked", blocks=10, prompt=160), 0.0)
    # a step of the batch of 5 takes 0.06 s, of its cap (6) 0.07 s: 30 tokens (0.03 s) fit beside that in the 0.1 s
    # SLO, so 6 chunks: the first on a step of the batch as it is, the other 5 of the batch grown to its cap
    assert isinstance(d, Decision) and d.local and d.chunk_tokens == 30
    assert d.predicted.ttft_s == pytest.approx(0.16 + 0.06 + 5 * 0.07)
    assert d.predicted.tbt_s == pytest.approx(
        0.07
    )  # its own: a step of the batch it joins (6); its chunks' steps take 0.1 s


def test_never_and_always_keep_the_other_two_behaviours():
    never = local_conductor("never", prefix_blocks=40).schedule(request("a", blocks=41, prompt=660), 0.0)
    assert isinstance(never, Decision) and not never.local
    always = local_conductor("always", queued_s=0.0).schedule(request("b", blocks=50, prompt=800), 0.0)
    assert isinstance(always, Decision) and always.local and always.predicted.ttft_s == pytest.approx(1.58)


def test_a_decode_worker_running_stock_vllm_never_computes_a_prompt():
    c = conductor("early", local_prefill="always")
    c.register(prefill(0), 0.0)
    inst = decode(0)
    inst.engine = "vllm"
    c.register(inst, 0.0)
    d = c.schedule(request("v"), 0.0)
    assert isinstance(d, Decision) and not d.local


def test_local_prompts_queue_behind_each_other_and_the_queue_drains():
    c = local_conductor("always", running=0)
    # 0.16 s in 4 chunks of 50 tokens: the first on no step (an empty batch), the other 3 on steps of the batch grown
    # to its cap (0.05 s each) = 0.31 s
    first = c.schedule(request("x", blocks=10, prompt=160), 0.0)
    second = c.schedule(request("y", blocks=10, prompt=160), 0.0)
    assert first.predicted.ttft_s == pytest.approx(0.31)
    # behind the first (0.31 s); its first chunk rides on a step of a batch of one (the first: 0.02 s), the others as
    # above: 0.31 + 0.16 + 0.02 + 3 x 0.05 = 0.64 s
    assert second.predicted.queue_s == pytest.approx(0.31) and second.predicted.ttft_s == pytest.approx(0.64)
    third = c.schedule(request("z", blocks=10, prompt=160), 0.30)  # 0.3 s later: 0.34 s of the two (0.64 s) is left
    assert third.predicted.queue_s == pytest.approx(0.34)


def test_the_hand_off_is_learnt_from_what_decode_workers_measure():
    c = conductor("early")
    assert c.handoff_s == 0.0  # nothing measured: none assumed
    c.handoff_sample(0.2)
    assert c.handoff_s == pytest.approx(0.2)  # the first replaces the default
    c.handoff_sample(0.1)
    assert c.handoff_s == pytest.approx(0.9 * 0.2 + 0.1 * 0.1)
    with pytest.raises(ValueError):
        c.handoff_sample(-1.0)


def test_a_local_prompt_whose_ttft_is_over_the_slo_is_refused_up_front():
    c = local_conductor("always", queued_s=0.0)
    out = c.schedule(request("huge", blocks=64, prompt=3000), 0.0)  # 3 s + 60 chunks' steps, over the 2 s TTFT SLO
    assert isinstance(out, Rejection) and out.reason.value == "ttft_slo"


def test_a_decode_workers_own_step_budget_bounds_its_chunks():
    c = conductor("early", local_prefill="always", local_chunk_tokens=64)
    c.register(prefill(0), 0.0)
    inst = decode(0, capacity=4)  # its batch may grow to 4: a chunk may take 50 tokens beside a step of it
    inst.step_tokens = (
        16  # as it registered: its engine takes 16 tokens a step (the Conductor's 64 is for workers that do not say)
    )
    c.register(inst, 0.0)
    d = c.schedule(request("budget", blocks=10, prompt=160), 0.0)
    assert isinstance(d, Decision) and d.local and d.chunk_tokens == 16


def test_with_the_prefill_workers_queued_past_the_slo_a_decode_worker_with_time_to_spare_serves_and_nothing_is_shed():
    c = local_conductor(queued_s=100.0, running=0)
    assert c.shed_s(0.0) == 0.0  # the gateway keeps asking: a short prompt can still be served
    d = c.schedule(request("short", blocks=1, prompt=30), 0.0)
    assert isinstance(d, Decision) and d.local and d.predicted.ttft_s == pytest.approx(0.03)
    never = local_conductor("never", queued_s=100.0, running=0)
    assert never.shed_s(0.0) > 0.0 and isinstance(never.schedule(request("short", blocks=1, prompt=30), 0.0), Rejection)
