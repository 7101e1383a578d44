"""The tools of a Responses request as a chat model gets them, and the model's calls mapped back.

- A function tool is a chat function; a custom (freeform) tool, such as Codex's `apply_patch`, is a
  function of one string, `input` (with the tool's grammar, if any, in its description).
- A namespace (Codex 0.171 groups its multi-agent tools as `multi_agent_v1`) is flattened: each of its
  tools is a chat function named `<namespace>__<name>`, and a call to that name comes back as the
  Responses API returns a namespaced call (`name` the tool's own, `namespace` the group). Calls in the
  input history that carry a `namespace` are given to the model under the flat name again.
- A hosted tool (`web_search`, `file_search`, `code_interpreter`, `image_generation`, `computer_use`,
  `mcp`, `tool_search`) runs on OpenAI's servers, which are not behind this gateway: no model here can
  use one, so it is left out of what the model is given and the call goes on with the agent's other
  tools. The agent's request, recorded in the call event, still lists it; the gateway logs each kind
  once per process. Codex sends `web_search` on every turn unless its config turns it off.
- Client-executed built-ins with call items of their own (`local_shell`, `shell`, `apply_patch`) are a
  400: their calls are not function calls, and the agent would wait for items this gateway cannot write.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from agentstream.gateway.fields import bad_request, list_of, object_of, text_of
from agentstream.gateway.translation import note_dropped
from agentstream.schemas.conversation import SEPARATOR, flat_name

if TYPE_CHECKING:  # the SDK's shapes, for the type checker only
    from openai.types.chat import ChatCompletionFunctionToolParam
    from openai.types.shared_params import FunctionDefinition

HOSTED = ("web_search", "file_search", "code_interpreter", "image_generation", "computer_use", "mcp", "tool_search")
"""prefixes of the types of hosted tools (`web_search_preview_2025_03_11`, `computer_use_preview`, …)"""
CUSTOM_INPUT: dict[str, object] = {
    "type": "object", "properties": {"input": {"type": "string", "description": "the tool's input"}},
    "required": ["input"]}


@dataclass(frozen=True)
class ToolName:
    """A tool as the agent named it, for a flat name the model calls."""

    name: str
    namespace: str | None = None
    custom: bool = False


def is_hosted(kind: object) -> bool:
    return isinstance(kind, str) and kind.startswith(HOSTED)


def chat_tools(tools: Any) -> list[ChatCompletionFunctionToolParam]:
    """The chat functions for a request's `tools`; a 400 for a tool that is malformed or cannot be served."""
    functions: list[ChatCompletionFunctionToolParam] = []
    seen: dict[str, str] = {}
    for index, tool in enumerate(list_of(tools, "tools")):
        where = f"tools[{index}]"
        tool = object_of(tool, where)
        kind = tool.get("type")
        entries: list[tuple[dict[str, Any], str, str | None]]
        if kind == "namespace":
            group = text_of(tool.get("name"), f"{where}.name")
            members = list_of(tool.get("tools"), f"{where}.tools")
            entries = [(object_of(member, f"{where}.tools[{i}]"), f"{where}.tools[{i}]", group)
                       for i, member in enumerate(members)]
        elif is_hosted(kind):
            note_dropped(str(kind))
            continue
        else:
            entries = [(tool, where, None)]
        for entry, at, namespace in entries:
            function = _function(entry, at, namespace)
            name = function["function"]["name"]
            if name in seen:
                raise bad_request(f"{at}: the tool name {name!r} is taken by {seen[name]} (a namespaced tool is "
                                  f"given to the model as <namespace>{SEPARATOR}<name>); rename one of them")
            seen[name] = at
            functions.append(function)
    return functions


def _function(tool: dict[str, Any], where: str, namespace: str | None) -> ChatCompletionFunctionToolParam:
    if tool.get("type") not in ("function", "custom"):
        inside = " inside a namespace" if namespace else ""
        raise bad_request(f"{where}: tools of type {tool.get('type')!r}{inside} are not supported by this gateway "
                          "(function, custom and namespace tools are; hosted tools such as web_search are left "
                          "out of what the model sees)")
    name = flat_name(text_of(tool.get("name"), f"{where}.name"), namespace)
    if tool.get("type") == "custom":
        return {"type": "function", "function": {"name": name, "description": _custom_description(tool, where),
                                                 "parameters": CUSTOM_INPUT}}
    function: FunctionDefinition = {"name": name}
    if tool.get("description") is not None:
        function["description"] = text_of(tool["description"], f"{where}.description")
    if tool.get("parameters") is not None:
        function["parameters"] = object_of(tool["parameters"], f"{where}.parameters")
    if tool.get("strict") is not None:
        function["strict"] = tool["strict"]
    return {"type": "function", "function": function}


def _custom_description(tool: dict[str, Any], where: str) -> str:
    """A custom tool's description, with the grammar its input follows, if it names one."""
    description = tool.get("description") or ""
    form = object_of(tool.get("format") or {}, f"{where}.format")
    if form.get("type") == "grammar" and form.get("definition"):
        description += (f"\n\nThe input follows this {form.get('syntax') or ''} grammar:\n"
                        f"{text_of(form['definition'], f'{where}.format.definition')}")
    return description


def tool_names(request: dict[str, Any]) -> dict[str, ToolName]:
    """Flat name → the agent's tool, for the function and custom tools of an already translated request
    (its calls are answered as the agent's own kinds of call items)."""
    names: dict[str, ToolName] = {}
    tools = request.get("tools")
    for tool in tools if isinstance(tools, list) else []:
        if not isinstance(tool, dict):
            continue
        if tool.get("type") == "namespace" and isinstance(tool.get("name"), str):
            members = tool["tools"] if isinstance(tool.get("tools"), list) else []
            entries: list[tuple[dict[str, Any], str | None]] = [
                (member, tool["name"]) for member in members if isinstance(member, dict)]
        else:
            entries = [(tool, None)]
        for entry, namespace in entries:
            if entry.get("type") in ("function", "custom") and isinstance(entry.get("name"), str):
                names[flat_name(entry["name"], namespace)] = ToolName(entry["name"], namespace,
                                                                      entry["type"] == "custom")
    return names


def agent_tool(names: dict[str, ToolName], called: str) -> ToolName:
    """The agent's tool for the name the model called (a name the agent never offered stays as it is)."""
    return names.get(called) or ToolName(called)
