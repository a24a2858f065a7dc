"""Schemathesis hooks for tests/test_fuzz.py, loaded by the ``schemathesis`` CLI through ``SCHEMATHESIS_HOOKS``.

- the check ``openai_error_body``: every 4xx body is OpenAI's ``{"error": {"message": str, "type": str, ...}}``;
- ``before_call`` steers what the generator rarely reaches on its own, changing the body only where it names a
  string ``model``, sends an empty ``prompt`` or leaves ``stream`` unset (invalid bodies stay invalid):
  - the served model (``MOONCAKE_FUZZ_MODEL``) instead of the generated name, and ``"hello"`` instead of an empty
    prompt, except in every ``KEEP_EVERY``-th request (a random name is a 404 before anything else is looked at;
    the coverage phase sends ``prompt: ""`` with every boundary value of the other fields, a 400 each);
  - ``stream: true`` in every ``STREAM_EVERY``-th completion request, half of them with usage (the generator
    draws the ``null`` of ``bool | null`` nearly always: 0 streams in 100 valid chat requests);
- ``after_call``: one line per request, ``METHOD path status stream|-``, appended to the file
  ``MOONCAKE_FUZZ_REQUESTS`` names (when set), which the test reads back for the count and the statuses.
"""

from __future__ import annotations

import json
import os
import threading

import schemathesis

KEEP_EVERY = 8
STREAM_EVERY = 3
COMPLETIONS = frozenset({"/v1/chat/completions", "/v1/completions"})

_lock = threading.Lock()  # the CLI's workers are threads
_calls = 0


def _is_openai_error(body: object) -> bool:
    error = body.get("error") if isinstance(body, dict) else None
    return isinstance(error, dict) and isinstance(error.get("message"), str) and isinstance(error.get("type"), str)


@schemathesis.check
def openai_error_body(ctx, response, case) -> None:
    """A 4xx must carry ``{"error": {"message": <str>, "type": <str>, "param": ..., "code": ...}}``."""
    if not 400 <= response.status_code < 500:
        return
    try:
        body = json.loads(response.content)
    except ValueError:
        raise AssertionError(
            f"{response.status_code} with a body that is not JSON: {response.content[:200]!r}"
        ) from None
    if not _is_openai_error(body):
        raise AssertionError(f"{response.status_code} without OpenAI's error object: {response.content[:200]!r}")


@schemathesis.hook
def before_call(ctx, case, kwargs) -> None:
    global _calls
    with _lock:
        _calls += 1
        n = _calls
    body = case.body
    if not isinstance(body, dict):
        return
    model = os.environ.get("MOONCAKE_FUZZ_MODEL")
    if n % KEEP_EVERY:
        if model and isinstance(body.get("model"), str):
            body["model"] = model
        if body.get("prompt") == "":
            body["prompt"] = "hello"
    if case.path in COMPLETIONS and body.get("stream") is None and n % STREAM_EVERY == 0:
        body["stream"] = True
        if "stream_options" not in body and n % (2 * STREAM_EVERY) == 0:
            body["stream_options"] = {"include_usage": True}


@schemathesis.hook
def after_call(ctx, case, response) -> None:
    path = os.environ.get("MOONCAKE_FUZZ_REQUESTS")
    if path:
        stream = "stream" if isinstance(case.body, dict) and case.body.get("stream") is True else "-"
        with _lock, open(path, "a") as f:
            f.write(f"{case.method} {case.path} {response.status_code} {stream}\n")
