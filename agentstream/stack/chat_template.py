"""The chat template of the local models: ChatML with hermes-style tool calls.

Neither the tiny model's ChatML template nor SmolLM2's own renders tools, so a tool-using agent
pointed at them would be answered by a model that never saw its tools. This template (one file,
`chat_templates/hermes_tools.jinja`) renders system, user, assistant and tool messages and the
tools list, and asks for tool calls in the form vLLM's `hermes` tool parser reads. The model builders
(`agentstream.models`) give it to the tokenizer they save, so the model folder holds it
(`chat_template.jinja`, which transformers and vLLM both load), and every server of the folder, and
every tokenizer loaded from it, renders the same prompt.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

TOOL_CALL_PARSER = "hermes"
"""the vLLM tool parser that reads the calls this template asks for (`--tool-call-parser`)"""

TEMPLATE_FILE = "chat_template.jinja"
_SOURCE = resources.files("agentstream.stack").joinpath("chat_templates/hermes_tools.jinja")


def tool_chat_template(default_system: str | None = None) -> str:
    """The template's text; `default_system` is the system prompt of a conversation that has none."""
    template = _SOURCE.read_text(encoding="utf-8")
    if default_system is None:
        return template
    # a JSON string is a valid Jinja string literal
    return "{%- set default_system = " + json.dumps(default_system) + " -%}\n" + template


def renders_tools(folder: Path) -> bool:
    """Whether the chat template in `folder` shows the model its tools (mentions `tools` at all)."""
    folder = Path(folder)
    template = folder / TEMPLATE_FILE
    if template.exists():
        return "tools" in template.read_text(encoding="utf-8")
    config_file = folder / "tokenizer_config.json"
    config = json.loads(config_file.read_text(encoding="utf-8")) if config_file.exists() else {}
    return "tools" in str(config.get("chat_template") or "")
