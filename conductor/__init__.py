"""The Conductor (DESIGN §5): registry, global KV index, scheduling policies, early rejection.

Not built yet (issue 4). The engine's block keys (mooncake/blocks.py) are what its index
will hold.
"""
