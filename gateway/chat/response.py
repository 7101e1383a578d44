"""A chat completion (not streamed): its tokens captured, and what the agent did not ask for blanked."""

from __future__ import annotations

from typing import Any

from agentstream.gateway.adapter import Body, Capture, Rewrite, Tokens, blank, tokens_of


def logprobs_of(logprobs: Any) -> list[float] | None:
    """The sampled tokens' logprobs of a choice's `logprobs` (None when it has none)."""
    if not isinstance(logprobs, dict) or logprobs.get("content") is None:
        return None
    return [entry.get("logprob") for entry in logprobs["content"]]


def finish(response: Body, rewrite: Rewrite) -> Tokens:
    choices: dict[int, Capture] = {}
    for choice in response.get("choices") or []:
        captured = choices[choice.get("index", 0)] = Capture(finish_reason=choice.get("finish_reason"))
        captured.add(choice.get("token_ids"), logprobs_of(choice.get("logprobs")))
        if rewrite.strip_token_ids:
            blank(choice, "token_ids")
        if rewrite.strip_logprobs:
            blank(choice, "logprobs")
    tokens = tokens_of(response.get("prompt_token_ids"), choices, response.get("usage"))
    if rewrite.strip_token_ids:
        blank(response, "prompt_token_ids")
    return tokens
