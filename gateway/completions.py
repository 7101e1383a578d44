"""The OpenAI completions API (`POST /v1/completions`), proxied to the upstream's own; as chat completions
(`gateway.chat`), with a prompt instead of messages and the logprobs of completions' shape."""

from __future__ import annotations

from typing import Any

from agentstream.gateway import fields
from agentstream.gateway.adapter import Adapter, Body, Capture, Rewrite, StreamAssembler, Tokens, blank, tokens_of
from agentstream.gateway.chat.request import check_sampling, rewrite_openai
from agentstream.gateway.fields import bad_request


def check(body: Body) -> None:
    check_sampling(body)
    prompt = body.get("prompt")
    if not _is_prompt(prompt):
        raise bad_request("'prompt' is required: a string, a list of strings, a list of token ids, or a list of "
                          "lists of token ids")
    fields.flag(body, "echo")
    if body.get("logprobs") is not False:  # completions' `logprobs` is a count of alternatives
        fields.integer(body, "logprobs", 0, 20)


def _is_prompt(prompt: Any) -> bool:
    if isinstance(prompt, str):
        return True
    if not isinstance(prompt, list) or not prompt:
        return False
    return (all(isinstance(item, str) for item in prompt) or all(_is_ids(item) for item in prompt)
            or _is_ids(prompt))


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in value)


class Completions(Adapter):
    api = "completions"
    path = "/v1/completions"

    def check(self, body: Body) -> None:
        check(body)

    def rewrite(self, body: Body, training: bool) -> Rewrite:
        # completions' `logprobs` is a count of alternatives; 0 returns the sampled token's logprob alone
        asked = body.get("logprobs") is not None and body.get("logprobs") is not False
        return rewrite_openai(body, training, logprobs_asked=asked, logprobs_value=0)

    def finish(self, response: Body, rewrite: Rewrite) -> Tokens:
        choices: dict[int, Capture] = {}
        prompt = None
        for choice in response.get("choices") or []:
            index = choice.get("index", 0)
            captured = choices[index] = Capture(finish_reason=choice.get("finish_reason"))
            captured.add(choice.get("token_ids"), (choice.get("logprobs") or {}).get("token_logprobs"))
            if index == 0:
                prompt = choice.get("prompt_token_ids")
            if rewrite.strip_token_ids:
                blank(choice, "token_ids")
                blank(choice, "prompt_token_ids")
            if rewrite.strip_logprobs:
                blank(choice, "logprobs")
        return tokens_of(prompt, choices, response.get("usage"))

    def assembler(self, rewrite: Rewrite) -> StreamAssembler:
        return CompletionsAssembler(rewrite)


class CompletionsAssembler(StreamAssembler):
    def __init__(self, rewrite: Rewrite):
        super().__init__(rewrite)
        self._head: Body = {}
        self._out: dict[int, Body] = {}

    def _capture(self, chunk: Body) -> None:
        for choice in chunk.get("choices") or []:
            index = choice.get("index", 0)
            if index == 0 and choice.get("prompt_token_ids") is not None:
                self._prompt = choice["prompt_token_ids"]
            ids = choice.get("token_ids")
            self.choice(index).add(ids, (choice.get("logprobs") or {}).get("token_logprobs"))
            if ids or choice.get("text"):
                self.tokens_seen = True
            self.note_finish(index, choice.get("finish_reason"))

    def _strip(self, chunk: Body) -> None:
        for choice in chunk.get("choices") or []:
            if self.rewrite.strip_token_ids:
                blank(choice, "token_ids")
                blank(choice, "prompt_token_ids")
            if self.rewrite.strip_logprobs:
                blank(choice, "logprobs")

    def _merge(self, chunk: Body) -> None:
        for key in ("id", "created", "model", "system_fingerprint"):
            if chunk.get(key) is not None:
                self._head[key] = chunk[key]
        for choice in chunk.get("choices") or []:
            out = self._out.setdefault(choice.get("index", 0), {"text": "", "logprobs": None, "finish_reason": None})
            out["text"] += choice.get("text") or ""
            logprobs = choice.get("logprobs")
            if logprobs:
                merged = out["logprobs"] = out["logprobs"] or {}
                for key, values in logprobs.items():
                    if isinstance(values, list):
                        merged[key] = merged.get(key, []) + values
            for key in ("finish_reason", "stop_reason"):
                if choice.get(key) is not None:
                    out[key] = choice[key]

    def response(self) -> Body:
        choices = [{"index": index, **out} for index, out in sorted(self._out.items())]
        return {**self._head, "object": "text_completion", "choices": choices, "usage": self._agent_usage}
