"""Greedy output of the engine equals transformers' greedy ``generate``, token for token.

Each case runs on every tiny random-weight architecture and on SmolLM2-135M (slow): one
prompt; continuous batching with requests arriving mid-flight; chunked prefill mixed
with running decodes; prefix-cache reuse; preemption under a tiny KV cache; and KV
exported from one engine and imported into a fresh one. Any divergence that is not a
true tie in the reference's logits fails (see conftest.assert_greedy_close).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from conftest import (
    TINY_ARCHS,
    RecordingConnector,
    assert_greedy_close,
    make_engine,
    reference_greedy,
    run_to_completion,
)

from mooncake.blocks import blocks_for
from mooncake.engine import FinishReason, LLMEngine, SamplingParams
from mooncake.engine.request import PromptKV, RequestOptions


@dataclass
class Subject:
    """A model under test plus the sizes its cases use (tiny models run bigger shapes cheaply)."""

    name: str
    path: Path
    hf: torch.nn.Module
    vocab_size: int
    eos_token_id: int | None
    block_size: int
    chunk: int  # max_num_batched_tokens for the chunked-prefill case
    max_new: int
    short: tuple[int, int]  # prompt length range for batch cases
    long: int  # a prompt several chunks long
    token_range: tuple[int, int]  # ids drawn for random prompts
    preempt: dict  # engine overrides that force preemption
    preempt_prompts: tuple[int, int, int]  # (count, min len, max len)
    preempt_new: int  # tokens each preempted-run request generates
    wave: int  # requests per arrival wave in the continuous-batching case
    reuse_engines: bool = False  # share engines across the module (the big model loads slowly)
    _engines: dict = field(default_factory=dict)

    def engine(self, fresh: bool = False, **overrides) -> tuple[LLMEngine, RecordingConnector]:
        """An engine with a RecordingConnector (records reset); shared per config if reuse_engines."""
        key = tuple(sorted(overrides.items()))
        if self.reuse_engines and not fresh and key in self._engines:
            eng, rec = self._engines[key]
            assert not eng.has_unfinished()
            rec.reset()
            return eng, rec
        rec = RecordingConnector(keep_kv=False)
        cfg = dict(block_size=self.block_size, max_num_batched_tokens=4 * self.chunk, num_kv_blocks=256)
        cfg.update(overrides)
        eng = make_engine(self.path, connector=rec, **cfg)
        if self.reuse_engines and not fresh:
            self._engines[key] = (eng, rec)
        return eng, rec

    def prompt(self, seed: int, length: int) -> list[int]:
        g = torch.Generator().manual_seed(seed)
        lo, hi = self.token_range
        return torch.randint(lo, hi, (length,), generator=g).tolist()

    def prompts(self, seed: int, count: int, lo: int, hi: int) -> list[list[int]]:
        g = torch.Generator().manual_seed(seed + 1000)
        lengths = torch.randint(lo, hi + 1, (count,), generator=g).tolist()
        return [self.prompt(seed * 100 + i, n) for i, n in enumerate(lengths)]


@pytest.fixture(scope="module", params=TINY_ARCHS + [pytest.param("smollm2", marks=pytest.mark.slow)])
def subject(request, tiny_models):
    if request.param == "smollm2":
        model = request.getfixturevalue("smollm2")
        cfg = model.hf.config
        eos = cfg.eos_token_id if isinstance(cfg.eos_token_id, int) else None
        yield Subject(
            name="smollm2",
            path=model.path,
            hf=model.hf,
            vocab_size=model.vocab_size,
            eos_token_id=eos,
            block_size=16,
            chunk=64,
            max_new=16,
            short=(20, 90),
            long=150,
            token_range=(200, 20000),
            preempt=dict(block_size=16, num_kv_blocks=7, max_num_batched_tokens=256),
            preempt_prompts=(3, 40, 44),  # 3 blocks each at admission, a 4th while decoding
            preempt_new=16,
            wave=2,
            reuse_engines=True,
        )
        return
    tiny = tiny_models[request.param]
    yield Subject(
        name=tiny.name,
        path=tiny.path,
        hf=tiny.hf,
        vocab_size=tiny.vocab_size,
        eos_token_id=tiny.eos_token_id,
        block_size=8,
        chunk=16,
        max_new=20,
        short=(3, 40),
        long=90,
        token_range=(3, tiny.vocab_size),
        preempt=dict(block_size=4, num_kv_blocks=16, max_num_batched_tokens=64),
        preempt_prompts=(4, 12, 16),
        preempt_new=24,
        wave=3,
    )


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n)


def check_finish(out, subject: Subject, max_new: int) -> None:
    """A finished greedy request stopped for the reason its tokens show."""
    assert out.finished
    if len(out.output_token_ids) == max_new and out.output_token_ids[-1] != subject.eos_token_id:
        assert out.finish_reason == FinishReason.LENGTH
    else:
        assert out.output_token_ids[-1] == subject.eos_token_id, out.output_token_ids
        assert out.finish_reason == FinishReason.STOP


def test_single_prompt(subject):
    engine, _ = subject.engine()
    prompt = subject.prompt(1, subject.short[1])
    (out,) = engine.generate([prompt], greedy(subject.max_new))
    check_finish(out, subject, subject.max_new)
    assert_greedy_close(out.output_token_ids, subject.hf, prompt, subject.max_new, label=f"{subject.name} single")


def test_continuous_batching_with_late_arrivals(subject):
    engine, rec = subject.engine(max_num_batched_tokens=4 * subject.chunk)
    first = subject.prompts(2, subject.wave, *subject.short)
    later = subject.prompts(3, subject.wave, *subject.short)
    params = greedy(subject.max_new)
    ids_first = [engine.add_request(p, params) for p in first]
    final = {}
    progress = {}
    for _ in range(3):
        for out in engine.step():
            progress[out.request_id] = len(out.output_token_ids)
            if out.finished:
                final[out.request_id] = out
    # The first wave is mid-generation when the second arrives.
    assert any(0 < progress.get(i, 0) < subject.max_new and i not in final for i in ids_first), progress
    ids_later = [engine.add_request(p, params) for p in later]
    final.update(run_to_completion(engine))
    # Some step ran requests of both waves together.
    mixed = [
        s
        for s in rec.steps
        if {r.request_id for r in s.requests} & set(ids_first) and {r.request_id for r in s.requests} & set(ids_later)
    ]
    assert mixed, "the late requests never shared a step with the first wave"
    for rid, prompt in zip(ids_first + ids_later, first + later):
        check_finish(final[rid], subject, subject.max_new)
        assert_greedy_close(
            final[rid].output_token_ids, subject.hf, prompt, subject.max_new, label=f"{subject.name} {rid}"
        )
    assert engine.pool.num_free_blocks == engine.pool.num_blocks


def test_chunked_prefill_mixed_with_decodes(subject):
    chunk = subject.chunk
    engine, rec = subject.engine(max_num_batched_tokens=chunk)
    short = subject.prompt(4, chunk // 2)
    long = subject.prompt(5, subject.long)
    params = greedy(subject.max_new)
    a = engine.add_request(short, params)
    final = {}
    while True:  # until `a` is decoding
        outs = engine.step()
        if any(o.request_id == a for o in outs):
            break
    b = engine.add_request(long, params)
    final.update(run_to_completion(engine))

    assert all(sum(r.num_new_tokens for r in s.requests) <= chunk for s in rec.steps), "token budget exceeded"
    b_chunks = [n for _, n in rec.tokens_computed(b) if n > 1]
    assert sum(b_chunks) == len(long) and len(b_chunks) >= -(-len(long) // chunk), b_chunks
    # While `b` was prefilling in chunks, `a` kept decoding in the same steps.
    shared = [
        s
        for s in rec.steps
        if any(r.request_id == b and r.num_new_tokens > 1 for r in s.requests)
        and any(r.request_id == a and r.num_new_tokens == 1 for r in s.requests)
    ]
    assert len(shared) >= 2, "running decodes were not batched with the prefill chunks"
    assert_greedy_close(final[a].output_token_ids, subject.hf, short, subject.max_new, label=f"{subject.name} decode")
    assert_greedy_close(final[b].output_token_ids, subject.hf, long, subject.max_new, label=f"{subject.name} chunked")


def test_prefix_cache_reuse(subject):
    engine, rec = subject.engine()
    bs = subject.block_size
    shared = subject.prompt(6, 5 * bs)
    p1 = shared + subject.prompt(7, bs - 1)
    p2 = shared + subject.prompt(8, bs + 3)
    assert p1[len(shared)] != p2[len(shared)]
    params = greedy(subject.max_new)
    (o1,) = engine.generate([p1], params)
    hits_before = engine.pool.stats.hit_blocks
    (o2,) = engine.generate([p2], params)

    assert o2.num_cached_tokens == len(shared)
    assert engine.pool.stats.hit_blocks - hits_before == 5
    # Only the tokens past the shared prefix were computed for the second prompt.
    rid2 = rec.steps[-1].requests[0].request_id
    assert rec.tokens_computed(rid2)[0][0] == len(shared)
    assert_greedy_close(o1.output_token_ids, subject.hf, p1, subject.max_new, label=f"{subject.name} prefix-1")
    assert_greedy_close(o2.output_token_ids, subject.hf, p2, subject.max_new, label=f"{subject.name} prefix-2")


def test_preemption_keeps_tokens(subject):
    engine, _ = subject.engine(**subject.preempt)
    count, lo, hi = subject.preempt_prompts
    prompts = subject.prompts(9, count, lo, hi)
    max_new = subject.preempt_new
    params = SamplingParams(temperature=0.0, max_tokens=max_new, ignore_eos=True)
    before = engine.scheduler.num_preemptions
    outs = engine.generate(prompts, params)

    assert engine.scheduler.num_preemptions > before, "the run was meant to preempt"
    assert engine.pool.num_free_blocks == engine.pool.num_blocks
    for out, prompt in zip(outs, prompts):
        assert len(out.output_token_ids) == max_new and out.finish_reason == FinishReason.LENGTH
        ref_len = (
            out.output_token_ids.index(subject.eos_token_id) + 1
            if subject.eos_token_id in out.output_token_ids
            else max_new
        )
        # transformers stops at EOS; compare the part it generates.
        assert_greedy_close(
            out.output_token_ids[:ref_len], subject.hf, prompt, max_new, label=f"{subject.name} preempt"
        )


@pytest.mark.parametrize("where", ["all-computed", "mid-block"])
def test_kv_export_import_continues_exactly(subject, where):
    bs = subject.block_size
    prompt = subject.prompt(10, 2 * bs + 5)
    max_new = subject.max_new
    params = SamplingParams(temperature=0.0, max_tokens=max_new, ignore_eos=True)
    engine_a, _ = subject.engine()
    rid = engine_a.add_request(prompt, params)
    so_far: list[int] = []
    while len(so_far) < 4:
        for out in engine_a.step():
            so_far = out.output_token_ids
    computed = len(prompt) + len(so_far) - 1  # the last sampled token has no KV yet
    kv = engine_a.export_kv(engine_a.request_block_ids(rid))
    assert kv.shape[1:] == engine_a.runner.block_shape and kv.shape[0] >= blocks_for(computed, bs)
    assert engine_a.abort_request(rid)
    assert engine_a.pool.num_free_blocks == engine_a.pool.num_blocks

    num_external = computed if where == "all-computed" else 2 * bs + 3
    engine_b, rec = subject.engine(fresh=True)
    rid_b = engine_b.add_request(
        prompt, params, kv=PromptKV(num_external, kv), options=RequestOptions(outputs=tuple(so_far))
    )
    engine_b.step()
    # B starts where the external KV ends and computes only the rest.
    first_computed, first_new = rec.tokens_computed(rid_b)[0]
    assert (first_computed, first_new) == (num_external, computed + 1 - num_external)
    # The imported tokens' KV is bit-identical to A's; the recomputed ones agree closely.
    kv_b = engine_b.export_kv(engine_b.request_block_ids(rid_b))
    flat_a = kv.permute(1, 2, 0, 3, 4, 5).flatten(2, 3)  # [L, 2, n*bs, Hkv, D]
    flat_b = kv_b.permute(1, 2, 0, 3, 4, 5).flatten(2, 3)
    assert torch.equal(flat_b[:, :, :num_external], flat_a[:, :, :num_external])
    torch.testing.assert_close(
        flat_b[:, :, num_external:computed], flat_a[:, :, num_external:computed], atol=1e-4, rtol=1e-4
    )

    final = run_to_completion(engine_b)[rid_b]
    assert final.output_token_ids[: len(so_far)] == so_far
    assert len(final.output_token_ids) == max_new
    assert sum(n for _, n in rec.tokens_computed(rid_b)) == len(prompt) + max_new - 1 - num_external
    out_full = final.output_token_ids
    ref_len = out_full.index(subject.eos_token_id) + 1 if subject.eos_token_id in out_full else max_new
    assert_greedy_close(out_full[:ref_len], subject.hf, prompt, max_new, label=f"{subject.name} kv-import")


def test_the_greedy_check_rejects_a_wrong_token(tiny_models):
    """assert_greedy_close fails on a sequence that is off by one token, and passes the real one."""
    tiny = tiny_models["llama"]
    prompt = list(range(10, 30))
    ref = reference_greedy(tiny.hf, prompt, 12)
    assert len(ref) == 12
    assert assert_greedy_close(ref, tiny.hf, prompt, 12) is None
    wrong = list(ref)
    wrong[5] = (wrong[5] + 1) % tiny.vocab_size
    with pytest.raises(pytest.fail.Exception, match="differ at step 5"):
        assert_greedy_close(wrong, tiny.hf, prompt, 12)
    with pytest.raises(pytest.fail.Exception, match="without EOS"):
        assert_greedy_close(ref[:8], tiny.hf, prompt, 12)


def test_torch_attention_path_matches_too(tiny):
    """The pure-torch decode attention (used where the kernel cannot be built) gives the same tokens."""
    engine = make_engine(tiny.path, use_kernels=False, max_num_batched_tokens=16)
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, tiny.vocab_size, (n,), generator=g).tolist() for n in (5, 23, 41)]
    params = SamplingParams(temperature=0.0, max_tokens=12)
    first = engine.add_request(prompts[0], params)
    engine.step()
    engine.step()
    rest = [engine.add_request(p, params) for p in prompts[1:]]
    final = run_to_completion(engine)
    for rid, prompt in zip([first, *rest], prompts):
        assert_greedy_close(final[rid].output_token_ids, tiny.hf, prompt, 12, label=f"{tiny.name} torch path")
