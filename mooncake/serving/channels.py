"""gRPC channel options for calls between components that restart (the launcher and Kubernetes bring them back).

gRPC's default reconnect backoff grows from 1 s to 120 s: a channel to a component that was
down for a few seconds keeps failing calls fast for up to two minutes after it is back. Calls
here retry on their own schedule (mooncake.serving.recovery, the Conductor link's loop), so
the channel should try to reconnect about as often as they do.
"""

from __future__ import annotations

RECONNECT_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
)
