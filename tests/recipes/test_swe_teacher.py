"""The teacher's side of demonstrations (recipes/swe/keep.py, teacher.py): who `--teacher` names, which graded
attempts are kept, and the answers a kept attempt gives the student."""

from __future__ import annotations

import pytest

import agentstream.schemas as s
from agentstream.recipes.swe.keep import Keep, Upstream, parse_teacher
from agentstream.recipes.swe.teacher import answers_of
from agentstream.stack import StackError
from samples.events import trajectory


def test_the_teacher_is_the_expert_or_a_model_at_a_url():
    assert parse_teacher("expert") is None
    assert parse_teacher("big=http://127.0.0.1:8001/") == Upstream("big", "http://127.0.0.1:8001")


@pytest.mark.parametrize("text", ["claude", "big", "big=ftp://host", "big=http://user:sk-secret@host"])
def test_a_teacher_in_another_form_is_refused_with_the_forms_it_takes(text):
    with pytest.raises(ValueError, match="'expert' or 'MODEL=URL'"):
        parse_teacher(text)


def attempt(reward, completion_tokens=3):
    return trajectory([1, 2], list(range(3, 3 + completion_tokens)), reward, "g", 0).data


def test_the_filter_keeps_a_passed_unflagged_attempt_of_bounded_length_and_says_why_it_leaves_out_others():
    keep = Keep(min_reward=1.0, max_tokens=5)
    assert keep.verdict(attempt(1.0), flagged=False) is None
    assert keep.verdict(attempt(0.0), flagged=False) == "reward 0 below 1"
    assert keep.verdict(attempt(None), flagged=False) == "ungraded"
    assert keep.verdict(attempt(1.0), flagged=True) == "flagged by the grader"
    assert keep.verdict(attempt(1.0, completion_tokens=6), flagged=False) == "6 generated tokens, more than 5"
    assert Keep(flagged=True).verdict(attempt(1.0), flagged=True) is None


def call(call_id: str, content) -> s.CallEvent:
    return s.CallEvent(id=call_id, source="test", rollout_id="r", data=s.Call(
        api="chat.completions", model="big", request={"messages": []}, status=200, started_at=0, latency_ms=1.0,
        response={"choices": [{"message": {"role": "assistant", "content": content}}]}))


def test_a_kept_attempts_answers_are_its_calls_texts_and_a_missing_call_is_an_error():
    data = attempt(1.0)
    (turn,) = data.turns
    assert answers_of(data, {turn.call_id: call(turn.call_id, "THOUGHT: fix\n\n```bash\nls\n```")}) == [
        "THOUGHT: fix\n\n```bash\nls\n```"]
    with pytest.raises(StackError, match="not in the log"):
        answers_of(data, {})
    with pytest.raises(StackError, match="answered no text"):
        answers_of(data, {turn.call_id: call(turn.call_id, None)})
