"""The agentstream gateway: an OpenAI-compatible proxy that records every model call to Kafka."""

from gateway.app import create_app
from gateway.settings import GatewaySettings

__all__ = ["create_app", "GatewaySettings"]
