"""The chat template of the local models: ChatML with hermes-style tool calls.

Neither the tiny model's ChatML template nor SmolLM2's own renders tools, so a tool-using agent
pointed at them would be answered by a model that never saw its tools. This template (one file,
`chat_templates/hermes_tools.jinja`) renders system, user, assistant and tool messages and the
tools list, and asks for tool calls in the form vLLM's `hermes` tool parser reads. It is written
into the model folder (`chat_template.jinja`, which transformers and vLLM both load), so every
server of the folder, and every tokenizer loaded from it, renders the same prompt.
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


def install_chat_template(folder: Path, default_system: str | None = None) -> Path:
    """Make the tool-rendering template the chat template of the model in `folder`; returns the file written."""
    folder = Path(folder)
    config_file = folder / "tokenizer_config.json"
    if not config_file.exists():
        raise FileNotFoundError(f"{folder} has no tokenizer_config.json: save the tokenizer there first")
    config = json.loads(config_file.read_text(encoding="utf-8"))
    if "chat_template" in config:  # the .jinja file wins in transformers; one template, in one place
        del config["chat_template"]
        config_file.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    target = folder / TEMPLATE_FILE
    target.write_text(tool_chat_template(default_system), encoding="utf-8")
    return target


def renders_tools(folder: Path) -> bool:
    """Whether the chat template in `folder` shows the model its tools (mentions `tools` at all)."""
    folder = Path(folder)
    template = folder / TEMPLATE_FILE
    if template.exists():
        return "tools" in template.read_text(encoding="utf-8")
    config_file = folder / "tokenizer_config.json"
    config = json.loads(config_file.read_text(encoding="utf-8")) if config_file.exists() else {}
    return "tools" in str(config.get("chat_template") or "")
