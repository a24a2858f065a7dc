"""mooncake.serving.status: the one table between a worker's failures, their gRPC codes and the client's HTTP error."""

from __future__ import annotations

import grpc
import pytest

from kvstore.errors import KVStoreUnavailable
from mooncake.serving.status import REQUEST_CODES, WORKER_STATUS, Busy, Cancelled, Unreachable, client_error
from mooncake.serving.types import InvalidRequest, Rejected, Unavailable
from transfer import TransferError


@pytest.mark.parametrize(
    "error, code",
    [
        (ValueError("max_tokens must be at least 1"), grpc.StatusCode.INVALID_ARGUMENT),
        (Busy("over the TBT SLO", "tbt_slo"), grpc.StatusCode.RESOURCE_EXHAUSTED),
        (Unreachable("the cache is on another host"), grpc.StatusCode.FAILED_PRECONDITION),
        (Cancelled("the caller left"), grpc.StatusCode.CANCELLED),
        (KVStoreUnavailable("kv-0 is gone"), grpc.StatusCode.UNAVAILABLE),
        (TransferError("peer reset"), grpc.StatusCode.UNAVAILABLE),
        (RuntimeError("draining"), grpc.StatusCode.UNAVAILABLE),
    ],
)
def test_a_workers_failure_crosses_the_wire_as_its_code(error, code):
    assert WORKER_STATUS.code_of(error) is code


def test_a_bug_is_no_designed_failure():
    assert WORKER_STATUS.code_of(AttributeError("oops")) is None  # gRPC answers UNKNOWN, the gateway a 500


def test_the_client_hears_a_refusal_with_its_reason_and_when_to_retry():
    e = client_error(grpc.StatusCode.RESOURCE_EXHAUSTED, "tbt_slo: over the TBT SLO", "decode worker d0", 2.5)
    assert isinstance(e, Rejected) and (e.status, e.code, e.retry_after_s) == (429, "tbt_slo", 2.5)
    e = client_error(grpc.StatusCode.RESOURCE_EXHAUSTED, "full", "decode worker d0")
    assert (e.code, e.retry_after_s) == ("overloaded", 1.0)


def test_the_client_hears_bad_input_as_400_and_a_lost_worker_as_503_naming_it():
    e = client_error(grpc.StatusCode.INVALID_ARGUMENT, "the prompt is empty", "decode worker d0")
    assert isinstance(e, InvalidRequest) and (e.status, e.message) == (400, "the prompt is empty")
    e = client_error(grpc.StatusCode.UNAVAILABLE, "connection reset", "decode worker d0")
    assert isinstance(e, Unavailable) and e.status == 503
    assert e.message == "decode worker d0 failed: UNAVAILABLE connection reset"


def test_what_a_client_is_told_as_its_own_fault_a_decode_worker_passes_on_as_is():
    told = {code for code in grpc.StatusCode if WORKER_STATUS.caught.get(code) in (InvalidRequest, Rejected)}
    assert told <= REQUEST_CODES
    assert grpc.StatusCode.UNAVAILABLE not in REQUEST_CODES  # the prefill worker's failure: answered naming it
