"""Prefill worker (DESIGN §3): prefix load from the pool, chunked + layer-wise prefill, KV streamed to decode and the
pool.

    python -m prefill --model DIR --kvstore HOST:PORT --conductor HOST:PORT   (or: mooncake serve prefill)

worker.py runs a request (the pool, the engine); connector.py moves each layer's KV;
server.py is the gRPC service, metrics and the Conductor link.
"""
