"""Run inside vLLM (`--logits-processors tests.support.scripted_turns:ScriptedTurns`): the tiny model's answers, scripted.

The tiny model's weights are random: given a coding agent's tools it never writes a tool call, and an
unchanged harness (Codex CLI, Claude Code) sends no grammar to steer it. For the whole-harness tests a
task's text carries the call the model is to make, between `<script>` and `</script>`. For a request
whose prompt shows tools and such a call, this processor masks every token but the next one of:
`<tool_call>\\n{call}\\n</tool_call>` while no tool result follows the script in the prompt, and then
`Done.`, each ended by the end-of-turn token. Everything else is vLLM's own: the prompt the chat
template rendered, the sampled tokens and their logprobs (vLLM reports logprobs of the logits before any
processor: the model's own), the hermes parser that turns the text into a tool call. Requests without a
script are left alone.
"""

from __future__ import annotations

import re

import torch
from transformers import AutoTokenizer
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality

SCRIPT = re.compile(r"<script>(.*?)</script>", re.DOTALL)
TOOL_RESULT = "<tool_response>"


def scripted_answer(prompt: str) -> str | None:
    """The answer a prompt's script asks for, or None when it has none (or shows no tools)."""
    scripts = list(SCRIPT.finditer(prompt))
    if not scripts or "<tools>" not in prompt:
        return None
    last = scripts[-1]
    if TOOL_RESULT in prompt[last.end():]:
        return "Done."
    return f"<tool_call>\n{last.group(1).strip()}\n</tool_call>"


class ScriptedTurns(LogitsProcessor):
    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool):
        self.tokenizer = AutoTokenizer.from_pretrained(vllm_config.model_config.tokenizer)
        self.end = self.tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.forced: dict[int, tuple[list[int], list[int]]] = {}
        """batch index → (the answer's token ids, the request's output token ids so far: vLLM's live list)"""

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        for index in batch_update.removed:
            self.forced.pop(index, None)
        for index, _params, prompt_ids, output_ids in batch_update.added:
            answer = scripted_answer(self.tokenizer.decode(prompt_ids or [], skip_special_tokens=False))
            if answer is None:
                self.forced.pop(index, None)
            else:
                self.forced[index] = (self.tokenizer.encode(answer, add_special_tokens=False) + [self.end],
                                      output_ids)
        for first, second, direction in batch_update.moved:
            one, other = self.forced.pop(first, None), self.forced.pop(second, None)
            if one is not None:
                self.forced[second] = one
            if direction is MoveDirectionality.SWAP and other is not None:
                self.forced[first] = other

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for index, (answer, output_ids) in self.forced.items():
            token = answer[min(len(output_ids), len(answer) - 1)]
            logits[index] = float("-inf")
            logits[index, token] = 0.0
        return logits
