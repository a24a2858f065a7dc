"""Stock vLLM as a worker engine: ``VllmEngine`` (engine.py), its KV connector (connector.py), the layout (layout.py).

Importing this package does not import vLLM; ``mooncake.serving.engines.build_engine``
imports ``engine.py`` only for ``--engine vllm``.
"""
