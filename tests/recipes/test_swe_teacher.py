"""The teacher's side of demonstrations (recipes/swe/keep.py, teacher.py): who `--teacher` names, which graded
attempts are kept, and the answers a kept attempt gives the student."""

from __future__ import annotations

import pytest

import agentstream.schemas as s
from agentstream.recipes.swe.keep import Attempt, Keep, Upstream, parse_teacher
from agentstream.recipes.swe.teacher import attempt_of
from agentstream.stack import StackError
from samples.events import trajectory


def test_the_teacher_is_the_expert_or_a_model_at_a_url():
    assert parse_teacher("expert") is None
    assert parse_teacher("big=http://127.0.0.1:8001/") == Upstream("big", "http://127.0.0.1:8001")


@pytest.mark.parametrize("text", ["claude", "big", "big=ftp://host", "big=http://user:sk-secret@host"])
def test_a_teacher_in_another_form_is_refused_with_the_forms_it_takes(text):
    with pytest.raises(ValueError, match="'expert' or 'MODEL=URL'"):
        parse_teacher(text)


def attempt(reward, generated=3, flagged=False, answers=("ls",)):
    return Attempt(reward=reward, flagged=flagged, answers=list(answers), generated_tokens=generated)


def test_the_filter_keeps_a_passed_unflagged_attempt_of_bounded_length_and_says_why_it_leaves_out_others():
    keep = Keep(min_reward=1.0, max_tokens=5)
    assert keep.verdict(attempt(1.0)) is None
    assert keep.verdict(attempt(0.0)) == "reward 0 below 1"
    assert keep.verdict(attempt(None)) == "ungraded"
    assert keep.verdict(attempt(1.0, flagged=True)) == "flagged by the grader"
    assert keep.verdict(attempt(1.0, generated=6)) == "6 generated tokens, more than 5"
    assert keep.verdict(attempt(1.0, answers=())) == "no model call"
    assert Keep(flagged=True).verdict(attempt(1.0, flagged=True)) is None


def call(call_id: str, content, started_at: int = 0, status: int = 200, usage: int | None = 7) -> s.CallEvent:
    return s.CallEvent(id=call_id, source="test", rollout_id="r", data=s.Call(
        api="chat.completions", model="big", request={"messages": []}, status=status, started_at=started_at,
        latency_ms=1.0, response={"choices": [{"message": {"role": "assistant", "content": content}}],
                                  **({"usage": {"completion_tokens": usage}} if usage is not None else {})}))


def test_an_attempts_answers_are_its_answered_calls_texts_in_order_with_the_providers_token_counts():
    """A provider's calls carry no token ids: they are no turns, so the answers come from the call events the
    trajectory's lineage names (failed calls left out), and the length from the provider's usage."""
    data = trajectory([1, 2], [3], 1.0, "g", 0).data
    calls = {"c2": call("c2", "THOUGHT: then\n\n```bash\nsubmit\n```", started_at=2),
             "c1": call("c1", "THOUGHT: first\n\n```bash\nls\n```", started_at=1),
             "c0": call("c0", None, started_at=0, status=429)}
    data = data.model_copy(update={"lineage": ["c2", "rollout-event", "c0", "c1"]})
    kept = attempt_of(data, False, calls)
    assert kept.answers == ["THOUGHT: first\n\n```bash\nls\n```", "THOUGHT: then\n\n```bash\nsubmit\n```"]
    assert kept.generated_tokens == 14 and kept.reward == 1.0
    with pytest.raises(StackError, match="answered no text"):
        attempt_of(data, False, {"c1": call("c1", None)})
