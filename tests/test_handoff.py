"""The prefill-to-decode hand-off into the decode engine's own cache, at three levels.

    engine      a second engine admits a request waiting for its KV (``kv=PromptKV.landing(n)``: it gives it blocks),
                finds the prompt's KV written into them from outside, and decodes from there once the
                prefill's token lands (``land``): the tokens of one engine alone, with only the new token computed;
                preempted, it recomputes and still gives them
    connector   a prefill's PoolConnector writes the prompt's KV straight into those blocks of the other engine's
                cache (a shared-memory segment): through the transfer engine (a slice per run of consecutive
                blocks), mapped (tensor copies), through host staging, and by device copies (``mapped_cache``,
                a CUDA cache's path run on the CPU); the granted blocks equal the prefill's own, byte for byte,
                the others stay zero; with ``store_later`` the pool slots get the blocks after the answer; over
                tcp (another host) the decode worker's transfer server lets in only the granted blocks; a
                prefill worker on the decode worker's host maps its cache, and a warm prefix goes from the pool
                slots straight into it
    cluster     a real LocalCluster: disaggregated greedy tokens equal one engine's, the hand-off is counted as
                path="cache" (not "slots"), and the same prompt again is served from the pool

Tiny random-weight llama (conftest), block size 8 in-process and 16 in the cluster, all on the CPU.
"""

from __future__ import annotations

import time
import uuid

import pytest
import torch
from clusters import backend, generate, prefill_metric, reference_tokens, start_cluster, tokens
from conftest import RecordingConnector, make_engine

from mooncake.blocks import blocks_for
from mooncake.engine import EngineConfig, LLMEngine
from mooncake.engine.request import PromptKV, SamplingParams
from mooncake.engine.scheduler import NoRoom
from mooncake.serving.reports import InFlight
from prefill.connector import PoolConnector, PrefillJob
from transfer import TransferConfig, TransferEngine

BS = 8  # make_engine's block size
MAX_TOKENS = 10


def greedy(max_tokens: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def prompt_of(n: int, seed: int) -> list[int]:
    return [(seed * 31 + 7 * i) % 280 + 10 for i in range(n)]


def alone(model_dir, prompt: list[int], max_tokens: int = MAX_TOKENS) -> list[int]:
    """Greedy tokens of one engine computing the whole prompt itself (the bar for every hand-off)."""
    return list(make_engine(model_dir).generate([prompt], greedy(max_tokens))[0].output_token_ids)


def prefilled(model_dir, prompt: list[int]) -> tuple[int, torch.Tensor]:
    """Prefill ``prompt`` on an engine of its own, up to its first token: (that token, the prompt's KV in the pool
    layout [n, L, 2, bs, Hkv, D], read from the engine's cache blocks while the request still holds them)."""
    engine = make_engine(model_dir)
    rid = engine.add_request(prompt, greedy())
    first = None
    while first is None:
        for out in engine.step():
            first = out.output_token_ids[0]
    return first, engine.export_kv(engine.request_block_ids(rid)[: blocks_for(len(prompt), BS)])


def mapped_job(rid: str, prompt: list[int], cache: torch.Tensor, first: int, **kw) -> PrefillJob:
    """A prefill of ``prompt`` landing in blocks ``first``.. of ``cache``, a decode engine's cache mapped here."""
    n = blocks_for(len(prompt), BS)
    return PrefillJob(
        rid,
        len(prompt),
        n,
        "unused",
        [],
        landing_blocks=list(range(first, first + n)),
        landing_num_blocks=cache.shape[2],
        mapped_cache=cache,
        **kw,
    )


def landing(engine: LLMEngine, prompt: list[int], rid: str, max_tokens: int = MAX_TOKENS) -> list[int]:
    """A request waiting for the KV of ``prompt`` from outside: the blocks the engine gave it."""
    engine.add_request(prompt, greedy(max_tokens), request_id=rid, kv=PromptKV.landing(len(prompt)))
    return engine.request_block_ids(rid)


def free_in_order(engine: LLMEngine, first: list[int]) -> None:
    """Have the engine hand out ``first`` next, in that order (the pool gives out its empty blocks front first)."""
    taken = [b.block_id for b in engine.pool.allocate(engine.pool.num_free_blocks)]
    engine.pool.free(first + [b for b in taken if b not in first])


def finish(engine: LLMEngine) -> dict:
    final = {}
    for _ in range(500):
        if not engine.has_unfinished():
            break
        final.update({o.request_id: o for o in engine.step() if o.finished})
    return final


def land(engine: LLMEngine, block_ids: list[int], kv: torch.Tensor) -> None:
    """Write pool-layout KV [n, L, 2, bs, Hkv, D] into ``block_ids`` of the engine's cache, from outside the engine
    (as a prefill worker writes a decode worker's cache)."""
    engine.runner.kv_cache.index_copy_(2, torch.tensor(block_ids), kv.permute(1, 2, 0, 3, 4, 5))


# -- the engine: reserved blocks, landed KV ---------------------------------------------------------------------


def test_a_request_on_landed_blocks_decodes_one_engines_tokens_computing_only_the_new_token(tiny_llama):
    prompt = prompt_of(21, seed=1)  # 3 blocks, the last partial
    reference = alone(tiny_llama.path, prompt)
    first, kv = prefilled(tiny_llama.path, prompt)
    assert first == reference[0]

    recorder = RecordingConnector(keep_kv=False)
    engine = make_engine(tiny_llama.path, connector=recorder)
    landing(engine, prompt_of(9, seed=7), "pad")  # 2 blocks: the landing blocks are not the prefill engine's block ids
    blocks = landing(engine, prompt, "landed")
    assert len(blocks) == 3 and not engine.has_unfinished()  # waiting for its KV: nothing to step
    land(engine, blocks, kv)
    out = engine.land("landed", first)  # the prefill's token goes out as a sampled one
    assert out.new_token_ids == [first] and not out.finished
    final = finish(engine)
    assert final["landed"].output_token_ids == reference
    # its first step computes the one token after the landed prompt, nothing of the prompt
    assert recorder.tokens_computed("landed")[0] == (len(prompt), 1)
    assert engine.num_landing_blocks == 2  # "pad" still waits; the landed request's blocks were freed with it


def test_garbage_in_the_landed_blocks_shows_in_the_tokens(tiny_llama):
    """The engine really attends the landed blocks: the same request on zeroed blocks decodes other tokens (so the
    equality above is not an engine quietly recomputing the prompt)."""
    prompt = prompt_of(21, seed=1)
    first, kv = prefilled(tiny_llama.path, prompt)
    engine = make_engine(tiny_llama.path)
    blocks = landing(engine, prompt, "r")
    land(engine, blocks, torch.zeros_like(kv))
    engine.land("r", first)
    assert finish(engine)["r"].output_token_ids != alone(tiny_llama.path, prompt)


def test_a_preempted_landed_request_recomputes_its_prompt_and_still_gives_one_engines_tokens(tiny_llama):
    prompt, other = prompt_of(21, seed=1), prompt_of(21, seed=2)
    max_tokens = 20  # each grows to 41 tokens, 6 blocks: two do not fit 8 blocks together
    reference = alone(tiny_llama.path, prompt, max_tokens)
    first, kv = prefilled(tiny_llama.path, prompt)
    engine = make_engine(tiny_llama.path, num_kv_blocks=8)
    blocks = landing(engine, prompt, "landed", max_tokens)
    land(engine, blocks, kv)
    engine.add_request(other, greedy(max_tokens), request_id="other")  # ahead in the batch: the landed one is preempted
    engine.land("landed", first)
    final = finish(engine)
    assert engine.scheduler.num_preemptions > 0
    assert final["landed"].output_token_ids == reference
    assert final["other"].output_token_ids == alone(tiny_llama.path, other, max_tokens)
    assert engine.num_free_blocks == 8 and engine.num_landing_blocks == 0


def test_a_landing_request_holds_its_blocks_from_admission_and_gives_them_back_however_it_ends(tiny_llama):
    engine = make_engine(tiny_llama.path, num_kv_blocks=16)
    prompt = prompt_of(21, seed=3)  # 3 blocks
    blocks = landing(engine, prompt, "a")
    assert len(set(blocks)) == 3 and engine.num_free_blocks == 13 and engine.num_landing_blocks == 3
    with pytest.raises(NoRoom):  # 14 blocks with 13 free: all or nothing
        landing(engine, prompt_of(110, seed=4), "big")
    with pytest.raises(ValueError):  # remote KV covers the whole sequence
        engine.add_request(prompt, greedy(), request_id="b", kv=PromptKV.landing(20))
    assert engine.num_free_blocks == 13 and engine.num_landing_blocks == 3  # a refused request takes nothing
    landing(engine, prompt, "b")
    assert engine.abort_request("b") and engine.land("b", 5) is None  # aborted: its blocks are back, nothing lands
    assert engine.num_free_blocks == 13 and engine.num_landing_blocks == 3
    assert engine.load() == (0, 0)  # a request waiting for its KV is not running
    engine.land("a", 5)
    assert engine.num_landing_blocks == 0 and engine.load() == (1, 22)
    finish(engine)
    assert engine.num_free_blocks == 16


@pytest.mark.parametrize("case", ["eos", "stop-token", "length", "goes-on"])
def test_the_prefills_token_is_checked_as_any_sampled_token(tiny_llama, case):
    """The first token lands through the engine's output path: an EOS, a stop token or max_tokens end the request there,
    as they would for any later token (a stop string it completes: the one detokenizer, tests/test_output_text.py)."""
    prompt = prompt_of(21, seed=1)
    first, kv = prefilled(tiny_llama.path, prompt)
    engine = make_engine(tiny_llama.path)
    params = {
        "eos": SamplingParams(temperature=0, max_tokens=MAX_TOKENS),
        "stop-token": SamplingParams(temperature=0, max_tokens=MAX_TOKENS, stop_token_ids=(first,)),
        "length": greedy(1),
        "goes-on": greedy(),
    }[case]
    if case == "eos":
        engine.eos_token_ids = frozenset({first})
    engine.add_request(prompt, params, request_id="r", kv=PromptKV.landing(len(prompt)))
    land(engine, engine.request_block_ids("r"), kv)
    out = engine.land("r", first)
    expected = {"eos": ("stop", first), "stop-token": ("stop", first), "length": ("length", None)}.get(case)
    if expected is None:
        assert not out.finished and engine.has_unfinished()
        return
    assert out.finished and (out.finish_reason.value, out.stop_reason) == expected
    assert out.output_token_ids == [first] and not engine.has_unfinished()
    assert engine.num_free_blocks == engine.pool.num_blocks


# -- the connector: a prefill writing straight into another engine's cache ---------------------------------------


class _TableConnector(PoolConnector):
    """Remembers each request's block table (the engine lets the blocks go when the request ends; they keep their
    KV)."""

    def start_step(self, step) -> None:
        super().start_step(step)
        self.tables = getattr(self, "tables", {}) | {r.request_id: list(r.block_ids) for r in step.requests}


@pytest.mark.parametrize("store_later", [False, True], ids=["pool-inline", "pool-later"])
@pytest.mark.parametrize("path", ["in-place", "mapped", "staged", "staged-runs", "device-copy"])
def test_a_prefill_writes_the_prompt_into_the_granted_blocks_of_the_decode_cache(tiny_llama, path, store_later):
    prompt = prompt_of(37, seed=4)  # 5 blocks, the last partial; 3 engine steps of 16 tokens
    n = blocks_for(len(prompt), BS)
    decode_node = TransferEngine(TransferConfig(node=f"decode-{uuid.uuid4().hex[:6]}", serve=False))
    prefill_node = TransferEngine(TransferConfig(node=f"prefill-{uuid.uuid4().hex[:6]}", serve=False))
    segments = []

    def in_shared_memory(nbytes: int):
        segments.append(decode_node.allocate("kvcache", nbytes))
        return decode_node.buffer(segments[0].name)

    try:
        decode = LLMEngine(
            EngineConfig(
                model=str(tiny_llama.path), block_size=BS, num_kv_blocks=16, max_num_batched_tokens=32, dtype="float32"
            ),
            kv_cache_buffer=in_shared_memory,
        )
        cache = decode.runner.kv_cache
        assert cache.data_ptr() == torch.frombuffer(decode_node.buffer(segments[0].name), dtype=torch.uint8).data_ptr()
        # out of order, and not the prefill engine's block ids; or consecutive (one slice per K or V of a layer)
        landing_blocks = list(range(2, 7)) if path == "staged-runs" else [8, 3, 6, 1, 5]
        prefill_node.add_segment(segments[0])

        connector = _TableConnector(prefill_node, None, BS, io_timeout_s=30)
        prefill = make_engine(tiny_llama.path, connector=connector, max_num_batched_tokens=16, num_kv_blocks=32)
        connector.bind(prefill.runner.kv_cache, staged=path in ("staged", "staged-runs", "device-copy"))
        lengths = []
        write = prefill_node.write
        prefill_node.write = lambda local, slices: lengths.extend(x.length for x in slices) or write(local, slices)
        connector.pool = torch.zeros(8, *prefill.block_shape)
        stored = []
        job = PrefillJob(
            "r",
            len(prompt),
            n,
            segments[0].name,
            [],
            pool_slots={0: 5, 2: 1},
            landing_blocks=landing_blocks,
            landing_num_blocks=cache.shape[2],
            mapped_cache=cache if path in ("mapped", "device-copy") else None,
            store_later=store_later,
            on_stored=stored.append,
        )
        connector.jobs["r"] = job
        prefill.add_request(prompt, greedy(1), request_id="r")
        first = [o.output_token_ids[0] for _ in range(10) if prefill.has_unfinished() for o in prefill.step()][0]
        assert job.error is None and job.pushed == n
        assert connector.flush(10)
        half = decode.block_bytes // (2 * decode.block_shape[0])
        if path in ("mapped", "device-copy"):
            assert not lengths  # tensor copies: nothing through the transfer engine
        else:  # a slice per block and K or V; consecutive blocks: a slice per run (3 steps of 2, 2 and 1 blocks)
            assert max(lengths) == (2 * half if path == "staged-runs" else half)

        source = prefill.runner.kv_cache[:, :, connector.tables["r"][:n]]  # [L, 2, n, bs, Hkv, D]
        assert source.abs().sum() > 0
        assert torch.equal(cache[:, :, landing_blocks], source)  # byte for byte, the partial block's zero tail included
        others = [b for b in range(cache.shape[2]) if b not in landing_blocks]
        assert not cache[:, :, others].any()  # nothing outside the grant was written
        # the pool slots got the prompt's blocks 0 and 2 (after the answer when stored later), nothing else
        assert torch.equal(connector.pool[5], source[:, :, 0]) and torch.equal(connector.pool[1], source[:, :, 2])
        assert not connector.pool[[0, 2, 3, 4, 6, 7]].any()
        assert stored == ([True] if store_later else [])
        # blocks kept for the later pool write come back to the prefill engine
        prefill.add_request(prompt_of(5, seed=9), greedy(1))
        while prefill.has_unfinished():
            prefill.step()
        assert prefill.num_free_blocks == 32

        # the decode engine takes the landed blocks as they are and decodes one engine's tokens
        free_in_order(decode, landing_blocks)
        assert landing(decode, prompt, "r") == landing_blocks
        decode.land("r", first)
        assert finish(decode)["r"].output_token_ids == alone(tiny_llama.path, prompt)
        assert decode.num_free_blocks == 16
    finally:
        prefill_node.close()
        decode_node.close()


def test_prompts_batched_together_each_count_their_share_of_the_steps(tiny_llama):
    """What a prefill reports to the TTFT predictors is its own compute: with two prompts in the same steps, each one's
    share of every step (by its tokens), not the whole span, which would count the other prompt's tokens too."""
    node = TransferEngine(TransferConfig(node=f"prefill-{uuid.uuid4().hex[:6]}", serve=False))
    try:
        connector = PoolConnector(node, None, BS, io_timeout_s=30)
        prefill = make_engine(tiny_llama.path, connector=connector, max_num_batched_tokens=48, num_kv_blocks=64)
        connector.bind(prefill.runner.kv_cache)
        cache = torch.zeros_like(prefill.runner.kv_cache)  # a decode cache, mapped (no transfers)
        long, short = prompt_of(120, seed=1), prompt_of(24, seed=2)
        jobs = {}
        for rid, prompt, first in (("long", long, 0), ("short", short, 20)):
            jobs[rid] = connector.jobs[rid] = mapped_job(rid, prompt, cache, first)
            prefill.add_request(prompt, greedy(1), request_id=rid)
        t0 = time.perf_counter()
        while prefill.has_unfinished():
            prefill.step()
        span = time.perf_counter() - t0
        long_s, short_s = jobs["long"].compute_s, jobs["short"].compute_s
        assert 0 < short_s < long_s and long_s + short_s <= span  # shares of the steps, never more than they took
        assert short_s < 0.6 * long_s  # 24 tokens against 120, in the same steps: far less than the whole span
    finally:
        node.close()


class LeftAfter:
    """A caller's cancel event that reads as set from its ``n``-th look on: the moment a client hangs up, placed
    between two layers of a step (a real hang-up lands wherever the step happens to be)."""

    def __init__(self, n: int) -> None:
        self.looks, self.n = 0, n

    def is_set(self) -> bool:
        self.looks += 1
        return self.looks >= self.n


def test_a_step_whose_every_prompt_was_cancelled_stops_at_its_layer_frees_its_blocks_and_caches_nothing(tiny_llama):
    """An abort storm (benchmarks/abort_storm.py): the callers of every prompt in a step hang up while it runs. The
    step stops after the layer it is in: layer 0 reached the decode worker's cache, no later layer did; the engine
    holds nothing and every block is free; nothing half-computed went to the prefix cache (the same prompt again
    computes every token and gives one engine's first token). A step with one prompt still wanted runs whole."""
    node = TransferEngine(TransferConfig(node=f"prefill-{uuid.uuid4().hex[:6]}", serve=False))
    try:
        connector = PoolConnector(node, None, BS, io_timeout_s=30)
        prefill = make_engine(tiny_llama.path, connector=connector, max_num_batched_tokens=128, num_kv_blocks=64)
        connector.bind(prefill.runner.kv_cache)
        free = prefill.num_free_blocks
        cache = torch.zeros_like(prefill.runner.kv_cache)  # a decode cache, mapped (no transfers)
        assert cache.shape[0] >= 2  # a layer after the one the cancel lands in
        a, b = prompt_of(40, seed=1), prompt_of(40, seed=2)

        def submit(rid, prompt, first, cancelled) -> None:
            connector.jobs[rid] = mapped_job(rid, prompt, cache, first, cancelled=cancelled)
            prefill.add_request(prompt, greedy(1), request_id=rid)

        gone = LeftAfter(2)  # not yet at layer 0's push, gone by layer 1's
        submit("a", a, 0, gone)
        submit("b", b, 10, gone)
        assert prefill.step() == []
        assert not prefill.has_unfinished() and prefill.num_free_blocks == free
        assert cache[0].any() and not cache[1:].any()
        connector.jobs.clear()

        submit("a-again", a, 20, None)
        submit("b-gone", b, 30, LeftAfter(1))
        outs = {}
        while prefill.has_unfinished():
            outs.update({o.request_id: o for o in prefill.step()})
        assert outs["a-again"].num_cached_tokens == 0
        assert outs["a-again"].output_token_ids[0] == alone(tiny_llama.path, a, 1)[0]
        assert cache[1:, :, 20 : 20 + blocks_for(len(a), BS)].any()  # every layer landed
    finally:
        node.close()


def test_over_tcp_a_prefill_writes_only_the_cache_blocks_its_grant_names(tiny_dir, shm_dir):
    """From another host a prefill reaches the decode engine's cache through the decode worker's transfer server,
    which lets in only the bytes of blocks granted to a live Prefill call's token (``_cache_guard``)."""
    from decode.config import DecodeConfig
    from decode.worker import DecodeWorker
    from transfer import TransferError

    bs, prompt = 16, prompt_of(37, seed=5)  # 3 blocks, the last partial
    worker = DecodeWorker(
        DecodeConfig(
            id=f"decode-{uuid.uuid4().hex[:6]}",
            model=str(tiny_dir),
            block_size=bs,
            num_kv_blocks=16,
            max_model_len=256,
            landing_slots=4,
            write_behind=False,
            shm_dir=shm_dir,
        )
    )
    sender = TransferEngine(TransferConfig(node=f"prefill-{uuid.uuid4().hex[:6]}", backend="tcp", serve=False))
    try:
        cache = worker.engine.runner.kv_cache
        assert worker.cache_segment is not None and worker.cache.num_blocks == cache.shape[2] == 16
        sender.add_segment(worker.cache_segment)
        reserved = list(range(6))  # the cache is the engine's, but no request holds a block of it here
        granted, outside = reserved[1:4][::-1], reserved[5]
        live = worker.grants.grant(granted)  # as the decode worker grants them for one Prefill call

        connector = _TableConnector(sender, None, bs, io_timeout_s=10)
        prefill = make_engine(tiny_dir, connector=connector, block_size=bs, max_num_batched_tokens=16)
        connector.bind(prefill.runner.kv_cache)

        def push(rid: str, blocks: list[int], token: str) -> PrefillJob:
            job = PrefillJob(
                rid,
                len(prompt),
                3,
                worker.cache_segment.name,
                [],
                landing_token=token,
                landing_blocks=blocks,
                landing_num_blocks=16,
            )
            connector.jobs[rid] = job
            prefill.add_request(prompt, greedy(1), request_id=rid)
            while prefill.has_unfinished():
                prefill.step()
            return job

        job = push("granted", granted, live)
        assert job.error is None and job.pushed == 3
        source = prefill.runner.kv_cache[:, :, connector.tables["granted"][:3]]
        assert source.abs().sum() > 0 and torch.equal(cache[:, :, granted], source)

        assert isinstance(push("one-block-too-far", granted[:2] + [outside], live).error, TransferError)
        assert isinstance(push("no-grant", [outside, reserved[0], reserved[4]], "stale").error, TransferError)
        # blocks consecutive on both sides go as one slice per layer and K or V: one block of it outside the grant
        # refuses the whole slice
        lengths = []
        write = sender.write
        sender.write = lambda local, slices: lengths.extend(s.length for s in slices) or write(local, slices)
        assert isinstance(push("a-run-one-block-too-far", reserved[2:5], live).error, TransferError)
        assert max(lengths) > worker.block_bytes // (2 * cache.shape[0])  # a slice longer than one block's K
        others = [b for b in range(16) if b not in granted]
        assert not cache[:, :, others].any()  # refused writes wrote nothing
        job = push("a-run", reserved[1:4], live)
        assert job.error is None and torch.equal(cache[:, :, reserved[1:4]], source)
    finally:
        sender.close()
        worker.close()


def test_on_one_host_the_decode_cache_is_mapped_and_a_warm_prefix_goes_from_the_pool_straight_into_it(
    tiny_dir, shm_dir
):
    """A prefill worker on the decode worker's host maps the decode engine's CPU cache (its shared-memory segment) and
    writes it with tensor copies, no transfer-engine slices; a prefix found in the pool is copied from the pool slots
    straight into the granted blocks, beside the engine's import, and the engine pushes only the block it computes.
    The warm prompt's blocks equal the cold prompt's, byte for byte, into consecutive and into scattered blocks."""
    import threading

    from kvnodes import start_node

    from kvstore.wire import segment_to_pb
    from protos import conductor_pb2 as cpb
    from protos import worker_pb2 as wpb

    bs, prompt = 16, prompt_of(70, seed=6)  # 5 blocks: 4 full (the pool keeps them), 1 partial
    probe = make_engine(tiny_dir, block_size=bs)
    layers, shape, block_bytes = probe.block_shape[0], probe.block_shape[2:], probe.block_bytes
    node = start_node("kv-mapped", block_bytes, 16, shm_dir=shm_dir)
    decode_node = TransferEngine(TransferConfig(node=f"decode-{uuid.uuid4().hex[:6]}", shm_dir=shm_dir, serve=False))
    worker = None
    try:
        segment = decode_node.allocate("kvcache", 24 * block_bytes)
        cache = torch.frombuffer(decode_node.buffer(segment.name), dtype=torch.float32).view(layers, 2, 24, *shape)
        worker = prefill_worker(tiny_dir, node.grpc, bs)
        copies = []
        copy_prefix = worker._copy_prefix
        worker._copy_prefix = lambda job, local, cached: copies.append(len(local)) or copy_prefix(job, local, cached)

        def prefill(rid: str, blocks: list[int], local_blocks: int, num_output_tokens: int = 0):
            req = wpb.PrefillRequest(
                request_id=rid,
                prompt_token_ids=prompt,
                num_output_tokens=num_output_tokens,
                sampling=wpb.Sampling(max_tokens=1 + num_output_tokens, temperature=0.0, ignore_eos=True),
                plan=cpb.PrefixPlan(local_blocks=local_blocks),
                landing=wpb.Landing(
                    segment=segment_to_pb(segment), cache_blocks=blocks, cache_num_blocks=24, block_bytes=block_bytes
                ),
            )
            resp = worker.prefill(req, threading.Event())
            assert worker.flush_pool_writes(10)
            return resp

        cold_blocks = [2, 3, 4, 5, 6]
        cold = prefill("cold", cold_blocks, 0)
        assert cold.cached_tokens == 0 and cache[:, :, cold_blocks].abs().sum() > 0
        reference = prefilled_tokens_kv(tiny_dir, prompt)
        got = cache[:, :, cold_blocks].flatten(2, 3)[:, :, : len(prompt)]  # [L, 2, tokens, Hkv, D]
        assert torch.allclose(got, reference, atol=1e-5)
        for blocks in ([10, 11, 12, 13, 20], [19, 7, 15, 1, 22]):  # one run of four; no run at all
            warm = prefill(f"warm-{blocks[0]}", blocks, 5)
            assert warm.cached_tokens == 64 and warm.first_token == cold.first_token
            assert torch.equal(cache[:, :, blocks[:4]], cache[:, :, cold_blocks[:4]])  # from the pool, byte for byte
            # the last block: the engine's (its first 5 tokens computed again, from the same prefix)
            assert torch.allclose(cache[:, :, blocks[4]], cache[:, :, cold_blocks[4]], atol=1e-5)
        assert copies[-2:] == [4, 4]
        # a resumed stream (its last token generated) whose plan says nothing is held, as the Conductor's index had not
        # heard of the commit yet: the node's 4 blocks are loaded all the same; a new prompt keeps to its plan
        lagging = prefill("the-index-lags", [14, 16, 17, 18, 21], 0, num_output_tokens=1)
        assert lagging.cached_tokens == 64 and lagging.first_token == cold.first_token
        assert prefill("a-new-prompt", [14, 16, 17, 18, 21], 0).cached_tokens == 0
        written = set(cold_blocks) | {10, 11, 12, 13, 20, 19, 7, 15, 1, 22, 14, 16, 17, 18, 21}
        assert not cache[:, :, [b for b in range(24) if b not in written]].any()  # nothing outside the grants
        assert ("shm", "write") not in worker.transfer.moved()  # tensor copies only: no slices through the engine

        # the queue a prefill worker reports is its prompts in flight, each with what it has computed so far (the
        # Conductor prices the rest)
        worker._inflight["queued"] = (200, 0)
        assert worker.in_flight() == [InFlight(200, 0)]
        worker.connector.jobs["queued"] = PrefillJob("queued", 200, 13, segment.name, [], issued=10)  # 160 tokens done
        assert worker.in_flight() == [InFlight(200, 160)]
        del worker._inflight["queued"], worker.connector.jobs["queued"]
    finally:
        if worker is not None:
            worker.close()
        decode_node.close()
        node.stop()


def test_a_request_placed_again_on_the_same_prefill_worker_runs_beside_the_call_still_ending_for_it(tiny_dir, shm_dir):
    """A request whose decode host was cut off is placed again, and its retry can reach the prefill worker while the
    first call for it is still there (its caller gone unseen). The two calls share a request id; each runs in the
    engine under one of its own, so the retry is not refused as a duplicate, and the first call's abort cannot take
    the retry's place. Here the engine's loop is held until both are in, then the first call's caller leaves."""
    import threading

    from kvnodes import start_node

    from kvstore.wire import segment_to_pb
    from prefill.worker import Cancelled
    from protos import conductor_pb2 as cpb
    from protos import worker_pb2 as wpb

    bs, prompt = 16, prompt_of(40, seed=8)  # 3 blocks
    probe = make_engine(tiny_dir, block_size=bs)
    block_bytes = probe.block_bytes
    node = start_node("kv-twice", block_bytes, 16, shm_dir=shm_dir)
    decode_node = TransferEngine(TransferConfig(node=f"decode-{uuid.uuid4().hex[:6]}", shm_dir=shm_dir, serve=False))
    worker = None
    try:
        segment = decode_node.allocate("kvcache", 8 * block_bytes)
        worker = prefill_worker(tiny_dir, node.grpc, bs)

        def request(blocks: list[int], rid: str = "chaos-28") -> wpb.PrefillRequest:
            return wpb.PrefillRequest(
                request_id=rid,
                prompt_token_ids=prompt,
                sampling=wpb.Sampling(max_tokens=1, temperature=0.0, ignore_eos=True),
                plan=cpb.PrefixPlan(),
                landing=wpb.Landing(
                    segment=segment_to_pb(segment), cache_blocks=blocks, cache_num_blocks=8, block_bytes=block_bytes
                ),
            )

        gate = threading.Event()
        held = worker.loop.call(lambda engine: gate.wait(30))  # the engine takes nothing until both calls are in
        outcome: dict[str, object] = {}
        first_gone = threading.Event()

        def call(name: str, blocks: list[int], cancelled: threading.Event) -> None:
            try:
                outcome[name] = worker.prefill(request(blocks), cancelled)
            except Exception as e:  # noqa: BLE001 - what each call ended with is the test's
                outcome[name] = e

        first = threading.Thread(target=call, args=("first", [0, 1, 2], first_gone))
        first.start()
        deadline = time.monotonic() + 30
        while not worker.connector.jobs and time.monotonic() < deadline:  # the first call's job is in
            time.sleep(0.01)
        retry = threading.Thread(target=call, args=("retry", [4, 5, 6], threading.Event()))
        retry.start()
        while len(worker.connector.jobs) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        first_gone.set()  # the first call's caller is gone: it aborts its own run
        gate.set()
        held.result(30)
        first.join(60)
        retry.join(60)
        assert isinstance(outcome["first"], Cancelled) or hasattr(outcome["first"], "first_token"), outcome["first"]
        assert hasattr(outcome["retry"], "first_token"), outcome["retry"]  # the retry answered, with its first token
        alone = worker.prefill(request([0, 1, 2], "alone"), threading.Event())
        assert outcome["retry"].first_token == alone.first_token
        assert not worker.connector.jobs and not worker._inflight  # nothing of either call left behind
    finally:
        if worker is not None:
            worker.close()
        decode_node.close()
        node.stop()


def prefill_worker(model_dir, kvstore: str, block_size: int):
    """A prefill worker in this process, on the pool node at ``kvstore``."""
    from prefill.config import PrefillConfig
    from prefill.worker import PrefillWorker

    return PrefillWorker(
        PrefillConfig(
            id=f"prefill-{uuid.uuid4().hex[:6]}",
            model=str(model_dir),
            kvstore=kvstore,
            block_size=block_size,
            num_kv_blocks=32,
            max_model_len=256,
        )
    )


def prefilled_tokens_kv(model_dir, prompt: list[int]) -> torch.Tensor:
    """The prompt's KV computed by one engine alone, token by token: [L, 2, tokens, Hkv, D]."""
    _, kv = prefilled(model_dir, prompt)  # [n, L, 2, bs, Hkv, D]
    return kv.permute(1, 2, 0, 3, 4, 5).flatten(2, 3)[:, :, : len(prompt)]


# -- the cluster ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=["one-host", "two-hosts"])
def cluster(request, tiny_dir, tmp_path_factory):
    """The prefill worker (with its pool node) and the decode worker on one host (the decode cache mapped by the
    prefill) or on two network hosts (written over tcp through the decode worker's segment)."""
    from mooncake.cluster.netns import VirtualNetwork

    two = request.param == "two-hosts"
    if two and not VirtualNetwork.available():
        pytest.skip("network namespaces need root and iproute2")
    c = start_cluster(
        tiny_dir, tmp_path_factory.mktemp("handoff"), prefill=1, decode=1, gateway=False, network_hosts=two
    )
    yield c
    c.stop()


def test_a_disaggregated_request_lands_in_the_decode_cache_and_its_prompt_reaches_the_pool(cluster, tiny_dir):
    import random

    rng = random.Random(11)
    prompt = [rng.randrange(10, 440) for _ in range(100)]  # 7 blocks of 16, the last partial
    reference = reference_tokens(tiny_dir, prompt, 12)
    be = backend(cluster)
    cold = generate(be, "handoff-cold", prompt, 12, temperature=0.0, ignore_eos=True)
    assert tokens(cold) == reference and cold[-1].cached_tokens == 0
    handed = prefill_metric(cluster, 'mooncake_prefill_handoff_bytes_total{path="cache"}')
    assert handed == 7 * cluster.config.block_bytes()  # the whole prompt, into the decode engine's cache
    assert prefill_metric(cluster, 'mooncake_prefill_handoff_bytes_total{path="slots"}') == 0

    # the prompt's full blocks reach the pool after the answer (a background write, then a commit)
    deadline = time.monotonic() + 8
    for attempt in range(100):
        warm = generate(be, f"handoff-warm-{attempt}", prompt, 12, temperature=0.0, ignore_eos=True)
        assert tokens(warm) == reference
        if warm[-1].cached_tokens or time.monotonic() > deadline:
            break
        time.sleep(0.3)
    assert warm[-1].cached_tokens == 96
    assert prefill_metric(cluster, 'mooncake_prefill_handoff_bytes_total{path="slots"}') == 0


def test_blocks_stored_after_the_pool_node_restarted_hold_the_prompts_kv(cluster, tiny_dir):
    """A pool node that restarts serves its DRAM tier from a new shared-memory file; the prefill worker, which wrote
    the old file in place, maps the new one before it stores there. The blocks of a prompt served after the restart,
    read back from the node, are that prompt's KV (written through the old mapping, they would be the new file's
    zeros under the prompt's keys: another request's prefix would read them)."""
    import os
    import random
    import signal

    from replays import wait_restarted

    from mooncake.blocks import block_keys
    from transfer import TransferConfig, TransferEngine

    if cluster.config.network_hosts:
        pytest.skip("one host: the prefill worker maps its pool node's memory the same way on both")
    c = cluster.config
    os.kill(cluster.component("kv0").proc.pid, signal.SIGKILL)
    wait_restarted(cluster, "kv0")
    rng = random.Random(12)
    prompt = [rng.randrange(10, 440) for _ in range(85)]  # 5 full blocks of 16 and a partial one
    reference = reference_tokens(tiny_dir, prompt, 8)
    be = backend(cluster)
    deadline = time.monotonic() + 30
    stored = 0
    while not stored and time.monotonic() < deadline:  # the first prefills after the restart may go without the pool
        got = generate(be, f"after-restart-{rng.random()}", prompt, 8, temperature=0.0, ignore_eos=True)
        assert tokens(got) == reference
        stored = got[-1].cached_tokens
        time.sleep(0.3)
    assert stored == 80  # stored on the new node and loaded from it

    engine = make_engine(tiny_dir, block_size=c.block_size)
    rid = engine.add_request(prompt, greedy())
    while not any(out.output_token_ids for out in engine.step()):
        pass
    want = engine.export_kv(engine.request_block_ids(rid)[:5])  # [5, L, 2, bs, Hkv, D], computed alone
    keys = block_keys(prompt, c.block_size, engine.fingerprint, None)[:5]
    with TransferEngine(TransferConfig(node="test-reader", serve=False)) as reader:
        from kvstore.client import KVStoreClient

        with KVStoreClient(cluster.address("kv0"), engine=reader, control="grpc", timeout_s=5) as kv:
            read = kv.get(keys)
    assert read.num_blocks == 5
    got_kv = torch.frombuffer(bytearray(read.data), dtype=want.dtype).view(want.shape)
    assert got_kv.abs().sum() > 0 and torch.allclose(got_kv, want, atol=1e-4)


def test_while_its_pool_node_is_down_the_prefill_worker_computes_whole_prompts_with_one_engines_tokens(
    cluster, tiny_dir
):
    """A prefill worker whose pool node is gone (killed, not yet back) keeps serving: it computes each prompt whole
    and stores nothing, rather than failing every request it gets until the node returns. With one prefill worker,
    failing them would leave nobody to serve."""
    import random

    kv0 = cluster.component("kv0")
    restarts = kv0.restarts
    kv0.stopping = True  # the supervisor leaves it down until the end of the test
    try:
        kv0.kill()
        rng = random.Random(13)
        be = backend(cluster)
        for i in range(3):
            prompt = [rng.randrange(10, 440) for _ in range(40 + 20 * i)]
            got = generate(be, f"pool-down-{i}", prompt, 6, temperature=0.0, ignore_eos=True)
            assert tokens(got) == reference_tokens(tiny_dir, prompt, 6)
            assert got[-1].cached_tokens == 0
    finally:
        kv0.stopping = False  # the supervisor brings it back
    deadline = time.monotonic() + 60
    while not (kv0.alive and kv0.info and kv0.restarts > restarts):
        assert time.monotonic() < deadline, "kv0 was not restarted"
        time.sleep(0.2)
