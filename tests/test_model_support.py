"""Which models each engine serves, and how a refusal reaches the user: one line naming the model, the field and what
is supported, exit status 2, never a traceback (`mooncake up`, `mooncake serve <worker>`); the architecture list is
our engine's only, and the gateway reads no model arguments."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mooncake.engine.model_args import ModelArgs
from mooncake.engine.weights import load_hf_config
from mooncake.serving.model_support import KVLayout, context_length, kv_layout

ROOT = Path(__file__).resolve().parent.parent


def foo_model(tmp_path: Path, tiny_dir: Path) -> Path:
    """A model directory whose config.json names model_type "foo" (the tiny model's tokenizer beside it)."""
    model = tmp_path / "foo-model"
    model.mkdir()
    cfg = load_hf_config(tiny_dir) | {"model_type": "foo", "architectures": ["FooForCausalLM"]}
    (model / "config.json").write_text(json.dumps(cfg))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (model / name).write_bytes((tiny_dir / name).read_bytes())
    return model


def run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "mooncake.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env=env,
    )


def test_mooncake_up_refuses_a_model_our_engine_lacks_in_one_line_with_status_2(tmp_path, tiny_dir):
    model = foo_model(tmp_path, tiny_dir)
    proc = run_cli("up", "--model", str(model), "--engine", "native", "--workdir", str(tmp_path / "run"))
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: model ") and str(model) in last
    assert "model_type 'foo'" in last and "llama" in last  # the field, and what is supported
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").iterdir())  # nothing was started


@pytest.mark.vllm
def test_mooncake_up_refuses_a_model_vllm_cannot_serve_in_one_line_with_status_2(tmp_path, tiny_dir):
    """--engine vllm asks vLLM, not our architecture list: a model_type transformers and vLLM do not know is
    refused by vLLM's reading of the model, before anything starts."""
    pytest.importorskip("vllm")
    model = foo_model(tmp_path, tiny_dir)
    proc = run_cli("up", "--model", str(model), "--engine", "vllm", "--workdir", str(tmp_path / "run"))
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: model {model} (--engine vllm): vLLM cannot serve it: ") and "foo" in last


def test_a_worker_started_alone_refuses_the_model_in_one_line_with_status_2(tmp_path, tiny_dir):
    model = foo_model(tmp_path, tiny_dir)
    proc = run_cli("serve", "decode", "--model", str(model))
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: model ") and str(model) in last and "model_type 'foo'" in last


def test_mooncake_up_puts_a_bad_setting_on_one_line(tmp_path, tiny_dir):
    proc = run_cli("up", "--model", str(tiny_dir), "--prefill-groups", "3", "--workdir", str(tmp_path / "run"))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("error: ") and "--prefill-groups 3" in proc.stderr


def test_our_engines_layout_is_its_model_arguments(tiny_dir):
    args = ModelArgs.from_hf_config(load_hf_config(tiny_dir))
    layout = kv_layout("native", tiny_dir, "bfloat16")
    assert layout == KVLayout(args.num_layers, args.num_kv_heads, args.head_dim, layout.dtype)
    assert layout.block_bytes(16) == args.num_layers * 2 * 16 * args.num_kv_heads * args.head_dim * 2


def test_the_gateway_reads_the_context_of_any_architecture_from_config_json():
    assert context_length({"model_type": "gpt2", "n_positions": 1024}) == 1024
    assert context_length({"max_position_embeddings": 4096, "seq_length": 2048}) == 2048  # the smallest, as vLLM
    assert context_length({"text_config": {"max_position_embeddings": 512}}) == 512
    with pytest.raises(ValueError, match="--max-model-len"):
        context_length({"model_type": "foo"}, "m")


def test_the_gateway_builds_its_backend_for_an_architecture_our_engine_lacks(tmp_path, tiny_dir):
    from mooncake.gateway.__main__ import build_backend, parse_args

    model = foo_model(tmp_path, tiny_dir)
    cfg = json.loads((model / "config.json").read_text())
    cfg.pop("max_position_embeddings")
    (model / "config.json").write_text(json.dumps(cfg | {"n_positions": 640}))
    backend, name = build_backend(parse_args(["--conductor", "127.0.0.1:1", "--model", str(model), "--engine", "vllm"]))
    assert name == "foo-model" and backend.max_model_len == 640 and backend.block_size == 32


# -- what the pool connector carries of vLLM's caches (vLLM's spec objects, no engine) ----------------------------


def _config(*groups):
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    return KVCacheConfig(
        num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(names, spec) for names, spec in groups]
    )


@pytest.mark.vllm
def test_vllm_caches_the_connector_cannot_carry_are_refused_naming_what():
    pytest.importorskip("vllm")
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, MLAAttentionSpec, SlidingWindowSpec

    from mooncake.vllm_engine.kv_spec import layout_of_kv_cache

    f32 = torch.float32
    full = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=64, dtype=f32)
    layers = ["model.layers.0.attn", "model.layers.1.attn"]
    assert layout_of_kv_cache("m", _config((layers, full)), f32) == KVLayout(2, 2, 64, f32)
    cases = {
        "MLA": _config((layers, MLAAttentionSpec(block_size=32, num_kv_heads=1, head_size=576, dtype=f32))),
        "mamba": _config((layers, MambaSpec(block_size=32, shapes=((4, 8),), dtypes=(f32,)))),
        "SlidingWindowSpec": _config(
            (layers, SlidingWindowSpec(block_size=32, num_kv_heads=2, head_size=64, dtype=f32, sliding_window=64))
        ),
        "head counts or head sizes": _config(
            (layers[:1], full),
            (layers[1:], FullAttentionSpec(block_size=32, num_kv_heads=1, head_size=128, dtype=f32)),
        ),
        "quantized": _config(
            (layers, FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=64, dtype=torch.uint8))
        ),
    }
    fp8 = _config((layers, FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=64, dtype=torch.uint8)))
    assert layout_of_kv_cache("m", fp8, f32, "fp8") == KVLayout(2, 2, 64, torch.float8_e4m3fn)  # --kv-cache-dtype fp8
    for what, config in cases.items():
        with pytest.raises(ValueError, match=what) as e:
            layout_of_kv_cache("/models/x", config, f32)
        message = str(e.value)
        assert "\n" not in message and message.startswith("model /models/x (--engine vllm): ")
        assert "supported: " in message


def test_a_component_that_refuses_at_start_stops_the_cluster_with_its_one_line(tmp_path):
    from mooncake.cluster.launcher import Component, ComponentRefused

    script = "import sys; print('loading', file=sys.stderr); print('error: model m: no', file=sys.stderr); sys.exit(2)"
    comp = Component("prefill-0", [sys.executable, "-c", script], tmp_path / "prefill-0.log")
    comp.start()
    with pytest.raises(ComponentRefused, match=r"^prefill-0: model m: no$"):
        comp.wait_ready(30)
    crashed = Component("decode-0", [sys.executable, "-c", "import sys; sys.exit(1)"], tmp_path / "decode-0.log")
    crashed.start()
    with pytest.raises(RuntimeError, match="decode-0 exited") as e:
        crashed.wait_ready(30)
    assert not isinstance(e.value, ComponentRefused)  # a crash is not a refusal: the log's tail, `mooncake up` exits 1


@pytest.mark.vllm
def test_vllm_models_whose_kv_the_pool_cannot_carry_are_refused_before_anything_starts(tmp_path, tiny_dir):
    """An MLA model (DeepSeek-V2) stops `mooncake up --engine vllm` in one line naming the latent cache; a
    state-space model (Mamba) is refused by the same reading. Config files only: nothing is loaded."""
    pytest.importorskip("vllm")
    transformers = pytest.importorskip("transformers")
    mla = tmp_path / "tiny-deepseek-v2"
    cfg = transformers.DeepseekV2Config(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        kv_lora_rank=32,
        q_lora_rank=None,
        qk_rope_head_dim=16,
        qk_nope_head_dim=32,
        v_head_dim=32,
        n_routed_experts=4,
        num_experts_per_tok=2,
    )
    cfg.architectures = ["DeepseekV2ForCausalLM"]
    cfg.save_pretrained(mla)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (mla / name).write_bytes((tiny_dir / name).read_bytes())
    proc = run_cli("up", "--model", str(mla), "--engine", "vllm", "--workdir", str(tmp_path / "run"))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: model {mla} (--engine vllm): an MLA latent KV cache") and "supported: " in last

    mamba = tmp_path / "tiny-mamba"
    cfg = transformers.MambaConfig(vocab_size=512, hidden_size=64, num_hidden_layers=2)
    cfg.architectures = ["MambaForCausalLM"]
    cfg.save_pretrained(mamba)
    with pytest.raises(ValueError, match=r"^model .*tiny-mamba \(--engine vllm\): an attention-free model"):
        kv_layout("vllm", mamba, "float32")
