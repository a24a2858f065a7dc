"""Command-line interface: the ``mooncake`` console script."""
