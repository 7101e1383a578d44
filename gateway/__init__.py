"""The agentstream gateway: an OpenAI-compatible proxy that records every model call to Kafka."""

from agentstream.gateway.app import create_app
from agentstream.gateway.settings import GatewaySettings

__all__ = ["GatewaySettings", "create_app"]
