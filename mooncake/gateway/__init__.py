"""The OpenAI-compatible HTTP gateway: FastAPI routes over any GenerationBackend (mooncake.serving.types)."""

from mooncake.gateway.app import GatewayConfig, create_app

__all__ = ["GatewayConfig", "create_app"]
