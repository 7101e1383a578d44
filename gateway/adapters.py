"""The APIs the gateway serves, one `Adapter` each (see `gateway.capture`)."""

from __future__ import annotations

from gateway.capture import Adapter, ChatCompletions, Completions
from gateway.messages import Messages
from gateway.responses import Responses

ADAPTERS: dict[str, Adapter] = {
    adapter.api: adapter for adapter in (ChatCompletions(), Completions(), Responses(), Messages())
}
