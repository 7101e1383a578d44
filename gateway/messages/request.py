"""A Messages request as a chat completions request, the way vLLM's own /v1/messages translates it.

The conversation becomes chat messages by `schemas.conversation.anthropic_messages` (the system prompt
one leading system message, `tool_use` blocks the assistant's tool calls, each `tool_result` a `tool`
message, thinking the assistant's `reasoning`), which replay's dataset rows use too. Unlike vLLM,
a final assistant message is a prefill the answer continues, as the Messages API defines. Fields
the Messages API does not define (vLLM's `seed`, `allowed_token_ids`...) pass through to the
chat request.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from agentstream.gateway import fields
from agentstream.gateway.adapter import Body
from agentstream.gateway.fields import bad_request, list_of, object_of, text_of
from agentstream.gateway.translation import note_dropped
from agentstream.schemas.conversation import BadConversation, anthropic_messages

if TYPE_CHECKING:  # the SDK's shapes, for the type checker only
    from openai.types.chat import ChatCompletionFunctionToolParam
    from openai.types.shared_params import FunctionDefinition

# the Messages API's own fields: translated below, or (no chat equivalent) not sent upstream
_MESSAGES_FIELDS = frozenset({
    "model", "messages", "max_tokens", "system", "stop_sequences", "temperature", "top_p", "top_k", "tools",
    "tool_choice", "thinking", "output_config", "stream", "metadata", "service_tier", "cache_control", "container",
    "inference_geo", "speed", "diagnostics", "user_profile_id", "workspace_id", "context_management", "mcp_servers",
})

_SERVER_TOOLS = ("web_search_", "web_fetch_", "code_execution_")
"""type prefixes of Anthropic's server tools (`web_search_20250305`, …)"""
# what of the chat request vLLM's /tokenize takes to render the same prompt
_TOKENIZE_FIELDS = ("model", "messages", "tools", "add_generation_prompt", "continue_final_message", "chat_template",
                    "chat_template_kwargs")



def check(body: Body) -> None:
    """A 400 for each field of a Messages request the gateway or vLLM reads, if it is malformed."""
    fields.flag(body, "stream")
    fields.number(body, "temperature", 0, 1)
    fields.number(body, "top_p", 0, 1)
    fields.integer(body, "top_k", 0)
    fields.texts(body, "stop_sequences")
    fields.optional_object(body, "metadata")
    fields.integer(body, "seed", -(2**63), 2**64 - 1)
    system = body.get("system")
    if system is not None and not isinstance(system, (str, list)):
        raise bad_request(f"'system' must be a string or a list of text blocks, not {type(system).__name__}")


def to_chat(body: Body) -> Body:
    if body.get("mcp_servers"):
        raise bad_request("'mcp_servers' is not supported by this gateway: give the agent the tools itself")
    max_tokens = body.get("max_tokens")
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise bad_request(f"'max_tokens' is required: a positive integer, not {max_tokens!r}")
    chat = {key: value for key, value in body.items() if key not in _MESSAGES_FIELDS}
    chat["model"] = body["model"]
    chat["max_tokens"] = max_tokens
    try:
        chat["messages"] = anthropic_messages(body.get("system"), body.get("messages"))
    except BadConversation as exc:
        raise bad_request(str(exc)) from None
    last = chat["messages"][-1]
    if last["role"] == "assistant" and last.get("content") and not last.get("tool_calls"):
        # a prefill: the answer continues the assistant's text
        chat["continue_final_message"], chat["add_generation_prompt"] = True, False
    for ours, theirs in (("stop_sequences", "stop"), ("temperature", "temperature"), ("top_p", "top_p"),
                         ("top_k", "top_k")):
        if body.get(ours) is not None:
            chat[theirs] = body[ours]
    if body.get("tools"):
        tools = [object_of(tool, f"tools[{i}]") for i, tool in enumerate(list_of(body["tools"], "tools"))]
        kept = [(tool, f"tools[{i}]") for i, tool in enumerate(tools) if not _is_server_tool(tool)]
        if kept:
            chat["tools"] = [_tool(tool, where) for tool, where in kept]
    if body.get("tool_choice") is not None and (body.get("tools") is None or "tools" in chat):
        _tool_choice(object_of(body["tool_choice"], "tool_choice"), chat)
    _thinking(body, chat)
    if body.get("stream") is True:
        chat["stream"] = True
        # usage on every chunk: message_start tells the input tokens, message_delta the output tokens
        chat["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    return chat


def tokenize_request(body: Body) -> Body:
    """The upstream `/tokenize` request for a `count_tokens` body: the prompt of the chat request a
    `/v1/messages` call with this body sends (count_tokens has no `max_tokens`; it changes no prompt)."""
    chat = to_chat({**body, "max_tokens": 1})
    return {key: chat[key] for key in _TOKENIZE_FIELDS if key in chat}


def _is_server_tool(tool: dict[str, Any]) -> bool:
    """A tool Anthropic's servers run (web search, web fetch, code execution): no model behind this gateway
    can use one, so it is left out of what the model sees (as hosted tools of the Responses API are)."""
    kind = tool.get("type")
    if isinstance(kind, str) and kind.startswith(_SERVER_TOOLS):
        note_dropped(kind)
        return True
    return False


def _tool(tool: dict[str, Any], where: str) -> ChatCompletionFunctionToolParam:
    if tool.get("type") not in (None, "custom"):
        raise bad_request(f"{where}: Anthropic-defined tools ({tool.get('type')!r}) are not supported by this "
                          "gateway; define the tool with a name and an input_schema")
    schema = dict(object_of(tool.get("input_schema"), f"{where}.input_schema"))
    schema.setdefault("type", "object")
    function: FunctionDefinition = {"name": text_of(tool.get("name"), f"{where}.name"), "parameters": schema}
    if tool.get("description") is not None:
        function["description"] = text_of(tool["description"], f"{where}.description")
    if tool.get("strict") is not None:
        function["strict"] = tool["strict"]
    return {"type": "function", "function": function}


def _tool_choice(choice: dict[str, Any], chat: dict[str, Any]) -> None:
    kind = choice.get("type")
    if kind in ("auto", "none"):
        chat["tool_choice"] = kind
    elif kind == "any":
        chat["tool_choice"] = "required"
    elif kind == "tool":
        name = text_of(choice.get("name"), "tool_choice.name")
        chat["tool_choice"] = {"type": "function", "function": {"name": name}}
    else:
        raise bad_request(f"tool_choice.type must be auto, any, tool or none, not {kind!r}")
    if choice.get("disable_parallel_tool_use") is not None:
        chat["parallel_tool_calls"] = not choice["disable_parallel_tool_use"]


def _thinking(body: dict[str, Any], chat: dict[str, Any]) -> None:
    """Extended thinking and output settings, as vLLM maps them."""
    thinking = object_of(body.get("thinking") or {}, "thinking")
    if thinking.get("type") == "enabled":
        chat["thinking_token_budget"] = thinking.get("budget_tokens")
    elif thinking.get("type") == "disabled":
        chat["reasoning_effort"] = "none"
    config = object_of(body.get("output_config") or {}, "output_config")
    if config.get("effort") is not None:
        chat["reasoning_effort"] = config["effort"]
    form = object_of(config.get("format") or {}, "output_config.format")
    if form.get("schema") is not None:
        chat["response_format"] = {"type": "json_schema", "json_schema": {"name": "json_schema",
                                                                          "schema": form["schema"]}}

