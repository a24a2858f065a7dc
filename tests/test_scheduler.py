"""Scheduler: token budget, chunked prefill, batch size, preemption, abort (no torch, no model).

Each test drives a real Scheduler over a real BlockPool with a fixed "sampled" token,
and checks the decisions a user would feel: who runs, with how many tokens, who is
pushed out, and what memory is left.
"""

from __future__ import annotations

import pytest

from mooncake.blocks import KeyChain, model_fingerprint
from mooncake.engine.block_pool import BlockPool
from mooncake.engine.request import FinishReason, Request, RequestStatus, SamplingParams
from mooncake.engine.scheduler import Scheduler, SchedulerOutput

FP = model_fingerprint("scheduler-test")
SAMPLED = 7  # every sampled token; never a stop token here


def make_request(rid: str, prompt, max_tokens: int = 16, **kw) -> Request:
    return Request(
        request_id=rid,
        prompt_token_ids=list(prompt),
        sampling_params=SamplingParams(temperature=0.0, max_tokens=max_tokens),
        key_chain=KeyChain.start(kw.pop("block_size", 4), FP),
        **kw,
    )


def make_scheduler(num_blocks=64, block_size=4, max_num_seqs=8, budget=32, max_model_len=1024):
    pool = BlockPool(num_blocks)
    return Scheduler(pool, block_size, max_num_seqs, budget, max_model_len)


def step(sched: Scheduler) -> tuple[SchedulerOutput, list[Request], set[str]]:
    """One engine step without a model: the plan, the finished requests, who got a token."""
    out = sched.schedule()
    # ``ScheduledRequest.samples`` is only meaningful before the update appends the token.
    sampled = {s.request.request_id: SAMPLED for s in out.scheduled if s.samples}
    finished = sched.update_from_output(out, sampled)
    return out, finished, set(sampled)


def plan(out: SchedulerOutput) -> list[tuple[str, int]]:
    return [(s.request.request_id, s.num_new_tokens) for s in out.scheduled]


def test_token_budget_is_respected_every_step():
    sched = make_scheduler(budget=10)
    for i, rid in enumerate("abc"):
        sched.add_request(make_request(rid, range(10 * i, 10 * i + 6), max_tokens=4))
    out, _, _ = step(sched)
    assert plan(out) == [("a", 6), ("b", 4)]  # b's prompt is cut to fit
    out, _, _ = step(sched)
    assert plan(out) == [("a", 1), ("b", 2), ("c", 6)]
    for _ in range(10):
        out, _, _ = step(sched)
        assert out.num_batched_tokens <= 10
    assert not sched.has_unfinished()


def test_a_request_added_ahead_starts_before_those_waiting_but_not_before_those_running():
    """A prefill worker's retry (``ahead``) jumps the queue of waiting prompts, not the prompt being computed."""
    sched = make_scheduler(budget=8)
    sched.add_request(make_request("a", range(12), max_tokens=2))
    out, _, _ = step(sched)
    assert plan(out) == [("a", 8)]
    sched.add_request(make_request("b", range(20, 28), max_tokens=2))
    sched.add_request(make_request("c", range(30, 38), max_tokens=2))
    sched.add_request(make_request("r", range(40, 44), max_tokens=2), ahead=True)
    out, _, _ = step(sched)
    assert plan(out) == [("a", 4), ("r", 4)]  # a's last chunk first, then the retry, before b and c
    out, _, _ = step(sched)
    assert plan(out) == [("a", 1), ("r", 1), ("b", 6)]
    # two more retries: the first one first, both before c
    sched.add_request(make_request("r2", range(50, 54), max_tokens=1), ahead=True)
    sched.add_request(make_request("r3", range(60, 64), max_tokens=1), ahead=True)
    assert [r.request_id for r in sched.waiting] == ["r2", "r3", "c"]


def test_long_prompt_is_chunked_and_running_decodes_go_first():
    sched = make_scheduler(budget=8)
    sched.add_request(make_request("a", range(5), max_tokens=20))
    out, _, _ = step(sched)
    assert plan(out) == [("a", 5)]
    sched.add_request(make_request("b", range(100, 130), max_tokens=2))
    chunks = []
    while True:
        out, _, sampled = step(sched)
        assert out.scheduled[0].request.request_id == "a" and out.scheduled[0].num_new_tokens == 1
        (b,) = [s for s in out.scheduled if s.request.request_id == "b"]
        chunks.append(b.num_new_tokens)
        if "b" in sampled:
            break
        assert b.request.num_output_tokens == 0  # a mid-prompt chunk samples nothing
    assert chunks == [7, 7, 7, 7, 2]
    assert b.request.num_output_tokens == 1


def test_max_num_seqs_caps_the_running_batch():
    sched = make_scheduler(max_num_seqs=2, budget=100)
    for rid in "abcd":
        sched.add_request(make_request(rid, range(3), max_tokens=3 if rid == "a" else 10))
    out, _, _ = step(sched)
    assert plan(out) == [("a", 3), ("b", 3)]
    assert [r.request_id for r in sched.waiting] == ["c", "d"]
    step(sched)
    out, finished, _ = step(sched)
    assert [r.request_id for r in finished] == ["a"] and finished[0].finish_reason == FinishReason.LENGTH
    out, _, _ = step(sched)
    assert plan(out) == [("b", 1), ("c", 3)]
    assert len(sched.running) == 2


def test_preemption_takes_the_newest_request_and_requeues_it_first():
    # 6 blocks of 4 tokens: two 8-token prompts fit and grow until the cache is full.
    sched = make_scheduler(num_blocks=6, max_num_seqs=2, budget=64)
    sched.add_request(make_request("old", range(8), max_tokens=20))
    sched.add_request(make_request("new", range(50, 58), max_tokens=20))
    sched.add_request(make_request("later", range(90, 94), max_tokens=20))
    preempted = []
    for _ in range(6):
        generated = sched.requests["new"].num_output_tokens
        out, _, _ = step(sched)
        if out.preempted:
            preempted = out.preempted
            break
    assert preempted == ["new"]
    victim = sched.requests["new"]
    assert victim.status == RequestStatus.PREEMPTED and victim.block_ids == [] and victim.num_computed_tokens == 0
    assert victim.num_output_tokens == generated > 0  # what it generated is kept; only its KV is recomputed
    assert [r.request_id for r in sched.waiting] == ["new", "later"]
    assert [r.request_id for r in sched.running] == ["old"]
    assert plan(out) == [("old", 1)] and sched.num_preemptions == 1
    # Its 3 computed blocks stay cached; the one "old" needed was taken from its tail, so on
    # return it finds its first two blocks and recomputes only the rest.
    assert len(sched.requests["old"].block_ids) == 4 and sched.pool.num_free_blocks == 2
    assert len(sched.pool.lookup(victim.block_keys())) == 2


def test_preempted_request_comes_back_and_finishes():
    sched = make_scheduler(num_blocks=6, max_num_seqs=2, budget=64)
    reqs = [make_request(rid, range(i * 10, i * 10 + 8), max_tokens=8) for i, rid in enumerate(["x", "y"])]
    for r in reqs:
        sched.add_request(r)
    finished = []
    for _ in range(60):
        _, done, _ = step(sched)
        finished += done
        if not sched.has_unfinished():
            break
    assert sched.num_preemptions >= 1
    assert sorted(r.request_id for r in finished) == ["x", "y"]
    assert all(r.output_token_ids == [SAMPLED] * 8 for r in reqs)
    assert sched.pool.num_free_blocks == 6


def test_a_request_outgrowing_the_whole_cache_does_not_stall_forever():
    sched = make_scheduler(num_blocks=4, budget=64)
    sched.add_request(make_request("big", range(12), max_tokens=20))  # 12 + 20 tokens need 8 blocks
    for _ in range(50):
        step(sched)
        if not sched.has_unfinished():
            break
    assert not sched.has_unfinished(), "the request neither finished nor failed"


def test_abort_frees_blocks_of_waiting_and_running_requests():
    sched = make_scheduler(num_blocks=16, max_num_seqs=1)
    sched.add_request(make_request("run", range(10), max_tokens=50))
    sched.add_request(make_request("wait", range(20, 30), max_tokens=50))
    step(sched)
    step(sched)
    assert sched.pool.num_free_blocks == 16 - 3
    aborted = sched.abort("wait")
    assert aborted.finish_reason == FinishReason.ABORT and aborted.status == RequestStatus.FINISHED_ABORTED
    assert sched.pool.num_free_blocks == 16 - 3
    sched.abort("run")
    assert sched.pool.num_free_blocks == 16
    assert not sched.has_unfinished() and sched.abort("run") is None
    assert sched.schedule().scheduled == []


def test_prefix_hits_share_blocks_and_leave_the_last_token_to_compute():
    sched = make_scheduler(num_blocks=16)
    first = make_request("first", range(12), max_tokens=1)
    sched.add_request(first)
    step(sched)
    assert first.finish_reason == FinishReason.LENGTH
    # Same 12-token prompt: 3 full cached blocks, but the last token must be computed for its logits.
    again = make_request("again", range(12), max_tokens=5)
    sched.add_request(again)
    out, _, _ = step(sched)
    assert plan(out) == [("again", 4)] and out.scheduled[0].num_computed_tokens == 8
    assert again.num_cached_tokens == 8
    # A third request sharing two blocks with the running one holds them too.
    third = make_request("third", list(range(8)) + [40, 41, 42], max_tokens=2)
    sched.add_request(third)
    step(sched)
    assert third.block_ids[:2] == again.block_ids[:2]
    assert [sched.pool.blocks[b].ref_cnt for b in again.block_ids[:2]] == [2, 2]


def test_external_kv_is_imported_and_not_recomputed():
    sched = make_scheduler(num_blocks=16)
    req = make_request("ext", range(14), max_tokens=4, external_kv=object(), num_external_tokens=10)
    sched.add_request(req)
    out = sched.schedule()
    assert plan(out) == [("ext", 4)] and out.scheduled[0].num_computed_tokens == 10
    (imp,) = out.imports
    assert imp.request is req and imp.first_block == 0 and imp.block_ids == req.block_ids[:3]
    assert req.num_imported_tokens == 10


def test_prompt_larger_than_the_cache_is_refused():
    sched = make_scheduler(num_blocks=4)
    with pytest.raises(ValueError, match="needs 5 KV blocks; the cache has 4"):
        sched.add_request(make_request("huge", range(16)))  # 16 tokens + 1 to generate = 5 blocks
    sched.add_request(make_request("fits", range(15)))
    with pytest.raises(ValueError, match="already in use"):
        sched.add_request(make_request("fits", range(3)))


def test_a_prompt_with_a_chunk_cap_takes_at_most_that_many_tokens_a_step_beside_the_decodes():
    """A decode worker computing a prompt itself holds it to the chunk the Conductor chose (conductor.local), so each
    step of the batch decoding beside it stays within the TBT SLO; the step's budget would allow more."""
    sched = make_scheduler(budget=64)
    sched.add_request(make_request("decoding", range(1, 5)))
    step(sched)  # its prompt: from now on it decodes a token a step
    sched.add_request(make_request("local", range(100, 140), chunk_tokens=12))
    plans = []
    while True:
        out, _, sampled = step(sched)
        plans.append(plan(out))
        if "local" in sampled:
            break
    # 40 tokens in chunks of 12, each step beside the decoding request's one token; the last chunk gives its first token
    assert plans == [[("decoding", 1), ("local", 12)]] * 3 + [[("decoding", 1), ("local", 4)]]
