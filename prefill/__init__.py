"""Prefill worker (DESIGN §3): prefix load, chunked + layer-wise prefill, KV streaming.

Not built yet (issue 5). It will drive mooncake.engine.LLMEngine through the layer hooks
of mooncake/engine/connector.py.
"""
