"""A one-tool MCP server (stdio, newline-delimited JSON-RPC) for Claude Code in tests/gateway/test_claude_code.py.

Claude Code's built-in tools come with descriptions of kilobytes each; the tiny test model reads bytes
and has 2048 positions, so the test gives Claude Code this tool alone, described in a few words.
"""

import json
import sys

TOOL = {"name": "weather", "description": "Weather in a city.",
        "inputSchema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}

for line in sys.stdin:
    message = json.loads(line)
    if "id" not in message:
        continue  # a notification
    method, result = message.get("method"), {}
    if method == "initialize":
        result = {"protocolVersion": message["params"]["protocolVersion"], "capabilities": {"tools": {}},
                  "serverInfo": {"name": "weather", "version": "1"}}
    elif method == "tools/list":
        result = {"tools": [TOOL]}
    elif method == "tools/call":
        result = {"content": [{"type": "text", "text": "sunny"}]}
    print(json.dumps({"jsonrpc": "2.0", "id": message["id"], "result": result}), flush=True)
