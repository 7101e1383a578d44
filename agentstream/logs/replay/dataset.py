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

    Chat completions keep their messages as sent (tool calls and all); Responses and Anthropic
    Messages requests are turned into the same role/content shape. A plain completion has no
    conversation: None.
    """
    request, response = call.request, call.response or {}
    if call.api == "chat.completions":
        choices = response.get("choices") or [{}]
        answer = choices[0].get("message") or {"role": "assistant", "content": answer_text(call)}
        return [*request.get("messages", []), answer]
    if call.api == "messages":
        system = request.get("system")
        system = [{"role": "system", "content": system}] if system else []
        return [*system, *request.get("messages", []),
                {"role": "assistant", "content": response.get("content", answer_text(call))}]
    if call.api == "responses":
        given = request.get("input")
        history = [{"role": "user", "content": given}] if isinstance(given, str) else [
            item for item in given or [] if isinstance(item, dict) and "role" in item]
        instructions = request.get("instructions")
        system = [{"role": "system", "content": instructions}] if instructions else []
        return [*system, *history, {"role": "assistant", "content": answer_text(call)}]
    return None
