"""Expert demonstrations of one-line fixes, answered by the served model itself (for an SFT warm start).

A starting model that never solves a task gives GRPO nothing: every group's rewards are equal. The seed's
recipe warm-starts from a stronger model's successful attempts; on this machine there is none (the 0.5B and
1.5B coder models solved none of 117 probed attempts). So an expert is written down instead: for a train
task whose fix is one line, the answers a careful engineer gives through mini-swe-agent's format —

    1. read the function the report points to:   nl -ba FILE | sed -n 'START,ENDp'
    2. change the wrong line and print it again:   sed -i 'LINEs/OLD/NEW/' FILE && nl -ba FILE | sed -n 'LINEp'
    3. submit:                                     echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT

— the workflow mini.yaml's prompt teaches. The fix comes from the task's `patch`, so a demonstration is only
ever made for a train task (`answers` refuses a validation one): the validation split, whose bug sites share
no file or function with the train split's, measures what the model learned, not what it was shown.

Each answer goes through the real loop: the harness (`AGENTSTREAM_SWE_DEMONSTRATIONS`) asks the gateway as
usual, with `vllm_xargs.forced_answer` set to the answer's text, and the served model is made to answer that
text in its own tokenizer's tokens (`stack/vllm_plugin/agentstream_forced_answer.py`). The commands then run
in the sandbox, the diff is graded by the grader, and the trajectory — prompts, tool outputs, answers as
token ids — is in the log with its reward, where `agentstream train --loss sft` learns from the graded ones.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from agentstream.recipes.swe.instance import Instance
from agentstream.recipes.swe.repos import read, repo_path

SUBMIT = "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"
CONTEXT_BEFORE = 30
"""lines read above the wrong one at most (the enclosing function's `def` when closer)"""
CONTEXT_AFTER = 3
_HUNK = re.compile(r"^@@ -(\d+)(?:,\d+)? \+\d+(?:,\d+)? @@")
_IDENTIFIER = re.compile(r"\w")


class NotDemonstrable(ValueError):
    """The task's fix is not one a demonstration is written for (several lines, several files, a validation task)."""


@dataclass(frozen=True)
class OneLineFix:
    path: str
    line: int
    """1-based, in the task's base commit (the buggy tree the agent starts from)"""
    old: str
    new: str


def one_line_fix(patch: str) -> OneLineFix:
    """The fix of a patch that changes exactly one line of one file."""
    files = re.findall(r"^\+\+\+ b/(.+)$", patch, flags=re.MULTILINE)
    removed = [line for line in patch.splitlines() if line.startswith("-") and not line.startswith("---")]
    added = [line for line in patch.splitlines() if line.startswith("+") and not line.startswith("+++")]
    if len(files) != 1 or len(removed) != 1 or len(added) != 1:
        raise NotDemonstrable(f"the fix changes {len(removed)} line(s) for {len(added)} in {len(files)} file(s), "
                              "not one line of one file")
    line = 0
    for text in patch.splitlines():
        if hunk := _HUNK.match(text):
            line = int(hunk.group(1))
        elif text.startswith("-") and not text.startswith("---"):
            break
        elif text.startswith(" "):
            line += 1
    return OneLineFix(path=files[0], line=line, old=removed[0][1:], new=added[0][1:])


def changed_part(old: str, new: str) -> tuple[str, str]:
    """The shortest part of `old` that, replaced at its first occurrence (as `sed s///` does), makes `new`:
    the changed characters widened to whole words, then to the left until their first occurrence is theirs."""
    prefix = 0
    while prefix < min(len(old), len(new)) and old[prefix] == new[prefix]:
        prefix += 1
    suffix = 0
    while suffix < min(len(old), len(new)) - prefix and old[-1 - suffix] == new[-1 - suffix]:
        suffix += 1
    start, end_old, end_new = prefix, len(old) - suffix, len(new) - suffix
    while start > 0 and _IDENTIFIER.match(old[start - 1]):
        start -= 1
    while end_old < len(old) and _IDENTIFIER.match(old[end_old]):
        end_old, end_new = end_old + 1, end_new + 1
    while old.find(old[start:end_old]) != start:
        start -= 1
    return old[start:end_old], new[start:end_new]


def sed_pattern(text: str) -> str:
    """`text` as a literal in a basic regular expression inside `s/…/…/`."""
    return re.sub(r"([\\/.*\[\]^$])", r"\\\1", text)


def sed_replacement(text: str) -> str:
    return re.sub(r"([\\/&])", r"\\\1", text)


def single_quoted(text: str) -> str:
    return "'" + text.replace("'", "'\\''") + "'"


def reading_start(source: str, line: int) -> int:
    """The first line to read before `line`: its function's `def`, if within `CONTEXT_BEFORE` lines."""
    lines = source.splitlines()
    indent = len(lines[line - 1]) - len(lines[line - 1].lstrip())
    for number in range(line - 1, max(line - CONTEXT_BEFORE, 1) - 1, -1):
        text = lines[number - 1]
        if re.match(r"\s*(async\s+)?def ", text) and len(text) - len(text.lstrip()) < indent:
            return number
    return max(line - CONTEXT_BEFORE, 1)


def answers(instance: Instance, repos_dir: Path) -> list[str]:
    """The expert's answers for a train task, in mini-swe-agent's format (one THOUGHT, one command each)."""
    if instance.split != "train":
        raise NotDemonstrable(f"{instance.instance_id} is a {instance.split} task: only train tasks are demonstrated")
    fix = one_line_fix(instance.patch)
    source = read(repo_path(repos_dir, instance.repo), instance.base_commit, fix.path)
    start, end = reading_start(source, fix.line), fix.line + CONTEXT_AFTER
    old, new = changed_part(fix.old, fix.new)
    show = f"nl -ba {fix.path} | sed -n '{fix.line}p'"
    edit = f"sed -i {single_quoted(f'{fix.line}s/{sed_pattern(old)}/{sed_replacement(new)}/')} {fix.path}"
    return [
        f"THOUGHT: The report points to {fix.path}, line {fix.line}. I will read that code with line numbers.\n\n"
        f"```mswea_bash_command\nnl -ba {fix.path} | sed -n '{start},{end}p'\n```",
        f"THOUGHT: {_diagnosis(instance, fix, old, new)} I will change line {fix.line} and print it again.\n\n"
        f"```mswea_bash_command\n{edit} && {show}\n```",
        f"THOUGHT: Line {fix.line} now reads `{fix.new.strip()}`. The fix is done, so I submit.\n\n"
        f"```mswea_bash_command\n{SUBMIT}\n```",
    ]


def _diagnosis(instance: Instance, fix: OneLineFix, old: str, new: str) -> str:
    if ".misspell_name__" in instance.instance_id:
        return f"`{old}` is not a name defined here: the code means `{new}`, which the function defines."
    return f"Line {fix.line} is wrong: `{old.strip()}` should be `{new.strip()}`."


def write_demonstrations(instances: list[Instance], repos_dir: Path, out: Path) -> tuple[int, dict[str, str]]:
    """A JSONL file of {instance_id, answers} for each demonstrable train task; (written, skipped id → why)."""
    written, skipped = 0, {}
    with out.open("wb") as handle:
        for instance in instances:
            try:
                line = {"instance_id": instance.instance_id, "answers": answers(instance, repos_dir)}
            except NotDemonstrable as exc:
                skipped[instance.instance_id] = str(exc)
                continue
            handle.write(orjson.dumps(line) + b"\n")
            written += 1
    return written, skipped


def load_answers(path: Path, instance_id: str) -> list[str]:
    """The answers a demonstrations file holds for one task (the harness's side)."""
    for line in path.read_bytes().splitlines():
        record: dict[str, Any] = orjson.loads(line)
        if record.get("instance_id") == instance_id:
            return [str(answer) for answer in record["answers"]]
    raise NotDemonstrable(f"{path} holds no demonstration for {instance_id}")
