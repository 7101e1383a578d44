"""The APIs the gateway serves, one `Adapter` each (see `gateway.adapter`)."""

from __future__ import annotations

from agentstream.gateway.adapter import Adapter
from agentstream.gateway.chat import ChatCompletions
from agentstream.gateway.completions import Completions
from agentstream.gateway.messages import Messages
from agentstream.gateway.responses import Responses

ADAPTERS: dict[str, Adapter] = {
    adapter.api: adapter for adapter in (ChatCompletions(), Completions(), Responses(), Messages())
}
