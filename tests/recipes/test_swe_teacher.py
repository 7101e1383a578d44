"""The teacher's side of demonstrations (recipes/swe/keep.py, teacher.py): who `--teacher` names, which graded
attempts are kept, the answers a kept attempt gives the student; and the whole path with a teacher on a second vLLM
server and with a teacher at a provider (a stand-in), its key reaching no event and no file of the run."""

from __future__ import annotations

import asyncio
import json
import os

import pytest
from rich.console import Console

import agentstream.schemas as s
from agentstream.recipes.swe.demonstrate import DemonstrateConfig
from agentstream.recipes.swe.expert import answers, write_demonstrations
from agentstream.recipes.swe.keep import Attempt, Keep, Upstream, parse_teacher
from agentstream.recipes.swe.teacher import attempt_of, run_demonstrations
from agentstream.schemas.events import CallEvent, TrajectoryEvent
from agentstream.schemas.kafka import KafkaSettings
from agentstream.stack import StackError
from agentstream.stack.vllm import LocalVLLM, running_servers
from samples.events import trajectory
from tests.support.gateway import read_events
from tests.support.provider import KNOWN_FIELDS, running_provider
from tests.support.swe import SHORT_CONFIG, calc_instance, make_repo


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


# --- the whole path: the teacher's attempts through the gateway and the grader, the student's replay ------------
# The tiny model (its tokens are characters, 2,048 of them) holds an attempt in the short harness config; the teacher
# is a second server: the tiny architecture with other weights on vLLM, made to answer the expert's fix (a teacher that
# answers the gold fix: a plumbing test), or a provider stand-in that answers it. The student is the run's own vLLM,
# or the session's tiny server, which the run reuses (reset to the starting weights) and leaves running.

TEACHER_KEY = "sk-teacher-key-for-tests-9876543210"


def calc_task_set(tmp_path, monkeypatch):
    """The calc task as a train instance, its repository, and the expert's answers to it."""
    repos = tmp_path / "repos"
    instance = calc_instance(make_repo(repos), "add(1, 2) == 3")
    (instances := tmp_path / "instances.jsonl").write_text(instance.model_dump_json() + "\n")
    (config := tmp_path / "short.yaml").write_text(SHORT_CONFIG)
    script = tmp_path / "teacher-script.jsonl"
    assert write_demonstrations([instance], repos, script) == (1, {})
    for name, value in {"AGENTSTREAM_SWE_REPOS": repos, "AGENTSTREAM_SWE_ENVS": tmp_path / "envs",
                        "AGENTSTREAM_SWE_CONFIG": config, "TEACHER_KEY": TEACHER_KEY}.items():
        monkeypatch.setenv(name, str(value))
    return instances, script, answers(instance, repos)


def demonstrate(tmp_path, instances, teacher: str, student_dir, **extra) -> tuple[DemonstrateConfig, dict]:
    """The run, its folder named as its test's (the folder's name prefixes its topics on the session's broker); its
    student's server one of its own unless `extra` names one (`vllm_name`, with `keep_stack`)."""
    fields = {"vllm_name": f"teacher-student-{os.getpid()}", **extra}
    config = DemonstrateConfig(model="tiny", base_model=student_dir, instances_file=instances, teacher=teacher,
                               teacher_key_env="TEACHER_KEY", step_limit=4, max_tokens=400, concurrency=1,
                               attempt_timeout_s=240, out=tmp_path / tmp_path.name, **fields)
    return config, run_demonstrations(config, Console(width=160))


async def run_events(kafka_bootstrap: str, out) -> list:
    kafka = KafkaSettings(bootstrap_servers=kafka_bootstrap, topic_prefix=f"{out.name}.")
    return [event for topic in (kafka.topics.calls, kafka.topics.rollouts, kafka.topics.rewards,
                                kafka.topics.trajectories) for event in await read_events(kafka, topic)]


def assert_replayed_in_the_students_tokens(events, expert: list[str], tokenizer) -> None:
    """The student's trajectory: graded 1, each turn the expert's answer in the student's own token ids."""
    students = [e.data for e in events if isinstance(e, TrajectoryEvent) and e.data.model == "tiny"]
    [student] = [t for t in students if t.reward is not None]
    assert student.reward == 1.0 and len(student.turns) == 3
    for turn, answer in zip(student.turns, expert, strict=True):
        assert turn.completion_token_ids == [*tokenizer.encode(answer, add_special_tokens=False),
                                             tokenizer.eos_token_id]


def assert_the_key_is_nowhere(events, out) -> None:
    assert not any(TEACHER_KEY in event.model_dump_json() for event in events), "the key is in an event"
    leaked = [path for path in out.rglob("*") if path.is_file() and TEACHER_KEY.encode() in path.read_bytes()]
    assert not leaked, f"the key is in the run folder: {leaked}"


@pytest.fixture
def teacher_server(tiny_model_dirs):
    """A second vLLM server: the tiny architecture with other weights, served as "teacher", wanting its key."""
    server = LocalVLLM(name=f"pytest-teacher-{os.getpid()}")
    state = server.start(tiny_model_dirs[1], served_name="teacher", timeout=900, extra_args=["--api-key", TEACHER_KEY])
    try:
        yield state.url
    finally:
        server.stop(grace=2)


@pytest.mark.vllm
@pytest.mark.heavy  # two vLLM servers, a local stack, two graded attempts: ~4 min idle, in `make heavy` (the
# provider teacher below, one server, stays in `make test`)
@pytest.mark.timeout(1800)
async def test_a_teacher_on_a_second_vllm_server_is_graded_kept_and_replayed_in_the_students_tokens(
        kafka_bootstrap, tiny_model_dirs, teacher_server, tokenizer_of_tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("KAFKA_BOOTSTRAP_SERVERS", kafka_bootstrap)
    instances, script, expert = calc_task_set(tmp_path, monkeypatch)
    config, summary = await asyncio.to_thread(demonstrate, tmp_path, instances, f"teacher={teacher_server}",
                                              tiny_model_dirs[0], teacher_script=script)

    assert (summary["teacher_attempts"], summary["teacher_kept"]) == (1, 1)
    [decision] = json.loads((config.out / "teacher.json").read_text())
    assert decision["kept"] and decision["reward"] == 1.0 and decision["calls"] == 3
    events = await run_events(kafka_bootstrap, config.out)
    teachers = [e.data for e in events if isinstance(e, CallEvent) and e.data.model == "teacher"]
    assert len(teachers) == 3 and all(call.upstream == teacher_server and call.status == 200 for call in teachers)
    assert all(call.completion_token_ids is None for call in teachers), "a teacher is asked for no token ids"
    assert [call.response["choices"][0]["message"]["content"] for call in teachers] == expert
    assert_replayed_in_the_students_tokens(events, expert, tokenizer_of_tiny)
    assert_the_key_is_nowhere(events, config.out)


@pytest.mark.vllm
@pytest.mark.slow  # a local stack and two graded attempts: minutes
@pytest.mark.timeout(1800)
async def test_a_teacher_at_a_provider_gets_its_key_and_no_vllm_field_and_its_answers_are_replayed(
        kafka_bootstrap, vllm_server, tokenizer_of_tiny, tmp_path, monkeypatch):
    """The provider is a stand-in (tests/support/provider.py; OpenAI or Anthropic cannot run here): it refuses a
    wrong key and any field it does not know, as they do. The student is the session's tiny server."""
    monkeypatch.setenv("KAFKA_BOOTSTRAP_SERVERS", kafka_bootstrap)
    instances, _, expert = calc_task_set(tmp_path, monkeypatch)
    name = next(n for n, state in running_servers().items() if state.url == vllm_server.url)
    with running_provider(TEACHER_KEY, expert) as provider:
        config, summary = await asyncio.to_thread(demonstrate, tmp_path, instances, f"gpt-teacher={provider.url}",
                                                  vllm_server.model_dir, vllm_name=name, keep_stack=True)
    kept = LocalVLLM(name).state()
    assert kept is not None and kept.url == vllm_server.url, "the run stopped a server it did not start"

    assert (summary["teacher_attempts"], summary["teacher_kept"]) == (1, 1)
    assert summary["by_kind"] == {"other": {"train": 1, "demonstrated": 1, "rewarded": 1}}, "counted as the expert's"
    assert len(provider.requests) == 3
    assert all(r["headers"]["authorization"] == f"Bearer {TEACHER_KEY}" for r in provider.requests)
    assert all(set(r["body"]) <= KNOWN_FIELDS for r in provider.requests), "no vLLM field reached the provider"
    events = await run_events(kafka_bootstrap, config.out)
    assert_replayed_in_the_students_tokens(events, expert, tokenizer_of_tiny)
    assert_the_key_is_nowhere(events, config.out)


@pytest.fixture
def tokenizer_of_tiny(tiny_model_dirs):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dirs[0])
