"""Prefill on the decode worker (issue 35, conductor.local): a real cluster whose Conductor places every prompt on its
decode worker (``--local-prefill always``) serves the tokens one engine alone serves, cold and with a prefix from the
pool, and no prefill worker computes anything; under ``auto`` (the default) short turns on an idle cluster skip the
hand-off once the Conductor has learnt what it costs, with the same tokens."""

from __future__ import annotations

import random
import time

import pytest
from clusters import backend, conductor, generate, instances, reference_tokens, start_cluster, tokens
from replays import replay, undisturbed_run, wait_idle, wait_restarted
from rich.console import Console

from mooncake.cli.pool_cmd import status_table
from protos import conductor_pb2 as cpb


@pytest.fixture(scope="module")
def cluster(tiny_dir, tmp_path_factory):
    c = start_cluster(tiny_dir, tmp_path_factory.mktemp("run"), prefill=1, decode=1, local_prefill="always")
    yield c
    c.stop()


def prompt_of(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 440) for _ in range(n)]  # the tiny vocabulary


@pytest.mark.parametrize("length", [5, 100, 700])  # under a block, several, more than one step's token budget (512)
def test_a_prompt_computed_on_the_decode_worker_gives_one_engines_greedy_tokens(cluster, tiny_dir, length):
    before = instances(cluster)
    prompt = prompt_of(length, seed=length)
    got = generate(backend(cluster), f"local-{length}", prompt, 20, temperature=0.0, ignore_eos=True)
    assert tokens(got) == reference_tokens(tiny_dir, prompt, 20)
    assert got[-1].prompt_tokens == length and got[-1].completion_tokens == 20 and got[-1].finish_reason == "length"
    after = instances(cluster)
    assert after["decode-0"].decisions == before["decode-0"].decisions + 1  # computed there
    assert after["prefill-0"].decisions == before["prefill-0"].decisions == 0  # no prefill worker touched it


def test_a_one_token_answer_computed_on_the_decode_worker(cluster, tiny_dir):
    prompt = prompt_of(40, seed=7)
    got = generate(backend(cluster), "local-one", prompt, 1, temperature=0.0, ignore_eos=True)
    assert tokens(got) == reference_tokens(tiny_dir, prompt, 1)
    assert got[-1].finish_reason == "length" and got[-1].completion_tokens == 1


def test_the_prompts_blocks_reach_the_pool_and_the_next_turn_reads_its_prefix_from_there(cluster, tiny_dir):
    shared = prompt_of(320, seed=99)  # 20 blocks of 16
    be = backend(cluster)
    # the earlier tests' prompts are on kv0 too (a 700-token one: 43 blocks): this one's 20 come on top of them
    before = instances(cluster)["kv0"].indexed_blocks
    # a one-token answer: the request ends with its first output, before the write-behind reads the prompt's blocks
    # from the engine, which holds them until it has (RequestOptions.hold; without it they were freed, and the pool
    # never got them)
    first = generate(be, "turn-1", shared + prompt_of(10, seed=1), 1, temperature=0.0, ignore_eos=True)
    assert first[-1].cached_tokens == 0
    deadline = time.monotonic() + 10  # written behind by the decode worker; the Conductor's index hears of it
    while instances(cluster)["kv0"].indexed_blocks < before + 20:
        assert time.monotonic() < deadline, "the decode worker did not write the prompt's blocks to the pool"
        time.sleep(0.1)
    prompt = shared + prompt_of(30, seed=2)
    got = generate(be, "turn-2", prompt, 16, temperature=0.0, ignore_eos=True)
    assert got[-1].cached_tokens == 320 and got[-1].cached_tokens_by_tier == {"remote": 320}
    assert tokens(got) == reference_tokens(tiny_dir, prompt, 16)
    again = generate(be, "turn-2-again", shared, 16, temperature=0.0, ignore_eos=True)  # every block in the pool
    assert again[-1].cached_tokens == 319  # all but the last token, which gives the first output
    assert tokens(again) == reference_tokens(tiny_dir, shared, 16)


def test_mooncake_status_shows_the_prompts_each_decode_worker_computed(cluster):
    console = Console(width=250, record=True)
    console.print(status_table(conductor(cluster).ListInstances(cpb.ListInstancesRequest(), timeout=5)))
    row = next(line for line in console.export_text().splitlines() if "decode-0" in line)
    n = instances(cluster)["decode-0"].decisions
    assert n >= 1 and f"of {n} computed here" in row


@pytest.fixture(scope="module")
def two_decoders(tiny_dir, tmp_path_factory):
    c = start_cluster(
        tiny_dir,
        tmp_path_factory.mktemp("local-chaos"),
        prefill=1,
        decode=2,
        max_model_len=512,
        hold_s=30.0,
        local_prefill="always",
    )
    yield c
    c.stop()


def test_a_decode_worker_killed_while_computing_and_streaming_prompts_loses_no_request(two_decoders):
    """tests/test_chaos.py's replay (60 streamed greedy requests, 6 at a time) with every prompt computed on its
    decode worker, decode-0 SIGKILLed mid-run: every request completes with the undisturbed run's tokens (resumed on
    decode-1, which computes prompt + streamed tokens itself), and the pool comes back to idle."""
    expected, idle = undisturbed_run(two_decoders)
    assert instances(two_decoders)["prefill-0"].decisions == 0  # no prefill worker was used
    outputs, errors, recoveries = replay(two_decoders, "decode-0")
    assert errors == {}, f"{len(errors)} requests failed after decode-0 was killed"
    assert outputs == expected
    assert any(r.resumes for r in recoveries), recoveries
    wait_restarted(two_decoders, "decode-0")
    assert wait_idle(two_decoders, idle, 40) == idle


def test_under_auto_an_idle_cluster_computes_short_turns_on_the_decode_worker_with_one_engines_tokens(
    tiny_dir, tmp_path
):
    c = start_cluster(tiny_dir, tmp_path, prefill=1, decode=1, local_prefill="auto")
    try:
        be = backend(c)
        for i in range(
            4
        ):  # (the first goes through the prefill worker: no hand-off is measured yet, so nothing to save)
            prompt = prompt_of(24, seed=200 + i)
            got = generate(be, f"auto-{i}", prompt, 8, temperature=0.0, ignore_eos=True)
            assert tokens(got) == reference_tokens(tiny_dir, prompt, 8)
        assert instances(c)["decode-0"].decisions >= 1, "auto never computed a short prompt on the idle decode worker"
    finally:
        c.stop()
