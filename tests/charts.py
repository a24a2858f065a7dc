"""The helm chart as the tests see it: ``helm template`` renders, parsed, and what to pick out of them
(shared by test_deploy.py and test_deploy_security.py)."""

from __future__ import annotations

import functools
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
CHART = REPO / "deploy" / "helm" / "mooncake"
PRODUCTION = REPO / "deploy" / "helm" / "values-production.yaml"
VLLM_GPU = REPO / "deploy" / "helm" / "values-vllm-gpu.yaml"
RELEASE, NAMESPACE = "mc", "serving"
PREFIX = f"{RELEASE}-mooncake"
# stock vLLM on the production sizes, as deploy/README.md tells to run it
VLLM_ON_PRODUCTION = [
    "--set",
    "engine.kind=vllm",
    "--set",
    "image.variant=vllm-cuda",
    "--set",
    "engine.vllmArgs={enforce_eager=true}",
]
# stock vLLM on the CPU: its attention needs 32-token blocks (the pool nodes size theirs from the model)
VLLM_ON_CPU = [
    "--set",
    "engine.kind=vllm",
    "--set",
    "image.variant=vllm-cpu",
    "--set",
    "model.blockSize=32",
]
VALUE_SETS = {
    "default": [],
    "production": ["-f", str(PRODUCTION)],
    "vllm-gpu": ["-f", str(VLLM_GPU)],
    "production-vllm": ["-f", str(PRODUCTION), *VLLM_ON_PRODUCTION],
    "vllm-cpu": VLLM_ON_CPU,
    "groups": ["--set", "prefill.groups.replicas=2", "--set", "prefill.groups.stages=3"],
    # the model from elsewhere than the image (test_deploy_model.py)
    "model-pvc": ["--set", "model.source=pvc", "--set", "model.pvc.claimName=models"],
    "model-hostpath": ["--set", "model.source=hostPath", "--set", "model.hostPath.path=/srv/models/smollm2"],
    "model-hub": [
        "--set",
        "model.source=hub",
        "--set",
        "model.hub.id=HuggingFaceTB/SmolLM2-135M-Instruct",
        "--set",
        "model.hub.tokenSecret.name=hf",
    ],
}


def _tool(name: str, install: str) -> str:
    """The path of ``name`` on PATH or in this interpreter's (or the repo's) venv; fail, never skip, without it."""
    candidates = [shutil.which(name), Path(sys.executable).parent / name, REPO / ".venv" / "bin" / name]
    for found in candidates:
        if found and Path(found).is_file():
            return str(found)
    pytest.fail(f"{name} is not installed; install it with: {install}")


@functools.cache
def helm() -> str:
    return _tool("helm", "deploy/tools/install-helm.sh .venv/bin")


@functools.cache
def kubernetes_validate() -> str:
    return _tool("kubernetes-validate", ".venv/bin/pip install kubernetes-validate")


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, cwd=REPO, timeout=120)


@functools.cache
def render_text(*extra: str) -> str:
    out = run(helm(), "template", RELEASE, str(CHART), "--namespace", NAMESPACE, *extra)
    assert out.returncode == 0, f"helm template {' '.join(extra)} failed:\n{out.stderr}"
    return out.stdout


def render(*extra: str) -> list[dict]:
    """The documents ``helm template`` renders (empty ones dropped)."""
    return [d for d in yaml.safe_load_all(render_text(*extra)) if d]


def merged_values(values: str) -> dict:
    """The chart's values under a value set, merged as helm merges them: values.yaml, each -f file, each --set
    (``a.b=value``, a list written ``{x,y}``)."""

    def merge(into: dict, over: dict) -> None:
        for key, value in over.items():
            if isinstance(value, dict) and isinstance(into.get(key), dict):
                merge(into[key], value)
            else:
                into[key] = value

    merged = yaml.safe_load((CHART / "values.yaml").read_text())
    args = VALUE_SETS[values]
    for flag, arg in zip(args[::2], args[1::2]):
        if flag == "-f":
            merge(merged, yaml.safe_load(Path(arg).read_text()))
            continue
        path, _, raw = arg.partition("=")
        value = raw[1:-1].split(",") if raw.startswith("{") else yaml.safe_load(raw)
        *parents, leaf = path.split(".")
        node = merged
        for key in parents:
            node = node[key]
        node[leaf] = value
    return merged


def find(docs: list[dict], kind: str, name: str) -> dict:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, (
        f"expected one {kind} {name}, rendered: {[(d['kind'], d['metadata']['name']) for d in docs]}"
    )
    return found[0]


def kinds(docs: list[dict]) -> set[str]:
    return {d["kind"] for d in docs}


def pod_spec(docs: list[dict], component: str) -> dict:
    return find(docs, "Deployment", f"{PREFIX}-{component}")["spec"]["template"]["spec"]


def container(spec: dict, name: str) -> dict:
    every = spec.get("initContainers", []) + spec["containers"]
    found = [c for c in every if c["name"] == name]
    assert len(found) == 1, f"no container {name!r} in {[c['name'] for c in every]}"
    return found[0]


def flags(c: dict) -> dict[str, str]:
    """``--name=value`` arguments as {name: value} (bare flags map to "")."""
    out = {}
    for arg in c["args"][1:]:
        name, _, value = arg.partition("=")
        out[name] = value
    return out


def port_number(c: dict, port: int | str) -> int:
    """A probe's port: a number, or the name of one of the container's ports."""
    if isinstance(port, int):
        return port
    named = {p["name"]: p["containerPort"] for p in c.get("ports", [])}
    assert port in named, f"container {c['name']} has no port named {port!r} ({named})"
    return named[port]


POD_ENV = {
    "POD_NAME": f"{PREFIX}-x-0",
    "POD_IP": "10.1.2.3",
    "MOONCAKE_REDIS_URL": "redis://r:6379/0",
    "MOONCAKE_API_KEY": "k",
}


def expanded_args(docs: list[dict], c: dict, env: dict[str, str] | None = None) -> list[str]:
    """A container's arguments after its component name, with $(VAR) expanded from the ConfigMap and ``env``
    (the downward API's and the Secrets' values), as the kubelet expands them."""
    values = {**find(docs, "ConfigMap", f"{PREFIX}-config")["data"], **POD_ENV, **(env or {})}
    return [re.sub(r"\$\(([A-Z_0-9]+)\)", lambda m: values[m.group(1)], a) for a in c["args"][1:]]


def mooncake_containers(docs: list[dict]) -> list[tuple[str, dict, dict]]:
    """(component, container, pod spec) of every container running a component (``mooncake serve``, the image's
    entrypoint); a container of the image with a command of its own (the model download) is none."""
    out = []
    for d in docs:
        if d["kind"] != "Deployment":
            continue
        spec = d["spec"]["template"]["spec"]
        for c in spec.get("initContainers", []) + spec["containers"]:
            if "mooncake-serve" in c["image"] and "command" not in c:
                out.append((c["args"][0], c, spec))
    return out
