"""A vLLM logits processor that makes the served model answer a given text (loaded by every local server).

A request that carries `vllm_xargs: {"forced_answer": TEXT}` gets, token by token, only the next token of
TEXT (tokenized by the served model's own tokenizer, the way its chat template starts an answer) and then
its end-of-answer token. Everything else about the call is real: the prompt is the harness's, the call goes
through the gateway and is recorded with its token ids; its logprobs are those of the distribution the
tokens came from (the local servers record processed logprobs, after logits processors): 0, as nothing
else was allowed, so a forced answer is data for supervised fine-tuning, not for a policy gradient. `recipes.swe.demonstrate` uses it to record an expert's
answers in the model's canonical tokens, for supervised fine-tuning. A request without the argument is
untouched.

This file runs inside the vLLM server's own environment (`python -m vllm...` with this folder on its
PYTHONPATH, `stack.vllm.server_args`); it imports only vLLM, torch and transformers.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AutoTokenizer
from vllm.v1.sample.logits_processor import AdapterLogitsProcessor  # type: ignore[import-not-found]

ARGUMENT = "forced_answer"


class ForcedAnswer(AdapterLogitsProcessor):  # type: ignore[misc]
    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        super().__init__(vllm_config, device, is_pin_memory)
        config = vllm_config.model_config
        self.tokenizer = AutoTokenizer.from_pretrained(config.tokenizer, trust_remote_code=False)

    def is_argmax_invariant(self) -> bool:
        return False

    def new_req_logits_processor(self, params: Any) -> Any:
        text = (params.extra_args or {}).get(ARGUMENT)
        if not isinstance(text, str):
            return None
        forced = [*self.tokenizer.encode(text, add_special_tokens=False), self.tokenizer.eos_token_id]

        def only_the_next_token(output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
            position = min(len(output_ids), len(forced) - 1)
            masked = torch.full_like(logits, float("-inf"))
            masked[forced[position]] = 0.0
            return masked

        return only_the_next_token
