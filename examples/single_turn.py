"""A single-turn agent: one question to the model, one answer, printed.

An ordinary OpenAI-SDK program. All it knows of agentstream is the environment:
  OPENAI_BASE_URL, OPENAI_API_KEY  read by the SDK itself (the controller points them at the gateway)
  AGENTSTREAM_TASK                 path to the task input (JSON): a string, {"prompt": ...,
                                   "system": ...} or {"messages": [...]}
  AGENTSTREAM_MODEL                the model to ask (else the first the server lists)
It posts no reward: the task's `reward_fn` scores the answer in the stream processor. (See
`calculator_agent.py` for an agent that scores itself.)

  python examples/single_turn.py   # AGENT_MAX_TOKENS, AGENT_TEMPERATURE, AGENT_MAX_RETRIES tune it

AGENT_SEED makes its sampling reproducible: the request's seed is derived from it and the rollout
id (AGENTSTREAM_ROLLOUT_ID), which the controller derives from its run id, the task and the sample.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from typing import Any

from openai import Omit, OpenAI, OpenAIError, omit
from openai.types.chat import ChatCompletionMessageParam


def messages_for(task: Any) -> list[ChatCompletionMessageParam]:
    if isinstance(task, dict) and isinstance(task.get("messages"), list):
        messages: list[ChatCompletionMessageParam] = task["messages"]
        return messages
    if isinstance(task, dict) and "prompt" in task:
        system: list[ChatCompletionMessageParam] = [{"role": "system", "content": str(task["system"])}] if task.get("system") else []
        return system + [{"role": "user", "content": str(task["prompt"])}]
    return [{"role": "user", "content": task if isinstance(task, str) else json.dumps(task)}]


def sampling_seed() -> int | Omit:
    if "AGENT_SEED" not in os.environ:
        return omit  # no `seed` in the request at all
    key = f"{os.environ['AGENT_SEED']}:{os.environ.get('AGENTSTREAM_ROLLOUT_ID', '')}"
    return int(hashlib.sha256(key.encode()).hexdigest()[:8], 16)


def main() -> int:
    with open(os.environ["AGENTSTREAM_TASK"]) as file:
        task = json.load(file)
    client = OpenAI(max_retries=int(os.environ.get("AGENT_MAX_RETRIES", "2")))
    try:
        model = os.environ.get("AGENTSTREAM_MODEL") or client.models.list().data[0].id
        reply = client.chat.completions.create(
            model=model, messages=messages_for(task),
            max_tokens=int(os.environ.get("AGENT_MAX_TOKENS", "64")),
            temperature=float(os.environ.get("AGENT_TEMPERATURE", "1.0")),
            seed=sampling_seed(),
        )
    except OpenAIError as exc:  # the attempt fails; the controller retries it as a new attempt
        print(f"the model call failed: {exc}", file=sys.stderr)
        return 1
    answer = reply.choices[0].message.content or ""
    # ASCII-escaped JSON: a model's output may hold anything, the log file must stay readable
    print(json.dumps({"answer": answer, "finish_reason": reply.choices[0].finish_reason}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
