"""Expert demonstrations of one-line fixes, answered by the served model itself (for an SFT warm start).

A starting model that never solves a task gives GRPO nothing: every group's rewards are equal. The seed's
recipe warm-starts from a stronger model's successful attempts; on this machine there is none (the 0.5B and
1.5B coder models solved none of 117 probed attempts). So an expert is written down instead: for a train
task whose fix is one line, the answers a careful engineer gives through mini-swe-agent's format —

    1. read the function the report points to:   nl -ba FILE | sed -n 'START,ENDp'
    2. change the wrong line and print it again:   sed -i 'LINEs/OLD/NEW/' FILE && nl -ba FILE | sed -n 'LINEp'
    3. submit:                                     echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT

— the workflow mini.yaml's prompt teaches. Any other patch it can show (several lines, hunks or files, lines
added or removed: SWE-smith's `drop_branch`, a condition over two lines, a SWE-bench fix) gets, per file,

    1. read around the changes:                    nl -ba FILE | sed -n 'START,ENDp;START2,END2p'
    2. replace each exact block by the fixed one,  python3 - <<'EOF' && nl -ba FILE | sed -n 'START,ENDp'
       then print the new lines:                   (old = '''…''', new = '''…''', assert source.count(old) == 1,
                                                   replace, write)  EOF

then the submit. The edit is a `str_replace` as a Python heredoc (`recipes.swe.hunks`: each block is the changed
lines with as few around them as make it occur once in the file, checked before it is written), which asks of
the model no line arithmetic and no diff syntax, only the code as it is and as it should be. What cannot be
shown so is refused with a reason (`NotDemonstrable.reason`, counted in the demonstrate stage's result): a
binary part, a rename, an added or deleted file, code a literal cannot hold, an answer over the model's
`--max-tokens` (`Budget`).

The fix comes from the task's `patch`, so a demonstration is only ever made for a train task (`answers`
refuses a validation one): the validation split, whose bug sites share no file or function with the train
split's, measures what the model learned, not what it was shown.

Each answer goes through the real loop: the harness (`AGENTSTREAM_SWE_DEMONSTRATIONS`) asks the gateway as
usual, with `vllm_xargs.forced_answer` set to the answer's text, and the served model is made to answer that
text in its own tokenizer's tokens (`stack/vllm_plugin/agentstream_forced_answer.py`). The commands then run
in the sandbox, the diff is graded by the grader, and the trajectory — prompts, tool outputs, answers as
token ids — is in the log with its reward, where `agentstream train --loss sft` learns from the graded ones.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from agentstream.recipes.swe.hunks import NotDemonstrable, Replacement, file_changes, replacements
from agentstream.recipes.swe.instance import Instance
from agentstream.recipes.swe.repos import read, repo_path

__all__ = ["Budget", "NotDemonstrable", "answers", "load_answers", "write_demonstrations"]

SUBMIT = "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"
CONTEXT_BEFORE = 30
"""lines read above the wrong one at most (the enclosing function's `def` when closer)"""
CONTEXT_AFTER = 3
HEREDOC = "EOF"
_HUNK = re.compile(r"^@@ -(\d+)(?:,\d+)? \+\d+(?:,\d+)? @@")
_IDENTIFIER = re.compile(r"\w")
_FUNCTION = re.compile(r"^@@ [^@]* @@ .*?\bdef (\w+)", re.MULTILINE)


@dataclass(frozen=True)
class Budget:
    """The tokens one answer may take (the model's `--max-tokens`) and how the served model counts them, and the
    answers an attempt may give (its step limit): the server would cut a longer answer short, the harness stop
    before the submit, so such a task is not demonstrated."""

    max_tokens: int
    count: Callable[[str], int]
    max_answers: int = 0
    """0: any number"""

    def check(self, texts: list[str]) -> list[str]:
        if self.max_answers and len(texts) > self.max_answers:
            raise NotDemonstrable(f"{len(texts)} answers, over the step limit of {self.max_answers}", "over-step-limit")
        tokens = max(map(self.count, texts))
        if tokens > self.max_tokens:
            raise NotDemonstrable(f"an answer of {tokens} tokens, over the {self.max_tokens} of --max-tokens",
                                  "over-max-tokens")
        return texts


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
                              "not one line of one file", "not-one-line")
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


def answers(instance: Instance, repos_dir: Path, budget: Budget | None = None) -> list[str]:
    """The expert's answers for a train task, in mini-swe-agent's format (one THOUGHT, one command each): a
    one-line fix with `sed`, any other by replacing blocks, file by file."""
    if instance.split != "train":
        raise NotDemonstrable(f"{instance.instance_id} is a {instance.split} task: only train tasks are demonstrated",
                              "validation")
    try:
        fix = one_line_fix(instance.patch)
    except NotDemonstrable:
        texts = block_answers(instance, repos_dir)
    else:
        texts = one_line_answers(instance, repos_dir, fix)
    return budget.check(texts) if budget else texts


def one_line_answers(instance: Instance, repos_dir: Path, fix: OneLineFix) -> list[str]:
    """Read the function, `sed -i` the line, submit: the answers the README's warm-start figures came from."""
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


def block_answers(instance: Instance, repos_dir: Path) -> list[str]:
    """For each changed file: read around its changes, replace its blocks by the fixed ones (`hunks`); then submit."""
    repo = repo_path(repos_dir, instance.repo)
    function = _function(instance.patch)
    said: list[str] = []
    for path, changes in file_changes(instance.patch).items():
        source = read(repo, instance.base_commit, path)
        blocks = replacements(source, changes)
        where = f"`{function}` in {path}" if function and not said else path
        plural = "s" if len(blocks) > 1 else ""
        show = f"nl -ba {path} | sed -n '{';'.join(f'{block.new_first},{block.new_last}p' for block in blocks)}'"
        said += [
            f"THOUGHT: The bug is in {where}, {_lines(blocks)}. I will read that code with line numbers.\n\n"
            f"```mswea_bash_command\nnl -ba {path} | sed -n '{_reading(source, blocks)}'\n```",
            f"THOUGHT: {_block_diagnosis(instance, blocks)} I will replace the exact block{plural} with the fixed "
            f"code, checking that each occurs once, and print the result.\n\n"
            f"```mswea_bash_command\n{replace_script(path, blocks, then=show)}\n```",
        ]
    return [*said, "THOUGHT: The code now reads as intended. The fix is done, so I submit.\n\n"
                   f"```mswea_bash_command\n{SUBMIT}\n```"]


def replace_script(path: str, blocks: list[Replacement], then: str) -> str:
    """A Python heredoc that replaces each block of `path` by its fixed text, once it has checked it occurs once;
    `then` runs when it succeeded (the command's exit code is the script's when it did not)."""
    if re.search(r"[\\\"\n]", path):
        raise NotDemonstrable(f"the path {path!r} holds a quote, a backslash or a newline", "unquotable")
    lines = [f"python3 - <<'EOF' && {then}", "from pathlib import Path", "", f'path = Path("{path}")', "source = path.read_text()"]
    for block in blocks:
        lines += [f"old = {python_literal(block.old)}", f"new = {python_literal(block.new)}",
                  "assert source.count(old) == 1, source.count(old)", "source = source.replace(old, new)"]
    if any(line == HEREDOC for block in blocks for line in (block.old + block.new).splitlines()):
        raise NotDemonstrable(f"the code holds a line `{HEREDOC}`, which would end the heredoc", "unquotable")
    script = "\n".join([*lines, "path.write_text(source)", HEREDOC])
    if "```" in script:
        raise NotDemonstrable("the code holds ```, which would end the answer's command block", "unquotable")
    return script


def python_literal(text: str) -> str:
    """`text` as a triple-quoted Python literal that reads as the code itself (raw when it holds a backslash)."""
    for quotes in ("'''", '"""'):
        if quotes not in text and not text.endswith(quotes[0]) and not text.endswith("\\"):
            return ("r" if "\\" in text else "") + quotes + text + quotes
    raise NotDemonstrable("the code holds both kinds of triple quote, or ends with a quote or a backslash",
                          "unquotable")


def _function(patch: str) -> str | None:
    """The function git names in the first hunk's header, if it names one."""
    found = _FUNCTION.search(patch)
    return found.group(1) if found else None


def _lines(blocks: list[Replacement]) -> str:
    spans = [f"{b.first}-{b.last}" if b.last > b.first else str(b.first) for b in blocks]
    return ("lines " if len(blocks) > 1 or blocks[0].last > blocks[0].first else "line ") + ", ".join(spans)


def _reading(source: str, blocks: list[Replacement]) -> str:
    """sed's ranges that show each block from its function's `def` (`reading_start`) to a few lines after it."""
    total = source.count("\n")
    spans: list[list[int]] = []
    for block in blocks:
        start, end = reading_start(source, block.first), min(block.last + CONTEXT_AFTER, total)
        if spans and start <= spans[-1][1] + 1:
            spans[-1][1] = max(spans[-1][1], end)
        else:
            spans.append([start, end])
    return ";".join(f"{start},{end}p" for start, end in spans)


def _block_diagnosis(instance: Instance, blocks: list[Replacement]) -> str:
    if ".drop_branch__" in instance.instance_id:
        return ("A branch is missing here: `pass` stands where an `if` and what it does should be, so the code runs "
                "on as if the check never applied.")
    return f"The code at {_lines(blocks)} is wrong."


def write_demonstrations(instances: list[Instance], repos_dir: Path, out: Path,
                         budget: Budget | None = None) -> tuple[int, dict[str, NotDemonstrable]]:
    """A JSONL file of {instance_id, answers} for each demonstrable train task; (written, skipped id → why)."""
    written, skipped = 0, {}
    with out.open("wb") as handle:
        for instance in instances:
            try:
                line = {"instance_id": instance.instance_id, "answers": answers(instance, repos_dir, budget)}
            except NotDemonstrable as exc:
                skipped[instance.instance_id] = exc
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
    raise NotDemonstrable(f"{path} holds no demonstration for {instance_id}", "missing")
