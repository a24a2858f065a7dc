"""Decode worker (DESIGN §3): receives a prompt's KV from a prefill worker, decodes in a continuous batch.

    python -m decode --model DIR --conductor HOST:PORT   (or: mooncake serve decode)

worker.py serves a request (landing slots, the prefill call, the engine); server.py is
the gRPC service, metrics and the Conductor link.
"""
