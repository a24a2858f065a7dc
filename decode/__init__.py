"""Decode worker (DESIGN §3): KV receive, continuous batching under a TBT budget.

Not built yet (issue 5). It will import landed KV with LLMEngine.add_request(external_kv=...).
"""
