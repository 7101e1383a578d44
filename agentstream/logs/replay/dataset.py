"""Dataset rows: one per token sequence of a trajectory, in chat format with token ids and masks.

A trajectory whose turns all extend one another is one sequence (one row); an agent that rewrote
its history makes several. Each row has the conversation as chat messages (the last turn's request
and the model's answer), and the sequence as training needs it: `token_ids`, `mask` (1 where the
model generated the token: the loss mask for fine-tuning), `logprobs` and `weight_versions` (of
the generating policy, where the mask is 1), plus the reward and the task's grouping for RL.

In Parquet, `messages` is JSON text: messages differ in shape (tool calls, content parts) and
Parquet wants one. Rows from a stored trajectories topic have no messages (null): the text is in
the calls, which only a rebuild reads.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import orjson
import polars as pl

from agentstream.schemas.conversation import BadConversation, anthropic_messages, responses_messages
from agentstream.schemas.events import Call, TrajectoryEvent
from agentstream.streams.rewards import answer_text

if TYPE_CHECKING:
    from polars._typing import PolarsDataType

_COLUMNS: dict[str, PolarsDataType] = {
    "trajectory_id": pl.String, "rollout_id": pl.String, "attempt_id": pl.String,
    "sequence": pl.Int64, "sequences": pl.Int64,
    "task_id": pl.String, "group_id": pl.String, "split": pl.String, "epoch": pl.Int64, "sample_index": pl.Int64,
    "model": pl.String, "status": pl.String, "reward": pl.Float64, "reward_missing": pl.Boolean,
    "weight_version_launch": pl.Int64,
    "messages": pl.String,
    "token_ids": pl.List(pl.Int64), "mask": pl.List(pl.Int8), "logprobs": pl.List(pl.Float64),
    "weight_versions": pl.List(pl.Int64), "prompt_length": pl.Int64,
}
SCHEMA = pl.Schema(_COLUMNS)


def rows(event: TrajectoryEvent, calls: dict[str, Call], messages_as_json: bool = False) -> list[dict[str, Any]]:
    data = event.data
    out = []
    for index, sequence in enumerate(data.sequences):
        last_turn = data.turns[sequence.turns[-1]] if sequence.turns else None
        call = calls.get(last_turn.call_id) if last_turn else None
        chat = chat_messages(call) if call is not None else None
        messages = orjson.dumps(chat).decode() if chat is not None and messages_as_json else chat
        out.append({
            "trajectory_id": event.id, "rollout_id": event.rollout_id, "attempt_id": event.attempt_id,
            "sequence": index, "sequences": len(data.sequences),
            "task_id": data.task_id, "group_id": data.group_id, "split": data.split, "epoch": data.epoch,
            "sample_index": data.sample_index, "model": data.model, "status": data.status,
            "reward": data.reward, "reward_missing": data.reward_missing,
            "weight_version_launch": data.weight_version_launch,
            "messages": messages,
            "token_ids": sequence.token_ids, "mask": sequence.mask, "logprobs": sequence.logprobs,
            "weight_versions": sequence.weight_versions, "prompt_length": sequence.prompt_length,
        })
    return out


def chat_messages(call: Call) -> list[dict[str, Any]] | None:
    """The conversation of one call as chat messages, ending with the model's answer.

    Chat completions keep their messages as sent (tool calls and all). Responses and Anthropic Messages
    calls become chat messages by the gateway's own conversion (`schemas.conversation`), the request's
    and the answer's alike: the messages the model was given, tool calls and reasoning included. A plain
    completion has no conversation, nor has a call whose conversation is not one (the gateway refused
    it): None.
    """
    request, response = call.request, call.response or {}
    try:
        if call.api == "chat.completions":
            choices = response.get("choices") or [{}]
            return [*request.get("messages", []), choices[0].get("message") or _plain_answer(call)]
        if call.api == "messages":
            answer = (anthropic_messages(None, [{"role": "assistant", "content": response["content"]}])
                      if response.get("content") else [_plain_answer(call)])
            return [*anthropic_messages(request.get("system"), request.get("messages")), *answer]
        if call.api == "responses":
            answer = responses_messages(None, response["output"]) if response.get("output") else []
            return [*responses_messages(request.get("instructions"), request.get("input")),
                    *(answer or [_plain_answer(call)])]
    except BadConversation:
        return None
    return None


def _plain_answer(call: Call) -> dict[str, Any]:
    return {"role": "assistant", "content": answer_text(call)}
