"""Claude Code, the real CLI (`scripts/npm-tool.sh claude-code` installs the pinned npm package), as an agent of the gateway.

It is pointed at an attempt's scoped URL with that attempt's rollout token (`ANTHROPIC_BASE_URL`,
`ANTHROPIC_API_KEY`, which it sends as x-api-key), and runs one `claude -p` turn: its Messages requests,
with tools, streamed, with its beta fields and mid-conversation system message, must get answers (not
errors) from the tiny vLLM model, and each must be recorded as the attempt's call event with its token ids.
Nothing leaves the machine: the variables below turn off its update checks, telemetry and error reports.
The gateway fronts the harness server (the tiny model with a 32 K window): what the model writes varies with
the weights and the tests before, and a third call of Claude Code's can outgrow the 2048 byte-tokens of the
plain tiny server. The turn still carries a short system prompt and one MCP tool with a short description
(tests/gateway/claude_code_mcp.py) instead of the built-in tools (kilobytes each), so it stays quick.
Skipped when AGENTSTREAM_CLAUDE_CODE (the binary's path, printed by `scripts/npm-tool.sh claude-code`) is not set: `make test`
sets it.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest

from agentstream.schemas import CallEvent
from agentstream.schemas.tokens import mint_rollout_token
from tests.support.gateway import TOKEN_SECRET, gateway_settings, read_events, running_gateway

CLAUDE = os.environ.get("AGENTSTREAM_CLAUDE_CODE")
ROLLOUT, ATTEMPT = "0190d0c0-0000-5000-8000-00000000c1a0", "0190d0c0-0000-7000-8000-00000000c1a0"
QUIET = {  # nothing but the model calls: no update check, telemetry, error reports, or other traffic
    "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_AUTOUPDATER": "1", "DISABLE_TELEMETRY": "1",
    "DISABLE_ERROR_REPORTING": "1", "DISABLE_BUG_COMMAND": "1",
}

pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(not CLAUDE or not Path(CLAUDE).is_file(),
                                 reason="Claude Code is not installed: export AGENTSTREAM_CLAUDE_CODE=$(scripts/npm-tool.sh claude-code), as `make test` does")]


@pytest.fixture
async def gw(kafka, harness_vllm):
    async with running_gateway(gateway_settings(kafka, [f"tiny={harness_vllm.url}"])) as running:
        yield running


async def test_claude_code_turns_are_answered_and_recorded_with_their_tokens(gw, kafka, tmp_path: Path):
    work, home = tmp_path / "work", tmp_path / "home"
    work.mkdir()
    home.mkdir()
    mcp = tmp_path / "mcp.json"
    mcp.write_text(json.dumps({"mcpServers": {"weather": {
        "command": "python3", "args": [str(Path(__file__).with_name("claude_code_mcp.py"))]}}}))
    env = {"PATH": os.environ["PATH"], "HOME": str(home), **QUIET,
           "ANTHROPIC_BASE_URL": f"{gw.url}/rollouts/{ROLLOUT}/attempts/{ATTEMPT}",
           "ANTHROPIC_API_KEY": mint_rollout_token(TOKEN_SECRET, ROLLOUT, ATTEMPT),
           "ANTHROPIC_MODEL": "tiny", "ANTHROPIC_SMALL_FAST_MODEL": "tiny", "ANTHROPIC_DEFAULT_HAIKU_MODEL": "tiny",
           "CLAUDE_CODE_MAX_OUTPUT_TOKENS": "32", "MAX_THINKING_TOKENS": "0", "ENABLE_TOOL_SEARCH": "false",
           "CLAUDE_CODE_MAX_RETRIES": "0"}
    process = await asyncio.create_subprocess_exec(
        str(CLAUDE), "-p", "What is the weather in Rome?", "--output-format", "json", "--system-prompt", "Be brief.",
        "--tools", "", "--mcp-config", str(mcp), "--strict-mcp-config", "--setting-sources", "",
        cwd=work, env=env, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE)
    stdout, stderr = await asyncio.wait_for(process.communicate(), timeout=50)
    assert process.returncode == 0, (stdout + stderr).decode(errors="replace")[-3000:]
    result = json.loads(stdout)
    assert result["type"] == "result" and result["is_error"] is False, result

    calls = [event for event in await read_events(kafka, kafka.topics.calls, count=1)
             if isinstance(event, CallEvent)]
    assert calls, "no call recorded"
    for call in calls:
        data = call.data
        assert (call.rollout_id, call.attempt_id) == (ROLLOUT, ATTEMPT)
        assert (data.api, data.status, data.error, data.streamed) == ("messages", 200, None, True)
        assert [tool["name"] for tool in data.request["tools"]] == ["mcp__weather__weather"]
        assert data.prompt_token_ids and data.completion_token_ids and data.response
        assert data.response["role"] == "assistant" and data.response["content"]
