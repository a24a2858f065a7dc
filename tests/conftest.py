"""Shared fixtures: tiny random-weight Hugging Face models, SmolLM2-135M, and the greedy-equivalence check.

Tiny models are built with transformers' own config classes and ``save_pretrained``, so
the engine reads exactly what a user's checkpoint would hold, and transformers' forward
is the reference. Weights are random but not flat (``initializer_range=0.2``, random
norm weights and biases), so greedy decoding has clear winners and every parameter
matters to the output.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from mooncake import tls
from mooncake.engine import ConnectorStep, EngineConfig, KVConnector, LLMEngine

TIE_TOLERANCE = 1e-4  # reference top-two logit gap under which a divergence is a tie, not a bug

# Every near-tie divergence accepted by assert_greedy_close, reported at the end of the run.
NEAR_TIES: list[str] = []


# -- tiny models ------------------------------------------------------------------------


@dataclass(frozen=True)
class TinyModel:
    name: str
    path: Path
    hf: torch.nn.Module  # the transformers model the directory was saved from (float32, eval)
    vocab_size: int
    eos_token_id: int


_COMMON = dict(
    vocab_size=300,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    initializer_range=0.2,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)

# name -> (transformers config class name, model class name, config overrides)
TINY_SPECS: dict[str, tuple[str, str, dict]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(num_hidden_layers=2, tie_word_embeddings=False)),
    # Qwen2 small models tie the embedding; q/k/v biases get random values below.
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(num_hidden_layers=3, tie_word_embeddings=True)),
    # head_dim (32) differs from hidden / heads (16): the engine must read it from config.json.
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(num_hidden_layers=2, head_dim=32, tie_word_embeddings=False)),
    # Mistral: llama's shape under its own config and model classes in transformers.
    "mistral": (
        "MistralConfig",
        "MistralForCausalLM",
        dict(num_hidden_layers=2, tie_word_embeddings=False, head_dim=16, sliding_window=None),
    ),
    # llama3 rope scaling with a short original context, so all three frequency bands exist
    # for head_dim 16 (wavelengths from 6 to ~20000 against bands at 8 and 32).
    "llama3_rope": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(
            num_hidden_layers=2,
            tie_word_embeddings=False,
            rope_parameters=dict(
                rope_type="llama3",
                rope_theta=10000.0,
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=32,
            ),
        ),
    ),
    # Mistral with its sliding window shorter than the tests' prompts: every layer attends to its last 12 keys.
    "mistral_window": (
        "MistralConfig",
        "MistralForCausalLM",
        dict(num_hidden_layers=2, tie_word_embeddings=False, head_dim=16, sliding_window=12),
    ),
    # yarn: interpolation blended with extrapolation, cos/sin times its attention factor.
    "yarn_rope": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(
            num_hidden_layers=2,
            tie_word_embeddings=False,
            rope_parameters=dict(
                rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=256
            ),
        ),
    ),
    # Phi-3: fused qkv and gate-up in the checkpoint, half the head rotated, longrope's short factors and attention
    # factor (the tests' prompts stay below original_max_position_embeddings).
    "phi3": (
        "Phi3Config",
        "Phi3ForCausalLM",
        dict(
            num_hidden_layers=2,
            tie_word_embeddings=False,
            original_max_position_embeddings=512,
            rope_parameters=dict(
                rope_type="longrope",
                rope_theta=10000.0,
                partial_rotary_factor=0.5,
                original_max_position_embeddings=512,
                short_factor=[1.0, 1.5, 2.0, 3.0],
                long_factor=[2.0, 4.0, 8.0, 16.0],
            ),
        ),
    ),
    # Gemma 2: a sliding layer then a global one, attention and final soft-capping, its own query scale.
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        dict(
            num_hidden_layers=2,
            head_dim=16,
            sliding_window=12,
            query_pre_attn_scalar=24,
            attn_logit_softcapping=5.0,
            final_logit_softcapping=30.0,
            tie_word_embeddings=True,
        ),
    ),
    # Gemma 3: two sliding layers with their local rope, a global one with a linearly scaled rope, q/k norms.
    "gemma3_text": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        dict(
            num_hidden_layers=3,
            head_dim=16,
            sliding_window=12,
            query_pre_attn_scalar=24,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0},
            },
            tie_word_embeddings=True,
        ),
    ),
    # Qwen3-MoE: 8 experts, 2 a token, renormalised; the second layer a dense MLP (mlp_only_layers).
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(
            num_hidden_layers=2,
            head_dim=16,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=True,
            mlp_only_layers=[1],
            tie_word_embeddings=False,
        ),
    ),
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        dict(num_hidden_layers=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False),
    ),
}
TINY_ARCHS = list(TINY_SPECS)
EAGER_REFERENCE = {"gemma2"}  # transformers applies attention soft-capping in its eager attention only


def build_tiny_model(name: str, out_dir: Path, seed: int = 0) -> TinyModel:
    """Build a random tiny model of ``TINY_SPECS[name]``, save it to ``out_dir``, return it."""
    import transformers

    config_cls, model_cls, overrides = TINY_SPECS[name]
    torch.manual_seed(seed)
    config = getattr(transformers, config_cls)(**{**_COMMON, **overrides})
    if name in EAGER_REFERENCE:
        config._attn_implementation = "eager"
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            # transformers initialises norms to 1 and biases to 0; randomise them so a
            # model that ignored q/k norms, biases or norm weights would be caught.
            if pname.endswith(".bias"):
                p.copy_(torch.randn_like(p) * 0.5)
            elif "norm" in pname:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
    if name == "qwen2":
        assert model.model.layers[0].self_attn.q_proj.bias.abs().sum() > 0
    model.save_pretrained(out_dir)
    return TinyModel(name, Path(out_dir), model, config.vocab_size, int(config.eos_token_id))


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, TinyModel]:
    """Every tiny architecture, built once per session."""
    root = tmp_path_factory.mktemp("tiny-models")
    return {name: build_tiny_model(name, root / name, seed=i) for i, name in enumerate(TINY_ARCHS)}


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    """A tiny random llama with a real tokenizer and chat template (mooncake.engine.tiny), built once per session
    and only read: the model the serving, gateway and failure tests run."""
    from mooncake.engine.tiny import make_tiny

    return make_tiny(tmp_path_factory.mktemp("tiny-chat") / "model", "llama")


SERVING_KEY = "sk-test"
_serving: list = []  # the running serving cluster, for pytest_runtest_teardown
_last_serving_test = None  # the last collected test that uses it (pytest_collection_modifyitems)


@pytest.fixture(scope="session")
def serving_cluster(tiny_dir, tmp_path_factory):
    """Conductor, 2 pool nodes with their prefill workers, a decode worker and the gateway (key ``SERVING_KEY``) on
    ``tiny_dir``: one cluster for test_serving_cluster.py and test_serving_cluster_cancel.py (it takes about 20 s to
    start). It is stopped after the last test that uses it (``pytest_runtest_teardown``), not at the session's end."""
    from clusters import start_cluster

    c = start_cluster(tiny_dir, tmp_path_factory.mktemp("run"), prefill=2, decode=1, api_key=SERVING_KEY)
    _serving.append(c)
    yield c
    c.stop()


def pytest_runtest_teardown(item, nextitem):
    if _serving and item is _last_serving_test:
        _serving.pop().stop()  # no later test needs it: its processes stop now, not after every later module


@pytest.fixture(scope="session")
def tok(tiny_dir):
    """``tiny_dir``'s tokenizer."""
    from mooncake.engine.tokenizer import Tokenizer

    return Tokenizer.from_dir(tiny_dir)


@pytest.fixture(params=TINY_ARCHS)
def tiny(request, tiny_models) -> TinyModel:
    """Parametrized over every tiny architecture."""
    return tiny_models[request.param]


@pytest.fixture
def tiny_llama(tiny_models) -> TinyModel:
    return tiny_models["llama"]


# -- SmolLM2-135M ---------------------------------------------------------------------


@dataclass(frozen=True)
class RealModel:
    path: Path
    hf: torch.nn.Module
    vocab_size: int


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """SmolLM2-135M in Hugging Face layout, converted from the GGUF the registry ships.

    Cached under ~/.cache/mooncake/models (MOONCAKE_TEST_MODEL_CACHE overrides) so the
    conversion runs once per machine.
    """
    from mooncake.engine import registry

    cache = Path(os.environ.get("MOONCAKE_TEST_MODEL_CACHE", Path.home() / ".cache" / "mooncake" / "models"))
    return Path(registry.pull("smollm2-135m", cache_dir=cache, progress=False))


@pytest.fixture(scope="session")
def smollm2(smollm2_dir) -> RealModel:
    """SmolLM2-135M and its transformers reference model in float32."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    return RealModel(smollm2_dir, hf, hf.config.vocab_size)


# -- engines --------------------------------------------------------------------------


def make_engine(model_dir, connector: KVConnector | None = None, tokenizer=None, tp=None, **overrides) -> LLMEngine:
    """An engine in float32 with small defaults; ``overrides`` go into EngineConfig; ``tp``: one rank of a
    tensor-parallel engine (mooncake.engine.parallel.TensorParallel)."""
    cfg = dict(
        model=str(model_dir),
        block_size=8,
        num_kv_blocks=128,
        max_num_batched_tokens=32,
        max_num_seqs=8,
        dtype="float32",
    )
    cfg.update(overrides)
    if tp is not None:
        return LLMEngine(EngineConfig(**cfg), connector=connector, tokenizer=tokenizer, tp=tp)
    return LLMEngine(EngineConfig(**cfg), connector=connector, tokenizer=tokenizer)


def run_to_completion(engine: LLMEngine, max_steps: int = 10_000) -> dict:
    """Step until nothing is left; return {request_id: final RequestOutput}."""
    final = {}
    for _ in range(max_steps):
        if not engine.has_unfinished():
            return final
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    raise AssertionError(f"engine still busy after {max_steps} steps")


class RecordingConnector(KVConnector):
    """Records every hook call, in order, with what a connector could see at that point."""

    def __init__(self, keep_kv: bool = True) -> None:
        self.keep_kv = keep_kv
        self.reset()

    def reset(self) -> None:
        self.events: list[tuple] = []  # ("start", step_id) / ("load", layer) / ("save", layer) / ("end",)
        self.steps: list[ConnectorStep] = []
        self.saved_k: dict[tuple[str, int], list[torch.Tensor]] = {}  # (request, layer) -> K rows per step
        self.saved_v: dict[tuple[str, int], list[torch.Tensor]] = {}
        self.finished: list[tuple[str, list[int]]] = []

    def start_step(self, step: ConnectorStep) -> None:
        self.events.append(("start", step.step_id))
        self.steps.append(step)

    def tokens_computed(self, request_id: str) -> list[tuple[int, int]]:
        """(num_computed_tokens, num_new_tokens) of ``request_id`` in each step it ran."""
        return [
            (r.num_computed_tokens, r.num_new_tokens)
            for s in self.steps
            for r in s.requests
            if r.request_id == request_id
        ]

    def wait_for_layer_load(self, layer: int) -> None:
        self.events.append(("load", layer))

    def save_layer(self, layer, k_cache, v_cache, step) -> None:
        self.events.append(("save", layer))
        if not self.keep_kv:
            return
        nb, bs, hkv, d = k_cache.shape
        for r in step.requests:
            self.saved_k.setdefault((r.request_id, layer), []).append(k_cache.reshape(nb * bs, hkv, d)[r.slots].clone())
            self.saved_v.setdefault((r.request_id, layer), []).append(v_cache.reshape(nb * bs, hkv, d)[r.slots].clone())

    def wait_for_save(self) -> None:
        self.events.append(("end",))

    def request_finished(self, request_id, block_ids) -> None:
        self.finished.append((request_id, list(block_ids)))


# -- the reference and the tie rule ---------------------------------------------------


def _eos_ids(model: torch.nn.Module) -> set[int]:
    eos = model.generation_config.eos_token_id
    if eos is None:
        return set()
    return {int(e) for e in eos} if isinstance(eos, (list, tuple)) else {int(eos)}


@torch.inference_mode()
def reference_logits(model: torch.nn.Module, prompt: list[int], continuation: list[int]) -> torch.Tensor:
    """Teacher-forced reference: logits [len(continuation), vocab] (float32) predicting each token.

    Row i is what transformers' greedy decoding looks at to pick token i after the prompt
    and ``continuation[:i]``; one forward pass instead of one per generated token.
    """
    ids = torch.tensor([list(prompt) + list(continuation)])
    logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0].float()
    return logits[len(prompt) - 1 : len(prompt) - 1 + len(continuation)]


@torch.inference_mode()
def reference_greedy(model: torch.nn.Module, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy ``generate`` (stops at the model's EOS like the engine does)."""
    pad = model.generation_config.pad_token_id
    out = model.generate(
        torch.tensor([list(prompt)]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        do_sample=False,
        max_new_tokens=max_new_tokens,
        pad_token_id=pad if pad is not None else 0,
    )
    return out[0, len(prompt) :].tolist()


def assert_greedy_close(ours, reference_model, prompt, max_new_tokens, *, label: str = "") -> int | None:
    """Assert our greedy tokens are transformers' greedy tokens, allowing only true ties.

    The reference's logits are computed teacher-forced along our tokens, so up to the
    first difference they are exactly the logits transformers' greedy search sees. Each
    of our tokens must be the reference's argmax. At the first that is not: if our
    token's reference logit is within TIE_TOLERANCE of the best (so the reference's
    top two are within it too), the runs took different sides of a tie; the rest of the
    sequence is accepted and the step reported (like vLLM's check_logprobs_close).
    Otherwise it fails showing both sequences (the reference from ``generate``). A
    sequence shorter than ``max_new_tokens`` must end in EOS, one reaching it must not
    contain EOS before its end. Returns the step of an accepted tie, or None.
    """
    ours = [int(t) for t in ours]
    prompt = [int(t) for t in prompt]
    where = f" [{label}]" if label else ""
    eos = _eos_ids(reference_model)

    def fail(reason: str) -> None:
        ref = reference_greedy(reference_model, prompt, max_new_tokens)
        pytest.fail(f"{reason}{where} (prompt of {len(prompt)} tokens)\n  ours:      {ours}\n  reference: {ref}")

    if not ours or len(ours) > max_new_tokens:
        fail(f"engine produced {len(ours)} tokens for max_new_tokens={max_new_tokens}")
    logits = reference_logits(reference_model, prompt, ours)
    best = logits.argmax(-1).tolist()
    for i, (a, b) in enumerate(zip(ours, best)):
        if a == b:
            if a in eos and i != len(ours) - 1:
                fail(f"engine went on after EOS {a} at step {i}")
            continue
        top2 = torch.topk(logits[i], 2).values
        top_gap = float(top2[0] - top2[1])
        our_gap = float(logits[i, b] - logits[i, a])
        if our_gap <= TIE_TOLERANCE:
            msg = (
                f"near-tie accepted{where} at step {i} (prompt of {len(prompt)} tokens): ours {a}, "
                f"reference {b}, reference top-two gap {top_gap:.2e}, our token {our_gap:.2e} below the top"
            )
            NEAR_TIES.append(msg)
            warnings.warn(msg, stacklevel=2)
            return i
        fail(
            f"greedy tokens differ at step {i}: ours {a}, reference {b}; reference logit gap to our "
            f"token {our_gap:.3e} (top-two gap {top_gap:.3e}) is not a tie"
        )
    if len(ours) < max_new_tokens and ours[-1] not in eos:
        fail(f"engine stopped after {len(ours)} of {max_new_tokens} tokens without EOS")
    return None


def pytest_configure(config):
    """Every component a test starts, and every client in the test process, speaks mutual TLS (mooncake.tls) with
    one CA made for the session, as a cluster's components do; MOONCAKE_TEST_INSECURE=1 runs the suite without it."""
    if os.environ.get("MOONCAKE_TEST_INSECURE") == "1" or os.environ.get(tls.ENV_DIR):
        return
    import tempfile

    directory = Path(tempfile.mkdtemp(prefix="mooncake-test-tls-"))
    tls.generate(directory)
    os.environ[tls.ENV_DIR] = str(directory)


def pytest_collection_modifyitems(config, items):
    global _last_serving_test
    _last_serving_test = next((it for it in reversed(items) if "serving_cluster" in it.fixturenames), None)
    rdma = [item for item in items if item.get_closest_marker("rdma")]
    if rdma:
        from kvnodes import rdma_unavailable

        reason = rdma_unavailable()
        for item in rdma if reason else ():
            item.add_marker(pytest.mark.skip(reason=f"no RDMA here: {reason}"))


# -- the transfer and pool suites over each transport ------------------------------------

FAKEVERBS_SITE = Path(__file__).parent / "fakeverbs_site"
TRANSPORTS = [
    "auto",
    pytest.param("fake-rdma", marks=pytest.mark.fakerdma),
    pytest.param("rdma", marks=pytest.mark.rdma),
]


@pytest.fixture(params=TRANSPORTS)
def transport(request, monkeypatch):
    """A test asking for it runs three ways, each set by ``$MOONCAKE_TRANSFER_BACKEND`` for the test process and every
    process it starts: as configured (``auto``: shm on this host), over the rdma backend on tests/fakeverbs.py's
    fabric between real processes (``fake-rdma``), and over a real RDMA port (``rdma``, skipped where none is
    active). Engines and nodes a test makes without naming a backend use it."""
    way = request.param
    if way == "auto":
        yield way
        return
    import tempfile

    import transfer.engine

    monkeypatch.setenv(transfer.engine.BACKEND_ENV, "rdma")
    if way == "fake-rdma":
        from fakeverbs import Fabric

        shared = Path(tempfile.mkdtemp(prefix="fakeverbs-", dir="/dev/shm"))
        monkeypatch.setenv("FAKEVERBS_DIR", str(shared))
        monkeypatch.setenv(
            "PYTHONPATH", os.pathsep.join(filter(None, [str(FAKEVERBS_SITE), os.environ.get("PYTHONPATH")]))
        )
        monkeypatch.setattr("transfer.rdma._pyverbs", Fabric(shared=shared).modules)
    transfer.engine._probe.cache_clear()
    yield way
    transfer.engine._probe.cache_clear()
    if way == "fake-rdma":
        import shutil

        shutil.rmtree(shared, ignore_errors=True)


@pytest.fixture
def fabric(monkeypatch):
    """Every engine made in the test gets tests/fakeverbs.py's in-process fabric as its RDMA device (64 KiB max
    message, 8-deep queues)."""
    from fakeverbs import Fabric

    import transfer.engine

    fab = Fabric(max_msg=64 << 10)
    monkeypatch.setattr("transfer.rdma._pyverbs", fab.modules)
    transfer.engine._probe.cache_clear()
    yield fab
    transfer.engine._probe.cache_clear()


def pytest_terminal_summary(terminalreporter):
    if NEAR_TIES:
        terminalreporter.section("greedy near-ties accepted")
        for line in NEAR_TIES:
            terminalreporter.write_line(line)


# -- pool processes -------------------------------------------------------------------


@pytest.fixture
def shm_dir():
    """A private tmpfs directory for a test's shared-memory segments, removed afterwards."""
    import shutil
    import uuid

    path = f"/dev/shm/mooncake-test-{uuid.uuid4().hex[:8]}"
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    """A real redis-server for the session (installed by `make test`)."""
    from kvnodes import RedisServer

    server = RedisServer(tmp_path_factory.mktemp("redis"))
    yield server
    server.stop()


@pytest.fixture
def redis_url(redis_server) -> str:
    """The session's Redis, emptied for this test."""
    import redis

    client = redis.Redis.from_url(redis_server.url)
    client.flushall()
    client.close()
    return redis_server.url
