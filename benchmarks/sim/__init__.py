"""The cluster simulator: the Mooncake trace replayed on simulated prefill and decode instances, every decision made
by the real Conductor (conductor.core). Run it from the repository's root:

    python -m benchmarks.sim --help

- ``model``: the simulated hardware and model (costs), the trace, a node's cache tiers;
- ``cluster``: instances, the event loop, what a real cluster would report to the Conductor;
- ``cli``: one simulation from the command line, its summary, table and plot;
- ``paper``: the paper's three experiments (``--reproduce``).
"""
