"""Run in the vLLM environment (it imports vllm): vLLM's own tool parser over a model's text.

stdin: {"model": folder, "parser": name, "tools": [...chat tools], "text": the assistant's text}.
stdout: {"whole": what the parser makes of the whole text (as for a plain answer), "streamed": the
calls it streams when the text arrives one token at a time (as for a streamed answer)}.
"""

from __future__ import annotations

import json
import sys

from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.tokenizers import get_tokenizer
from vllm.tool_parsers import ToolParserManager


def main() -> None:
    job = json.load(sys.stdin)
    tokenizer = get_tokenizer(job["model"])
    parser_class = ToolParserManager.get_tool_parser(job["parser"])
    request = ChatCompletionRequest(model="tiny", messages=[{"role": "user", "content": "-"}], tools=job["tools"],
                                    tool_choice="auto")
    parser = parser_class(tokenizer, request.tools)
    request = parser.adjust_request(request)
    whole = parser.extract_tool_calls(job["text"], request)

    streamer = parser_class(tokenizer, request.tools)
    ids = tokenizer.encode(job["text"], add_special_tokens=False)
    calls: dict[int, dict] = {}
    content, previous = "", ""
    for end in range(1, len(ids) + 1):
        current = tokenizer.decode(ids[:end])
        delta = streamer.extract_tool_calls_streaming(previous, current, current[len(previous):], ids[:end - 1],
                                                      ids[:end], ids[end - 1:end], request)
        previous = current
        if delta is None:
            continue
        content += delta.content or ""
        for call in delta.tool_calls:
            entry = calls.setdefault(call.index, {"name": "", "arguments": ""})
            function = call.function or {}
            function = function if isinstance(function, dict) else function.model_dump()
            entry["name"] += function.get("name") or ""
            entry["arguments"] += function.get("arguments") or ""
    json.dump({
        "whole": {"tools_called": whole.tools_called, "content": whole.content,
                  "calls": [{"name": c.function.name, "arguments": c.function.arguments} for c in whole.tool_calls]},
        "streamed": {"content": content, "calls": [calls[i] for i in sorted(calls)]},
        "skip_special_tokens": request.skip_special_tokens,
    }, sys.stdout)


if __name__ == "__main__":
    main()
