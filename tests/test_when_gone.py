"""A handler that asks to hear of its caller leaving after the caller already left: ``when_gone`` runs the cleanup at
once. grpc's ``add_callback`` returns False, and never calls the callback, for a call already over: a prefill whose
caller left between its handler's start and that line would run whole, for nobody. A real gRPC server."""

from __future__ import annotations

import threading
import time
from concurrent import futures

import grpc

from mooncake.runtime.process import when_gone


def test_a_call_whose_caller_left_before_it_asked_is_seen_gone_at_once():
    started, left, gone = threading.Event(), threading.Event(), threading.Event()

    def handle(request: bytes, context) -> bytes:
        started.set()
        left.wait(10)
        while context.is_active():  # the cancel reaches the server
            time.sleep(0.01)
        when_gone(context, gone.set)
        return b""

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    handler = grpc.unary_unary_rpc_method_handler(handle)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("t", {"M": handler}),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.unary_unary("/t/M").future(b"")
            assert started.wait(10)
            call.cancel()  # the caller leaves while the handler runs, before it asks to hear of it
            left.set()
            assert gone.wait(5)  # the cleanup ran at once (add_callback alone would never call it)
    finally:
        server.stop(0)
