"""A pool narrower than the engines' caches (``--pool-kv-dtype fp8``): float32 engines, the pool's blocks in float8
e4m3 at scale 1.0, converted as blocks go into the pool and out of it.

A block in the pool is a quarter of the cache's bytes (the pool nodes are sized so and the Conductor learns it); its
keys are their own (a block of this pool is never read as another configuration's). Disaggregated, a cold request
gives one float32 engine alone's tokens (nothing passed through the pool); a warm one, whose prompt prefix comes back
from the pool in FP8, gives the tokens of one engine alone continuing from that prefix rounded to e4m3 (the prefix
KV exported, rounded, imported: ``rounded_tokens``).
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import pytest
import torch
from clusters import (
    MAX_LEN,
    backend,
    conductor,
    generate,
    instances,
    prefill_metric,
    reference_tokens,
    start_cluster,
    tokens,
)
from conftest import make_engine, run_to_completion
from prometheus_client import generate_latest
from rich.console import Console

from mooncake.cli.pool_cmd import status_table
from mooncake.engine import SamplingParams
from mooncake.engine.blockcopy import copy_blocks
from mooncake.engine.config import EngineConfig
from mooncake.engine.engine import LLMEngine
from mooncake.engine.interface import EngineKind, flags_fingerprint
from mooncake.engine.request import PromptKV, RequestOptions
from mooncake.engine.tiny import make_tiny
from protos import conductor_pb2 as cpb


def test_a_block_copy_between_a_float_cache_and_an_fp8_pool_rounds_to_e4m3_and_saturates():
    cache = torch.tensor([[0.1, -3.3, 500.0, -1e4], [1e-3, 2.0, 448.0, 7.7]]).view(2, 4)
    pool = torch.zeros(3, 4, dtype=torch.float8_e4m3fn)
    copy_blocks(pool, [2, 0], cache, [0, 1])
    assert pool[2].float().tolist() == cache[0].to(torch.float8_e4m3fn).float().tolist()
    assert pool[2].float()[2:].tolist() == [448.0, -448.0]  # beyond e4m3's range: its largest value, not NaN
    back = torch.zeros(2, 4)
    copy_blocks(back, [1, 0], pool, [2, 0])  # and back: exact (every e4m3 value is a float32)
    assert back[1].tolist() == pool[2].float().tolist() and back[0].tolist() == pool[0].float().tolist()


def test_the_pool_keeps_a_quarter_of_the_bytes_under_keys_of_its_own(tiny_dir):
    full = make_engine(tiny_dir)
    narrow = make_engine(tiny_dir, pool_kv_dtype="fp8")
    assert narrow.block_bytes == full.block_bytes  # the engine's cache, and the hand-off, stay float32
    assert narrow.pool_block_bytes * 4 == full.pool_block_bytes == full.block_bytes
    fingerprints = {
        flags_fingerprint(EngineKind.NATIVE, str(tiny_dir), "float32", kv, pool)
        for kv, pool in (("auto", "auto"), ("fp8", "auto"), ("auto", "fp8"))
    }
    assert len(fingerprints) == 3  # an FP8 cache's scaled blocks and this pool's unit-scale ones never mix
    assert narrow.fingerprint == flags_fingerprint(EngineKind.NATIVE, str(tiny_dir), "float32", "auto", "fp8")
    rid = narrow.add_request(list(range(5, 40)), SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    for _ in range(2):
        narrow.step()
    keys, kv, _ = narrow.computed_blocks(rid, 0)  # what a decode worker writes behind into the pool
    assert len(keys) == kv.shape[0] > 0 and kv.dtype == torch.float8_e4m3fn


def test_an_fp8_cache_and_an_fp8_pool_are_not_both_asked_for():
    with pytest.raises(ValueError, match="the pool keeps what an fp8 cache keeps"):
        EngineConfig(model="m", kv_cache_dtype="fp8", pool_kv_dtype="fp8")


def engine(model: Path) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model), block_size=16, num_kv_blocks=512, max_model_len=MAX_LEN))


def rounded_tokens(model: Path, prompt: list[int], max_tokens: int, prefix_blocks: int | None = None) -> list[int]:
    """One float32 engine going on from KV another computed, rounded to e4m3: the first ``prefix_blocks`` blocks' (as
    the pool gives a prefix back; the rest of the prompt computed), or (None) the whole prompt's with its first token
    (as a narrow hand-off lands them)."""
    first = engine(model)
    rid = first.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    while not (so_far := list(first.scheduler.requests[rid].output_token_ids)):
        first.step()
    blocks = -(-len(prompt) // 16) if prefix_blocks is None else prefix_blocks
    rounded = first.export_kv(first.request_block_ids(rid)[:blocks]).to(torch.float8_e4m3fn).float()
    whole = prefix_blocks is None
    second = engine(model)
    out = second.add_request(
        prompt,
        SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
        kv=PromptKV(len(prompt) if whole else blocks * 16, rounded),
        options=RequestOptions(outputs=tuple(so_far) if whole else ()),
    )
    return list(run_to_completion(second)[out].output_token_ids)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("model") / "llama", "llama")


def test_disaggregated_with_an_fp8_pool_cold_is_one_engine_and_warm_is_one_engine_from_the_rounded_prefix(
    model, tmp_path
):
    cluster = start_cluster(model, tmp_path, pool_kv_dtype="fp8", gateway=False, threads=1)
    try:
        config = json.loads((model / "config.json").read_text())
        rng = random.Random(7)
        prompt = [rng.randrange(10, config["vocab_size"]) for _ in range(70)]
        cold_reference = reference_tokens(model, prompt, 12)
        warm_reference = rounded_tokens(model, prompt, 12, prefix_blocks=4)
        assert warm_reference != cold_reference  # (the rounding changes this tiny model's tokens: the test can fail)
        be = backend(cluster)
        cold = generate(be, "pool-cold", prompt, 12, temperature=0.0, ignore_eos=True)
        assert tokens(cold) == cold_reference and cold[-1].cached_tokens == 0
        deadline = time.monotonic() + 10  # the prompt's blocks reach the pool after the answer (a background write)
        for attempt in range(100):
            warm = generate(be, f"pool-warm-{attempt}", prompt, 12, temperature=0.0, ignore_eos=True)
            if warm[-1].cached_tokens or time.monotonic() > deadline:
                break
            assert tokens(warm) == cold_reference
            time.sleep(0.3)
        assert warm[-1].cached_tokens == 64  # four whole blocks of 16, read back from the pool in FP8
        assert tokens(warm) == warm_reference
        # the pool nodes were sized in FP8 blocks, and the workers registered that layout (the Conductor refuses a
        # worker whose blocks differ from the pool nodes': the cluster would not have started)
        assert cluster.config.block_bytes() * 4 == make_engine(model, block_size=16).block_bytes
        console = Console(record=True, width=250)  # `mooncake status`: what the caches and the pool keep KV in
        console.print(status_table(conductor(cluster).ListInstances(cpb.ListInstancesRequest(), timeout=5)))
        assert "KV: 16-token blocks in float32, in the pool fp8 (float8 e4m3)" in console.export_text()
    finally:
        cluster.stop()


def test_a_decode_worker_writes_its_blocks_behind_in_fp8_and_reads_a_prefix_back_from_the_pool(model, tmp_path):
    """The Conductor's local placement (``--local-prefill always``): the decode worker computes each prompt, writes
    its blocks behind into the pool (converted to FP8), and the next turn's prefix comes back from there."""
    cluster = start_cluster(model, tmp_path, pool_kv_dtype="fp8", local_prefill="always", gateway=False, threads=1)
    try:
        rng = random.Random(15)  # a prompt whose tokens the rounded prefix changes
        shared = [rng.randrange(10, 440) for _ in range(160)]  # 10 blocks of 16
        be = backend(cluster)
        # (one token: the request ends before its write-behind reads its blocks, which the engine holds until then)
        first = generate(be, "turn-1", shared + [7, 8, 9], 1, temperature=0.0, ignore_eos=True)
        assert first[-1].cached_tokens == 0
        deadline = time.monotonic() + 10  # written behind by the decode worker; the Conductor's index hears of it
        while instances(cluster)["kv0"].indexed_blocks < 10:
            assert time.monotonic() < deadline, "the decode worker did not write the prompt's blocks to the pool"
            time.sleep(0.1)
        prompt = shared + [rng.randrange(10, 440) for _ in range(20)]
        got = generate(be, "turn-2", prompt, 12, temperature=0.0, ignore_eos=True)
        assert got[-1].cached_tokens == 160 and got[-1].cached_tokens_by_tier == {"remote": 160}
        assert tokens(got) == rounded_tokens(model, prompt, 12, prefix_blocks=10)
        assert tokens(got) != reference_tokens(model, prompt, 12)  # (the rounding shows: the test can fail)
    finally:
        cluster.stop()


def test_a_narrow_hand_off_lands_in_fp8_slots_and_gives_one_engine_from_the_rounded_prompt(model, tmp_path):
    """``--narrow-handoff always``: the prefill worker converts each layer's blocks to FP8 and writes them into the
    decode worker's narrow landing slots, which it converts back as the request joins its engine (between hosts the
    Conductor chooses this where it is predicted sooner; on one host it never would)."""
    cluster = start_cluster(model, tmp_path, pool_kv_dtype="fp8", narrow_handoff="always", gateway=False, threads=1)
    try:
        rng = random.Random(4)  # a prompt whose tokens the rounding changes
        prompt = [rng.randrange(10, 440) for _ in range(70)]  # four whole blocks and a partial one
        want = rounded_tokens(model, prompt, 12)
        assert want != reference_tokens(model, prompt, 12)  # (the rounding shows: the test can fail)
        got = generate(backend(cluster), "narrow", prompt, 12, temperature=0.0, ignore_eos=True)
        assert got[-1].cached_tokens == 0 and tokens(got) == want
    finally:
        cluster.stop()


def test_between_hosts_on_a_slow_link_the_conductor_learns_it_from_a_hand_off_and_moves_the_next_one_narrow(
    tmp_path,
):
    """Two network hosts joined at 40 Mbit/s, ``--narrow-handoff auto`` (the default): the Conductor starts from its
    10 GB/s guess, so the first hand-off moves full width; the prefill worker measures that push across the link and
    reports it, and the next request's prompt moves in FP8 (a quarter of the bytes), with the tokens of one engine
    continuing from the rounded prompt KV."""
    from mooncake.cluster.netns import VirtualNetwork

    if not VirtualNetwork.available():
        pytest.skip("network namespaces need root and iproute2")
    # 128 KiB blocks of float32 KV (4 layers, 4 heads of 64): a 150-token prompt pushes 10 of them (1.25 MiB)
    model = make_tiny(
        tmp_path / "wide", "llama", num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, head_dim=64
    )
    cluster = start_cluster(
        model, tmp_path / "run", pool_kv_dtype="fp8", network_hosts=True, link_mbit=40, gateway=False, threads=1
    )
    try:
        rng = random.Random(21)
        first, second = ([rng.randrange(10, 440) for _ in range(150)] for _ in range(2))
        be = backend(cluster)
        got = generate(be, "full-width", first, 12, temperature=0.0, ignore_eos=True)
        assert tokens(got) == reference_tokens(model, first, 12)  # (moved at full width: exact)
        metric = lambda name: prefill_metric(cluster, name, worker="conductor")  # noqa: E731
        assert metric("mooncake_conductor_narrow_handoffs_total") == 0
        deadline = time.monotonic() + 10  # the prefill worker's report of the push reaches the Conductor
        while (rate := metric("mooncake_conductor_transfer_bytes_per_second")) > 0.1e9:
            assert time.monotonic() < deadline, f"the Conductor still takes the link for {rate / 1e6:.0f} MB/s"
            time.sleep(0.2)
        assert 1e6 < rate < 10e6  # the link's 5 MB/s, give or take its latency and the shaper's burst
        want = rounded_tokens(model, second, 12)
        assert want != reference_tokens(model, second, 12)  # (the rounding shows: the test can fail)
        got = generate(be, "narrow", second, 12, temperature=0.0, ignore_eos=True)
        assert tokens(got) == want and metric("mooncake_conductor_narrow_handoffs_total") == 1
    finally:
        cluster.stop()


def test_a_hand_off_asked_narrow_moves_full_width_where_every_narrow_landing_slot_is_held(model, shm_dir):
    """Narrow landing slots are held from a request's admission until its prefill ends (queued prompts hold them):
    where they run out, the decode worker lands the prompt full width (the prefill worker is told by the landing's
    block size) rather than turning the request away, and counts it."""
    import queue
    import uuid

    from decode.config import DecodeConfig
    from decode.server import DecodeMetrics
    from decode.worker import DecodeWorker

    worker = DecodeWorker(
        DecodeConfig(
            id=f"decode-{uuid.uuid4().hex[:6]}",
            model=str(model),
            block_size=16,
            num_kv_blocks=32,
            max_model_len=256,
            landing_slots=4,
            pool_kv_dtype="fp8",
            write_behind=False,
            shm_dir=shm_dir,
        )
    )
    try:
        handoff, sink = worker.handoff, queue.Queue()
        params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        assert handoff.narrow.slots.num_free == 16  # the 4 landing slots' bytes, in blocks a quarter the size
        first = handoff.admit("first", list(range(10, 200)), params, [], None, "10.0.0.9:1", sink.put, narrow=True)
        assert first.narrow and len(first.slots) == 12  # 190 tokens: 12 of the 16 narrow slots
        assert handoff._landing_pb(first, "t").block_bytes == worker.engine.pool_block_bytes  # the prefill narrows
        then = handoff.admit("then", list(range(10, 80)), params, [], None, "10.0.0.9:1", sink.put, narrow=True)
        assert not then.narrow  # 5 blocks, 4 narrow slots free: full width, in the engine's own blocks
        assert handoff._landing_pb(then, "t").block_bytes == worker.block_bytes
        text = generate_latest(DecodeMetrics(worker).registry).decode()
        assert 'mooncake_decode_narrow_handoffs{landed="narrow"} 1.0' in text
        assert 'mooncake_decode_narrow_handoffs{landed="full"} 1.0' in text
        handoff.release(first)
        assert handoff.narrow.slots.num_free == 16
    finally:
        worker.close()


@pytest.mark.parametrize(
    ("mode", "bytes_per_s", "same_host", "pool", "narrow"),
    [
        ("auto", 0.1e9, False, "float8_e4m3fn", True),  # a slow link between hosts: a quarter of the bytes is sooner
        ("auto", 10e9, False, "float8_e4m3fn", False),  # a fast one: converting both ways costs more than it saves
        ("auto", 0.1e9, True, "float8_e4m3fn", False),  # one host: the decode engine's cache is written in place
        ("auto", 0.1e9, False, "", False),  # a pool as wide as the caches: nothing narrower to move
        ("always", 10e9, True, "float8_e4m3fn", True),
        ("never", 0.1e9, False, "float8_e4m3fn", False),
    ],
)
def test_the_conductor_moves_a_hand_off_narrow_where_it_is_predicted_sooner(mode, bytes_per_s, same_host, pool, narrow):
    from conductor_helpers import conductor, decode, prefill, request

    c = conductor("early_predictive", narrow_handoff=mode)
    c.predictors.transfer.bytes_per_s = bytes_per_s  # as learnt from the pool's prefix fetches
    p, d = prefill(0), decode(0)
    d.kv_dtype, d.pool_kv_dtype = "float32", pool
    if same_host:
        d.address = p.address.rpartition(":")[0] + ":7001"
    c.register(p, 0.0)
    c.register(d, 0.0)
    placed = c.schedule(request(blocks=20), 0.0)
    assert placed.narrow is narrow


def test_a_link_limit_needs_network_hosts(tiny_dir):
    from pydantic import ValidationError

    from mooncake.cluster.config import ClusterConfig

    with pytest.raises(ValidationError, match="--link-mbit shapes the links of network hosts"):
        ClusterConfig(model=str(tiny_dir), model_name="tiny", link_mbit=200)
