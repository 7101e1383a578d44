"""The APIs the gateway serves, one `Adapter` each (see `gateway.adapter`)."""

from __future__ import annotations

from gateway.adapter import Adapter
from gateway.chat import ChatCompletions
from gateway.completions import Completions
from gateway.messages import Messages
from gateway.responses import Responses

ADAPTERS: dict[str, Adapter] = {
    adapter.api: adapter for adapter in (ChatCompletions(), Completions(), Responses(), Messages())
}
