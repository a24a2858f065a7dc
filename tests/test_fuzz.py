"""The gateway fuzzed through its own ``/openapi.json`` (schemathesis) on a real cluster: every component its
own process (Conductor, a pool node, a prefill and a decode worker, the gateway), a tiny random-weight llama,
an API key.

The ``schemathesis`` CLI generates requests for every operation (valid and invalid bodies, boundary values,
wrong types, missing and wrong keys) and checks each response:

- ``not_a_server_error``: no 5xx;
- ``status_code_conformance``, ``content_type_conformance``, ``response_schema_conformance``,
  ``response_headers_conformance``: the status is documented, and so are the content type, the body (a
  stream's events included) and the headers;
- ``ignored_auth``: an operation documented behind the key refuses a request without it;
- ``openai_error_body`` (tests/fuzz_hooks.py): every 4xx body is OpenAI's ``{"error": {...}}``.

Afterwards no component may have died or been restarted. ``MOONCAKE_FUZZ_CASES`` (default 300, about 30 s
here) is how many cases the fuzzing phase generates in all: the CLI's ``--max-examples`` per operation is that
divided among the operations that take a body (the others have nothing to vary); the coverage phase adds its
boundary cases (about 900) on top. The hooks (tests/fuzz_hooks.py) steer most requests to the served model and
a third of the completions to ``stream: true``. Run it alone, for more cases:

    MOONCAKE_FUZZ_CASES=2000 .venv/bin/pytest -s tests/test_fuzz.py
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest
from clusters import start_cluster

KEY = "sk-fuzz"
CASES = int(os.environ.get("MOONCAKE_FUZZ_CASES", "300"))
CHECKS = (
    "not_a_server_error",
    "status_code_conformance",
    "content_type_conformance",
    "response_schema_conformance",
    "response_headers_conformance",
    "ignored_auth",
    "openai_error_body",
)
SCHEMATHESIS = Path(sys.executable).with_name("schemathesis")
HOOKS_DIR = Path(__file__).parent  # fuzz_hooks.py

pytestmark = pytest.mark.timeout(300 + CASES)


@pytest.fixture(scope="module")
def cluster(tiny_dir, tmp_path_factory):
    # a short context keeps every generation short, whatever max_tokens the fuzzer asks for (more is a 400)
    c = start_cluster(tiny_dir, tmp_path_factory.mktemp("fuzz"), api_key=KEY, max_model_len=256)
    yield c
    c.stop()


@pytest.fixture(scope="module")
def gateway(cluster) -> str:
    return cluster.endpoint.removesuffix("/v1")


def processes(cluster) -> dict[str, tuple[int, int, bool]]:
    """Each component's (pid, restarts, alive)."""
    return {name: (c.proc.pid, c.restarts, c.alive) for name, c in cluster.components.items()}


def test_the_openapi_document_has_every_status_the_gateway_answers_and_no_422(gateway):
    doc = httpx.get(f"{gateway}/openapi.json", timeout=30).json()
    statuses = {
        (method, path): set(op["responses"]) for path, item in doc["paths"].items() for method, op in item.items()
    }
    generation = {"200", "400", "401", "404", "429", "503"}
    assert statuses == {
        ("post", "/v1/chat/completions"): generation,
        ("post", "/v1/completions"): generation,
        ("get", "/v1/models"): {"200", "401"},
        ("post", "/tokenize"): {"200", "400", "401", "404"},
        ("post", "/detokenize"): {"200", "400", "401", "404"},
        ("get", "/health"): {"200", "503"},
        ("get", "/metrics"): {"200"},
    }
    chat = doc["paths"]["/v1/chat/completions"]["post"]["responses"]
    assert set(chat["200"]["content"]) == {"application/json", "text/event-stream"}
    assert chat["429"]["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/ErrorResponse"}
    assert chat["429"]["headers"]["Retry-After"]["required"]
    guarded = {path for path, item in doc["paths"].items() if all("security" in op for op in item.values())}
    assert guarded == {"/v1/chat/completions", "/v1/completions", "/v1/models", "/tokenize", "/detokenize"}
    assert doc["components"]["securitySchemes"] == {
        "bearerAuth": {"type": "http", "scheme": "bearer", "description": "The API key"}
    }
    assert "HTTPValidationError" not in doc["components"]["schemas"]


def schemathesis_run(gateway: str, model: str, cases_per_operation: int, workdir: Path) -> tuple[str, list[list[str]]]:
    """Run the CLI on the gateway; its exit code and output, and one ``[method, path, status, stream]`` per request."""
    argv = [
        str(SCHEMATHESIS),
        "run",
        f"{gateway}/openapi.json",
        "--checks",
        ",".join(CHECKS),
        "--max-examples",
        str(cases_per_operation),
        "--header",
        f"Authorization: Bearer {KEY}",
        "--workers",
        "1",
        "--request-timeout",
        "120",
        "--generation-database",
        "none",
        "--no-color",
        "--continue-on-failure",  # every case runs, so the counts are whole and every distinct failure is listed
    ]
    if os.environ.get("MOONCAKE_FUZZ_SEED"):
        argv += ["--seed", os.environ["MOONCAKE_FUZZ_SEED"]]
    # one worker: with two threads, hypothesis's ast.parse of its lambdas hit CPython 3.11's "AST constructor
    # recursion depth mismatch" SystemError (a runtime error of the fuzzer, not of the gateway)
    requests = workdir / "requests.txt"
    env = {
        **os.environ,
        "SCHEMATHESIS_HOOKS": "fuzz_hooks",
        "MOONCAKE_FUZZ_REQUESTS": str(requests),
        "MOONCAKE_FUZZ_MODEL": model,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(HOOKS_DIR), os.environ.get("PYTHONPATH")])),
    }
    run = subprocess.run(argv, check=False, env=env, cwd=workdir, capture_output=True, text=True, timeout=240 + CASES)
    lines = requests.read_text().splitlines() if requests.exists() else []
    return run, [line.split(" ") for line in lines]


def test_fuzzed_requests_get_no_5xx_only_documented_responses_and_crash_nothing(cluster, gateway, tmp_path):
    before = processes(cluster)
    assert all(alive for _, _, alive in before.values()), before
    doc = httpx.get(f"{gateway}/openapi.json", timeout=30).json()
    documented = {f"{method.upper()} {path}" for path, item in doc["paths"].items() for method in item}
    with_body = sum("requestBody" in op for item in doc["paths"].values() for op in item.values())
    started = time.monotonic()
    run, requests = schemathesis_run(gateway, cluster.config.model_name, math.ceil(CASES / with_body), tmp_path)
    took = time.monotonic() - started

    histogram = Counter(status for _, _, status, _ in requests)
    per_operation: dict[str, Counter] = {}
    for method, path, status, _ in requests:
        operation = f"{method} {path}" if f"{method} {path}" in documented else "other methods (probes)"
        per_operation.setdefault(operation, Counter())[status] += 1
    streams = sum(1 for _, _, status, stream in requests if status == "200" and stream == "stream")
    generated = re.search(r"(\d+) generated", run.stdout)
    print(
        f"\nschemathesis: {generated.group(1) if generated else '?'} cases generated, {len(requests)} requests in "
        f"{took:.0f} s, {streams} of them streamed 200s; statuses {dict(sorted(histogram.items()))}"
    )
    for operation, counts in sorted(per_operation.items()):
        print(f"  {operation}: {dict(sorted(counts.items()))}")
    after = processes(cluster)
    print(f"  components (pid, restarts, alive) before: {before}\n  after: {after}")
    print(run.stdout[-2500:])

    assert after == before, "components died or restarted"
    assert run.returncode == 0, (
        f"schemathesis failed (exit {run.returncode}):\n{run.stdout[-20000:]}\n{run.stderr[-3000:]}"
    )
    assert not [s for s in histogram if s.startswith("5")], histogram
    assert len(requests) >= CASES, f"only {len(requests)} requests of the {CASES} asked for"
    assert streams > 0, "no stream was answered: the event-stream schema went unchecked"
