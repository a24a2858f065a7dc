"""KV cache pool node (DESIGN §6): DRAM and SSD tiers, eviction, leases, checksums.

Not built yet (issue 3). Blocks are stored in the layout LLMEngine.export_kv returns.
"""
