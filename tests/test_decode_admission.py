"""What a decode worker turns away: a request still in its prefill holds landing room, not a place in the batch.

A real DecodeWorker on the tiny model with a batch of one: however many requests are in their prefills, a new one is
taken; once a whole batch of requests has landed and waits for a place, the next is refused (decode_busy).
"""

from __future__ import annotations

import time
import uuid

import pytest

from decode.config import DecodeConfig
from decode.worker import Busy, DecodeWorker
from mooncake.engine.request import SamplingParams


def decode_worker(tiny_dir, shm_dir, **config) -> DecodeWorker:
    """A real decode worker on the tiny model: 64 cache blocks of 16 tokens, no write-behind."""
    return DecodeWorker(
        DecodeConfig(
            id=f"decode-{uuid.uuid4().hex[:6]}",
            model=str(tiny_dir),
            block_size=16,
            num_kv_blocks=64,
            max_model_len=256,
            write_behind=False,
            shm_dir=shm_dir,
            **config,
        )
    )


def test_requests_in_prefill_take_no_place_in_the_batch_but_a_whole_batch_waiting_is_refused(tiny_dir, shm_dir):
    worker = decode_worker(tiny_dir, shm_dir, max_num_seqs=1)
    try:
        assert worker.batch_cap == 1
        worker.counts.in_prefill = 5  # five requests between admission and their first token (each holds landing room)
        worker._admit()  # taken: none of them is in the batch yet
        worker.counts.in_prefill = 0
        outputs = []
        params = SamplingParams(max_tokens=230, temperature=0.0, ignore_eos=True)
        for n in range(2):  # two land: one runs, one waits for its place (a whole batch of one)
            worker.loop.submit_nowait(
                outputs.append, prompt_token_ids=[11 + n] * 20, sampling_params=params, request_id=f"landed-{n}"
            ).result(10)
        deadline = time.monotonic() + 10
        while worker.loop.num_running < 2:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        with pytest.raises(Busy, match="1 requests waiting for a place in a batch of 1"):
            worker._admit()
    finally:
        worker.close()


def test_the_heartbeat_reports_the_mean_step_since_the_last_one(tiny_dir, shm_dir):
    """The Conductor's decode predictor learns from one sample per heartbeat: the mean of the steps between two, not
    the last step alone (which swung with whatever else the cores were doing at that moment)."""
    worker = decode_worker(tiny_dir, shm_dir, max_num_seqs=4)
    try:
        worker.learn_step_times()
        assert worker.step_mean is None  # no step yet: nothing to report
        done = []
        params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        for n in range(2):
            worker.loop.submit_nowait(
                lambda out: out.finished and done.append(out),
                prompt_token_ids=[7 + n] * (20 + 30 * n),
                sampling_params=params,
                request_id=f"r{n}",
            ).result(10)
        deadline = time.monotonic() + 30
        while len(done) < 2:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        # the steps that computed a prompt (its tokens beside the batch's one each) are no decode steps: not counted
        steps = [s for s in worker.loop.steps if s.new_tokens <= s.batch]
        assert len(steps) >= 10 and {s.batch for s in steps} >= {2} and len(steps) < len(worker.loop.steps)
        worker.learn_step_times()
        mean = worker.step_mean
        assert mean.batch == pytest.approx(sum(s.batch for s in steps) / len(steps))
        assert mean.context_tokens == pytest.approx(sum(s.context_tokens for s in steps) / len(steps))
        assert mean.seconds == pytest.approx(sum(s.seconds for s in steps) / len(steps))
        worker.learn_step_times()
        assert worker.step_mean is None  # the next heartbeat: no step since
    finally:
        worker.close()


def test_the_kv_a_worker_registers_and_reports_is_what_it_refuses_by(tiny_dir, shm_dir):
    """Its capacity (the engine's cache: prompts land there), the blocks its batch holds and those held for prompts in
    prefill (the engine's own counts), as its heartbeat reports them: a prompt's blocks are taken exactly when they
    leave room for them, which is what the Conductor checks before it places one there
    (conductor.core.Conductor.kv_held)."""
    worker = decode_worker(tiny_dir, shm_dir)
    try:
        assert (worker.kv_blocks, worker.kv_shared, worker.kv_held) == (64, True, (0, 0))
        params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
        for n in range(5):  # five prompts of 10 blocks in their prefills: in the engine, waiting for their KV
            worker.handoff.admit(f"p{n}", [3 + n] * 160, params, [], None, "127.0.0.1:1", [].append)
        assert worker.kv_held == (0, 50) and worker.loop.num_running == 0 and worker.landing_room == 64
        params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
        worker.loop.submit_nowait([].append, prompt_token_ids=[11] * 100, sampling_params=params, request_id="a")
        deadline = time.monotonic() + 10
        while worker.loop.num_running < 1:
            assert time.monotonic() < deadline
            time.sleep(0.01)

        def between_steps(engine):  # (on the engine's thread: no step runs meanwhile)
            running, held = worker.kv_held
            return running, held, worker.kv_blocks - running - held, engine.num_free_blocks

        running, held, room, free = worker.loop.call(between_steps).result(10)
        assert held == 50 and 7 <= running <= 10  # 100 tokens and those generated so far, 16 to a block
        assert room == free == 64 - 50 - running
        with pytest.raises(Busy, match="free KV blocks wanted"):
            worker.handoff.admit("big", [5] * 240, SamplingParams(max_tokens=16), [], None, "127.0.0.1:1", [].append)
        for n in range(5):  # their prefills failed: the engine drops them, and their blocks are free again
            worker.loop.abort(f"p{n}")
        held = worker.loop.call(lambda engine: worker.kv_held[1]).result(10)
        assert held == 0
    finally:
        worker.close()
