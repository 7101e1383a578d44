"""mini-swe-agent's text-based model, made to answer a task's expert answers in turn (`recipes.swe.expert`).

Each call still goes to the gateway and the served model: the answer rides along as
`vllm_xargs.forced_answer`, which the server's logits processor turns into the model's own tokens for that
text. Only the harness imports this (it imports mini-swe-agent).
"""

from __future__ import annotations

from typing import Any

from minisweagent.models.litellm_textbased_model import LitellmTextbasedModel

FORCED_ANSWER = "forced_answer"
"""the request argument `stack/vllm_plugin/agentstream_forced_answer.py` reads"""


class DemonstratingModel(LitellmTextbasedModel):
    def __init__(self, *, answers: list[str], **kwargs: Any) -> None:
        super().__init__(**kwargs)  # type: ignore[no-untyped-call]
        if not answers:
            raise ValueError("a demonstration needs at least one answer")
        self.answers = answers

    def _query(self, messages: list[dict[str, str]], **kwargs: Any) -> Any:
        step = sum(1 for message in messages if message.get("role") == "assistant")
        answer = self.answers[min(step, len(self.answers) - 1)]
        extra_body = {**self.config.model_kwargs.get("extra_body", {}), "vllm_xargs": {FORCED_ANSWER: answer}}
        return super()._query(messages, **kwargs, extra_body=extra_body)
