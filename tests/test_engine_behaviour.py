"""What a user of the engine sees besides greedy equivalence: sampling, stopping, abort,
connector hooks and input errors. Runs on the tiny llama of conftest (and, for stop
strings, on a tiny model that ships a tokenizer)."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from conftest import RecordingConnector, make_engine, run_to_completion

from mooncake.engine import EngineConfig, FinishReason, LLMEngine, SamplingParams
from mooncake.engine.request import PromptKV, RequestOptions
from mooncake.serving.text import generate_text


def prompt_of(seed: int, length: int, vocab: int = 300) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (length,), generator=g).tolist()


def greedy_tokens(engine: LLMEngine, prompt: list[int], n: int) -> list[int]:
    (out,) = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
    return out.output_token_ids


# -- sampling ---------------------------------------------------------------------------


def test_seeded_sampling_is_reproducible_alone_and_in_a_batch(tiny_llama):
    prompt = prompt_of(1, 19)
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=1234, max_tokens=24, ignore_eos=True)
    engine = make_engine(tiny_llama.path)
    (alone,) = engine.generate([prompt], params)
    (again,) = engine.generate([prompt], params)
    assert again.output_token_ids == alone.output_token_ids

    # A fresh engine with another engine seed, the request in the middle of a batch of
    # unseeded and differently seeded requests, admitted in the same steps.
    other = make_engine(tiny_llama.path, seed=99, max_num_batched_tokens=16)
    batch = [prompt_of(2, 30), prompt_of(3, 7), prompt, prompt_of(4, 12)]
    batch_params = [
        SamplingParams(temperature=1.0, max_tokens=30, ignore_eos=True),
        SamplingParams(temperature=0.7, seed=7, max_tokens=5, ignore_eos=True),
        params,
        SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
    ]
    outs = other.generate(batch, batch_params)
    assert outs[2].output_token_ids == alone.output_token_ids

    (reseeded,) = engine.generate([prompt], SamplingParams(**{**params.__dict__, "seed": 4321}))
    assert reseeded.output_token_ids != alone.output_token_ids
    # And sampling is really sampling: it leaves the greedy path.
    assert alone.output_token_ids != greedy_tokens(engine, prompt, 24)


def test_a_seeded_request_resumed_from_its_first_tokens_samples_what_it_would_have_alone(tiny_llama):
    """A resumed stream (or a decode worker going on from a prefill's first token) is given the tokens sampled
    elsewhere: the seeded generator skips their draws, so the rest is the undisturbed run's."""
    prompt = prompt_of(5, 23)
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=77, max_tokens=20, ignore_eos=True)
    engine = make_engine(tiny_llama.path)
    (alone,) = engine.generate([prompt], params)
    for sampled_elsewhere in (1, 9):
        rid = engine.add_request(
            prompt, params, options=RequestOptions(outputs=tuple(alone.output_token_ids[:sampled_elsewhere]))
        )
        resumed = run_to_completion(engine)[rid]
        assert resumed.output_token_ids == alone.output_token_ids


def test_unseeded_sampling_gives_valid_tokens(tiny_llama):
    engine = make_engine(tiny_llama.path)
    params = SamplingParams(temperature=0.8, top_k=50, max_tokens=16, ignore_eos=True)
    outs = engine.generate([prompt_of(5, 9), prompt_of(6, 33), prompt_of(7, 2)], params)
    for out in outs:
        assert len(out.output_token_ids) == 16 and out.finish_reason == FinishReason.LENGTH
        assert all(0 <= t < tiny_llama.vocab_size for t in out.output_token_ids)


def test_top_k_one_is_greedy(tiny_llama):
    engine = make_engine(tiny_llama.path)
    prompt = prompt_of(8, 25)
    (out,) = engine.generate([prompt], SamplingParams(temperature=1.5, top_k=1, max_tokens=20, ignore_eos=True))
    assert out.output_token_ids == greedy_tokens(engine, prompt, 20)


# -- stopping ---------------------------------------------------------------------------


def test_stop_token_and_max_tokens(tiny_llama):
    engine = make_engine(tiny_llama.path)
    prompt = prompt_of(9, 14)
    g = greedy_tokens(engine, prompt, 20)
    stop = g[6]
    k = g.index(stop)
    (out,) = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=(stop,)))
    assert out.output_token_ids == g[: k + 1]
    assert out.finish_reason == FinishReason.STOP and out.stop_reason == stop

    (out,) = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True))
    assert out.output_token_ids == g[:7]
    assert out.finish_reason == FinishReason.LENGTH


def test_eos_from_config_stops_unless_ignore_eos(tiny_llama, tmp_path):
    engine = make_engine(tiny_llama.path)
    prompt = prompt_of(10, 11)
    g = greedy_tokens(engine, prompt, 16)
    eos = g[5]
    k = g.index(eos)
    # Same weights; config.json names one of the greedy tokens as EOS.
    model_dir = tmp_path / "model"
    shutil.copytree(tiny_llama.path, model_dir)
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg["eos_token_id"] = eos
    (model_dir / "config.json").write_text(json.dumps(cfg))
    engine = make_engine(model_dir)

    (out,) = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=16))
    assert out.output_token_ids == g[: k + 1]
    assert out.finish_reason == FinishReason.STOP and out.stop_reason == eos
    (out,) = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    assert out.output_token_ids == g
    assert out.finish_reason == FinishReason.LENGTH


def test_eos_listed_only_in_generation_config_stops(tiny_llama, tmp_path):
    engine = make_engine(tiny_llama.path)
    prompt = prompt_of(10, 11)
    g = greedy_tokens(engine, prompt, 16)
    eos = g[4]
    model_dir = tmp_path / "model"
    shutil.copytree(tiny_llama.path, model_dir)
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [299, eos]}))
    (out,) = make_engine(model_dir).generate([prompt], SamplingParams(temperature=0.0, max_tokens=16))
    assert out.output_token_ids == g[: g.index(eos) + 1]
    assert out.finish_reason == FinishReason.STOP and out.stop_reason == eos


@pytest.fixture(scope="module")
def tokenized_model(tmp_path_factory):
    """A tiny model directory that ships a tokenizer, and that tokenizer."""
    tokenizer_mod = pytest.importorskip(
        "mooncake.engine.tokenizer", reason="stop strings need mooncake.engine.tokenizer"
    )
    tiny_mod = pytest.importorskip("mooncake.engine.tiny", reason="needs make_tiny for a model with a tokenizer")
    path = tiny_mod.make_tiny(tmp_path_factory.mktemp("tok") / "llama", "llama", seed=3)
    return path, tokenizer_mod.Tokenizer.from_dir(path)


def _stop_string_case(tokenized_model):
    """Greedy tokens of a fixed prompt, and an ASCII stop string that appears mid-output."""
    path, tok = tokenized_model
    engine = make_engine(path, tokenizer=tok)
    prompt = tok.encode("Hello world! How are you today? Tell me a story about a robot.")
    g = greedy_tokens(engine, prompt, 32)
    full = tok.decode(g)
    head = len(tok.decode(g[:4]))
    m = re.search(r"[A-Za-z]{3}", full[head:])
    if m is None:
        pytest.fail(f"no ASCII word in the greedy text {full!r}; pick another prompt")
    return engine, tok, prompt, g, m.group(0)


# Stop strings are the serving layer's one detokenizer's (mooncake.serving.text): the engine emits token ids, and a
# request served with stop strings is its tokens through OutputText, which ends it (the engine aborts it) at the first
# token whose text completes one.


def test_stop_string_ends_request_and_trims_text(tokenized_model):
    engine, tok, prompt, g, stop = _stop_string_case(tokenized_model)
    # The first step whose decoded output contains the stop string ends the request.
    i = next(i for i in range(1, len(g) + 1) if stop in tok.decode(g[:i]))
    text_i = tok.decode(g[:i])
    at = text_i.find(stop)

    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, stop=(stop,))
    ((ids, text, finish, stop_reason),) = generate_text(engine, [prompt], params, tok)
    assert ids == g[:i]
    assert finish == FinishReason.STOP and stop_reason == stop
    assert text == text_i[:at]
    assert not engine.has_unfinished() and engine.num_free_blocks == engine.pool.num_blocks  # aborted in the engine

    params = SamplingParams(
        temperature=0.0, max_tokens=32, ignore_eos=True, stop=(stop,), include_stop_str_in_output=True
    )
    ((_, text, _, _),) = generate_text(engine, [prompt], params, tok)
    assert text == text_i[: at + len(stop)]
    with pytest.raises(ValueError, match="stop strings"):  # the engine alone has no text to find them in
        engine.generate([prompt], params)


def test_text_without_stop_strings_is_the_decoded_output(tokenized_model):
    path, tok = tokenized_model
    engine = make_engine(path, tokenizer=tok)
    prompt = tok.encode("The quick brown fox")
    ((ids, text, _, _),) = generate_text(
        engine, [prompt], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), tok
    )
    assert text == tok.decode(ids) and text


def test_text_with_unmatched_stop_string_includes_last_token(tokenized_model):
    path, tok = tokenized_model
    engine = make_engine(path, tokenizer=tok)
    prompt = tok.encode("The quick brown fox")
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, stop=("\x00never\x00",))
    ((ids, text, finish, _),) = generate_text(engine, [prompt], params, tok)
    assert finish == FinishReason.LENGTH
    assert text == tok.decode(ids)


def test_stop_string_in_the_last_allowed_token_is_a_stop(tokenized_model):
    engine, tok, prompt, g, stop = _stop_string_case(tokenized_model)
    i = next(i for i in range(1, len(g) + 1) if stop in tok.decode(g[:i]))
    params = SamplingParams(temperature=0.0, max_tokens=i, ignore_eos=True, stop=(stop,))
    ((ids, _, finish, stop_reason),) = generate_text(engine, [prompt], params, tok)
    assert ids == g[:i]
    assert finish == FinishReason.STOP and stop_reason == stop


# -- abort ------------------------------------------------------------------------------


def test_abort_frees_every_block_waiting_and_running(tiny_llama):
    rec = RecordingConnector(keep_kv=False)
    engine = make_engine(tiny_llama.path, connector=rec, num_kv_blocks=32, max_num_seqs=1)
    total = engine.pool.num_blocks
    params = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
    running = engine.add_request(prompt_of(11, 30), params)
    waiting = engine.add_request(prompt_of(12, 20), params)
    for _ in range(3):
        engine.step()
    assert engine.stats().num_running == 1 and engine.stats().num_waiting == 1
    held = len(engine.request_block_ids(running))
    assert held >= 4 and engine.pool.num_free_blocks == total - held

    assert engine.abort_request(waiting)
    assert engine.pool.num_free_blocks == total - held
    assert engine.abort_request(running)
    assert engine.pool.num_free_blocks == total
    assert {rid for rid, _ in rec.finished} == {running, waiting}
    with pytest.raises(ValueError, match="unknown or finished"):
        engine.request_block_ids(running)
    assert not engine.abort_request(running)  # already gone
    assert not engine.has_unfinished() and engine.step() == []

    # The freed blocks serve new requests (the whole cache is usable again).
    (out,) = engine.generate([prompt_of(13, 8 * 30)], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    assert len(out.output_token_ids) == 8


def test_abort_before_first_step_and_mid_prefill(tiny_llama):
    engine = make_engine(tiny_llama.path, num_kv_blocks=32, max_num_batched_tokens=8)
    total = engine.pool.num_blocks
    params = SamplingParams(temperature=0.0, max_tokens=5)
    queued = engine.add_request(prompt_of(14, 40), params)
    assert engine.abort_request(queued) and engine.pool.num_free_blocks == total
    mid = engine.add_request(prompt_of(15, 40), params)
    engine.step()
    engine.step()  # 16 of 40 prompt tokens computed
    assert engine.pool.num_free_blocks < total
    assert engine.abort_request(mid)
    assert engine.pool.num_free_blocks == total and not engine.has_unfinished()


# -- connector hooks ----------------------------------------------------------------------


def test_connector_sees_every_layer_in_order_and_the_kv_it_is_given(tiny_llama):
    rec = RecordingConnector()
    engine = make_engine(tiny_llama.path, connector=rec, block_size=8, max_num_batched_tokens=12)
    layers = engine.args.num_layers
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    a = engine.add_request(prompt_of(16, 21), params)
    engine.step()
    b = engine.add_request(prompt_of(17, 9), params)
    for _ in range(8):
        engine.step()

    # Hook order within every step: start, (load l, save l) for l = 0..L-1, end.
    per_layer = [e for layer in range(layers) for e in (("load", layer), ("save", layer))]
    assert len(rec.steps) == 9
    for i, step in enumerate(rec.steps):
        chunk = rec.events[i * (2 * layers + 2) : (i + 1) * (2 * layers + 2)]
        assert chunk == [("start", step.step_id), *per_layer, ("end",)], chunk
        assert sum(r.num_new_tokens for r in step.requests) <= 12
        for r in step.requests:
            assert r.slots.shape == (r.num_new_tokens,)
        all_slots = torch.cat([r.slots for r in step.requests])
        assert len(set(all_slots.tolist())) == len(all_slots)
    assert [s.step_id for s in rec.steps] == sorted({s.step_id for s in rec.steps})

    # What the connector saw at the slots is the request's KV, as export_kv gives it.
    for rid in (a, b):
        computed = sum(n for _, n in rec.tokens_computed(rid))
        kv = engine.export_kv(engine.request_block_ids(rid))  # [n, L, 2, bs, Hkv, D]
        flat = kv.permute(1, 2, 0, 3, 4, 5).flatten(2, 3)[:, :, :computed]  # [L, 2, tokens, Hkv, D]
        for layer in range(layers):
            assert torch.equal(torch.cat(rec.saved_k[(rid, layer)]), flat[layer, 0])
            assert torch.equal(torch.cat(rec.saved_v[(rid, layer)]), flat[layer, 1])
        assert flat.abs().sum() > 0


# -- bad input ----------------------------------------------------------------------------


def test_bad_requests_raise_value_error(tiny_llama):
    engine = make_engine(tiny_llama.path, max_model_len=64)
    with pytest.raises(ValueError, match="empty"):
        engine.add_request([], SamplingParams())
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request(list(range(3, 68)), SamplingParams())
    with pytest.raises(ValueError, match="vocabulary"):
        engine.add_request([5, 6, tiny_llama.vocab_size], SamplingParams())
    with pytest.raises(ValueError, match="vocabulary"):
        engine.add_request([5, -1], SamplingParams())
    with pytest.raises(ValueError, match="tokenizer"):
        engine.add_request([5, 6], SamplingParams(stop=("x",)))
    rid = engine.add_request([5, 6], SamplingParams(), request_id="dup")
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request([7, 8], SamplingParams(), request_id=rid)
    with pytest.raises(ValueError, match="imported KV"):
        engine.add_request(list(range(3, 30)), kv=PromptKV(8, torch.zeros(1, 2, 3)))
    assert engine.abort_request(rid) and not engine.has_unfinished()


@pytest.mark.parametrize(
    ("kwargs", "word"),
    [
        (dict(temperature=-0.5), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(top_k=-1), "top_k"),
    ],
)
def test_bad_sampling_params_raise_value_error(kwargs, word):
    with pytest.raises(ValueError, match=word):
        SamplingParams(**kwargs)


def test_unknown_model_dir_is_a_clear_error(tmp_path):
    with pytest.raises((FileNotFoundError, ValueError), match="does not exist"):
        LLMEngine(EngineConfig(model=str(tmp_path / "no-such-model")))
    (tmp_path / "empty").mkdir()
    with pytest.raises((FileNotFoundError, ValueError), match="config.json"):
        LLMEngine(EngineConfig(model=str(tmp_path / "empty")))


def test_max_model_len_beyond_the_model_is_refused(tiny_llama):
    with pytest.raises(ValueError, match="max_model_len"):
        make_engine(tiny_llama.path, max_model_len=4096)


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_corrupt_weights_raise_value_error(tiny_llama, tmp_path, damage):
    model_dir = tmp_path / "model"
    shutil.copytree(tiny_llama.path, model_dir)
    weights = model_dir / "model.safetensors"
    if damage == "garbage":
        weights.write_bytes(b"\x93this is not a safetensors file\x00" * 64)
    else:
        data = weights.read_bytes()
        weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="model.safetensors"):
        make_engine(model_dir)


def test_a_held_requests_blocks_outlive_its_end_until_released_and_read_back_its_kv(tiny_llama):
    """``RequestOptions.hold`` (a decode worker's write-behind): a request that ended keeps its blocks, which
    ``computed_blocks`` still reads, until ``release_held`` frees them; released before it ends, nothing is held."""
    engine = make_engine(tiny_llama.path, block_size=16, enable_prefix_caching=False)
    free = engine.num_free_blocks
    prompt = prompt_of(3, 40)  # two full blocks and a partial one
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    rid = engine.add_request(prompt, params, options=RequestOptions(hold=True))
    run_to_completion(engine)
    assert engine.num_free_blocks == free - 3  # ended, its three blocks held
    keys, kv, parent = engine.computed_blocks(rid, 0)
    other = make_engine(tiny_llama.path, block_size=16, enable_prefix_caching=False)
    alone = other.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    while not other.scheduler.requests[alone].output_token_ids:
        other.step()
    assert len(keys) == 2 and parent is None
    assert torch.equal(kv, other.export_kv(other.request_block_ids(alone)[:2]))  # its prompt's KV, read after its end
    engine.release_held(rid)
    assert engine.num_free_blocks == free and engine.computed_blocks(rid, 0) == ([], None, None)

    early = engine.add_request(prompt, params, options=RequestOptions(hold=True))
    engine.release_held(early)  # (its client went away before it ended: the decode worker's close)
    run_to_completion(engine)
    assert engine.num_free_blocks == free
    plain = engine.add_request(prompt, params)
    run_to_completion(engine)
    assert engine.num_free_blocks == free and engine.computed_blocks(plain, 0) == ([], None, None)
