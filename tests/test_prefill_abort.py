"""Prefill.Abort on a call whose caller left before the worker sent it anything.

The abort storm of tests/test_chaos.py left a decode worker's cache blocks held for good, about one fresh run in
three: the prefill worker registered a call, then ``send_initial_metadata`` raised (grpc raises an RpcError there once
the caller has cancelled), and the registration stayed with its "ended" never set, so every Abort of that call waited
its 2 s and answered "not stopped", and the decode worker's write fence kept the blocks. That moment (a cancellation
that lands between a call's arrival and its first metadata) cannot be caused on purpose through a real channel, so the
servicer is called here with a context that behaves as grpc's does for a caller already gone.
"""

from __future__ import annotations

import time

import grpc
import pytest

from prefill.server import PrefillMetrics, PrefillServicer
from protos import worker_pb2 as wpb


class GoneCaller:
    """A ServicerContext whose caller has cancelled: as grpc/_server.py's _Context then, send_initial_metadata raises
    an RpcError and add_callback refuses (the callback would never run)."""

    def send_initial_metadata(self, metadata) -> None:
        raise grpc.RpcError()

    def add_callback(self, fn) -> bool:
        return False

    def abort(self, code, details):
        raise grpc.RpcError(f"{code}: {details}")


def test_an_abort_of_a_call_whose_caller_left_before_its_first_metadata_answers_stopped_at_once():
    servicer = PrefillServicer(worker=None, metrics=PrefillMetrics())  # the worker is never reached
    request = wpb.PrefillRequest(request_id="gone", prompt_token_ids=[5, 6, 7], landing=wpb.Landing(token="t-1"))
    with pytest.raises(grpc.RpcError):
        servicer.Prefill(request, GoneCaller())
    t0 = time.monotonic()
    answer = servicer.Abort(wpb.AbortRequest(request_id="gone", landing_token="t-1"), GoneCaller())
    assert answer.stopped and answer.writer == servicer.identity
    assert time.monotonic() - t0 < 1.0  # not the 2 s wait for a call that never ends
