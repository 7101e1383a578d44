"""`agentstream tasks swe demonstrate`: the expert's answers to the train tasks, recorded through the loop.

For each train task whose fix the expert can show (`recipes.swe.expert`: a one-line fix with `sed`, any other text
patch by replacing blocks), one attempt runs exactly as a probe's
(`recipes.swe.probe`: local stack, gateway, mini-swe-agent, sandbox, grader, streams worker), except that the
served model is made to answer the expert's answers (`AGENTSTREAM_SWE_DEMONSTRATIONS`), so the gateway of
this run takes `vllm_xargs` (every other gateway refuses it). Each attempt is graded like any other: a
demonstration whose diff does not pass the hidden tests gets its 0 and is not imitated. A task whose answers the
served model could not give within `--max-tokens` (counted by its own tokenizer) is not demonstrated; the summary
counts the tasks not demonstrated by reason, and the demonstrated and rewarded ones by kind of bug.

`--teacher MODEL=URL` puts another teacher in the expert's place: a stronger model's attempts on the train tasks,
graded and filtered, whose kept answers the served model is then made to give (`recipes.swe.teacher`).

The trajectories are the run's topic `<run folder name>.trajectories`; the SFT warm start learns from the
graded ones: `agentstream train --offline-topic … --loss sft --sft-min-reward 1` (the command is printed).
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

from pydantic import Field
from rich.console import Console

from agentstream.demo.loop import Stack
from agentstream.demo.progress import Progress
from agentstream.demo.run import run_folder, run_to_summary
from agentstream.gateway.settings import GatewaySettings
from agentstream.recipes.swe.build import kind_of
from agentstream.recipes.swe.expert import Budget, write_demonstrations
from agentstream.recipes.swe.keep import EXPERT, Keep
from agentstream.recipes.swe.probe import Probe, ProbeConfig
from agentstream.recipes.swe.recipe import Harness, RecipeLoop
from agentstream.recipes.swe.repos import default_repos_dir
from agentstream.recipes.swe.task_files import read_instances, write_task_files
from agentstream.schemas.events import Eval
from agentstream.stack import StackError

FORCING_FIELD = "vllm_xargs"


class DemonstrateConfig(ProbeConfig):
    k: int = 1
    """one attempt per task: the answers are the same every time"""
    out: Path = Field(default_factory=lambda: run_folder("demonstrate-swe"))
    vllm_name: str = "demonstrate-swe"
    teacher: str = "expert"
    """who demonstrates: `expert` (reads the gold patch: any text patch) or `MODEL=URL`, a stronger model
    whose graded, filtered attempts are demonstrated (`recipes.swe.teacher`)"""
    teacher_key_env: str | None = None
    """the environment variable that holds the teacher's key, if its server asks for one"""
    teacher_attempts: int = 1
    """the teacher's attempts per train task"""
    keep_min_reward: float = 1.0
    keep_flagged: bool = False
    keep_max_tokens: int = 0
    """the filter of the teacher's attempts (`recipes.swe.teacher.Keep`)"""
    teacher_script: Path | None = None
    """answers the teacher's served model is made to give (a demonstrations file): a scripted teacher, for tests"""

    def keep(self) -> Keep:
        return Keep(min_reward=self.keep_min_reward, flagged=self.keep_flagged, max_tokens=self.keep_max_tokens)


class Demonstrate(Probe):
    starting = "Starting the local stack to record the expert's demonstrations…"

    config: DemonstrateConfig

    def __init__(self, config: DemonstrateConfig, console: Console):
        super().__init__(config, console)
        self.not_demonstrated: dict[str, int] = {}
        """the task file's tasks not demonstrated, by reason (`NotDemonstrable.reason`)"""
        self.kinds: dict[str, str] = {}
        """train task → its kind of bug (`kind_of`)"""

    def task_files(self) -> tuple[Path, Path, Path]:
        """The demonstrable train tasks only, and the expert's answers for each."""
        if self.config.instances_file is None:
            raise StackError("give the task file to demonstrate (--tasks, e.g. from `tasks swe build`)")
        instances = read_instances(self.config.instances_file)
        self.demonstrations = self.out / "demonstrations.jsonl"
        self.out.mkdir(parents=True, exist_ok=True)
        budget = answer_budget(self.config.base_model or self.base_model(), self.config.max_tokens,
                               self.config.step_limit)
        written, skipped = write_demonstrations(instances, default_repos_dir(), self.demonstrations, budget)
        self.not_demonstrated = dict(Counter(exc.reason for exc in skipped.values()).most_common())
        if not written:
            raise StackError(f"no task of {self.config.instances_file} can be demonstrated: "
                             f"{'; '.join(sorted({str(exc) for exc in skipped.values()})[:3])}")
        self.instances = [i for i in instances if i.instance_id not in skipped]
        self.kinds = {i.instance_id: kind_of(i.instance_id) for i in instances if i.split == "train"}
        self.say(f"{written} train tasks demonstrated, {len(skipped)} not ({self.not_demonstrated}); answers in "
                 f"{self.demonstrations}")
        return write_task_files(self.instances, self.out / "tasks")

    def harness(self, stack: Stack) -> Harness:
        return super().harness(stack).model_copy(update={"demonstrations": self.demonstrations})

    def loop(self, stack: Stack) -> RecipeLoop:
        loop = super().loop(stack)
        refused = [name for name in default_refused_fields() if name != FORCING_FIELD]
        return loop.model_copy(update={"gateway": loop.gateway.model_copy(update={"refused_fields": refused})})

    def summary(self, console: Console, elapsed_s: float) -> dict[str, Any]:
        result = self.measures(elapsed_s)
        topic = f"{self.out.name}.trajectories"
        data = self.result["event"].data
        result.update(demonstrations=str(self.demonstrations), topic=topic, rewarded=rewarded(data),
                      not_demonstrated=self.not_demonstrated, by_kind=by_kind(self.kinds, data))
        (self.out / "summary.json").write_text(json.dumps(result, indent=2) + "\n")
        kinds = ", ".join(f"{kind} {row['rewarded']}/{row['demonstrated']}" for kind, row in result["by_kind"].items())
        console.print(f"{result['rewarded']} of {result['attempts']} demonstrations passed the hidden tests (ends: "
                      f"{result['end_reasons']}; by kind: {kinds or 'none'}; not demonstrated: "
                      f"{self.not_demonstrated or 'none'}); their trajectories are in {topic}. Warm-start from them:\n"
                      f"  agentstream train --offline-topic {topic} --loss sft --sft-min-reward 1 --group-size 1 "
                      f"--min-group-size 1 --base-model {self.stack.model_dir} --model {self.config.model} "
                      "--checkpoint-dir runs/sft")
        return result


def rewarded(data: Eval) -> int:
    """The attempts whose reward reached the threshold (1: the hidden tests passed), what the warm start learns from:
    counted, since pass@1 × attempts is that count only when every task had as many attempts."""
    return sum(1 for rewards in data.per_task.values() for reward in rewards
               if reward is not None and reward >= data.threshold)


def by_kind(kinds: dict[str, str], data: Eval) -> dict[str, dict[str, int]]:
    """Per kind of bug: the train tasks, those demonstrated, and those whose demonstration passed the hidden tests."""
    counts: dict[str, dict[str, int]] = {}
    for task, kind in sorted(kinds.items()):
        row = counts.setdefault(kind, {"train": 0, "demonstrated": 0, "rewarded": 0})
        rewards = data.per_task.get(task)
        row["train"] += 1
        row["demonstrated"] += int(rewards is not None)
        row["rewarded"] += sum(1 for r in rewards or [] if r is not None and r >= data.threshold)
    return counts


def answer_budget(model_dir: Path, max_tokens: int, step_limit: int) -> Budget | None:
    """`max_tokens` as the served model counts an answer (its tokenizer, as the forced answer's logits processor
    encodes it: no special tokens, then the end-of-answer token), and `step_limit` answers; None when the folder
    has no tokenizer.json."""
    from tokenizers import Tokenizer

    path = model_dir / "tokenizer.json"
    if not path.is_file():
        return None
    tokenizer = Tokenizer.from_file(str(path))
    return Budget(max_tokens, lambda text: len(tokenizer.encode(text, add_special_tokens=False).ids) + 1, step_limit)


def default_refused_fields() -> list[str]:
    default: list[str] = GatewaySettings.model_fields["refused_fields"].get_default(call_default_factory=True)
    return default


def run_demonstrate(config: DemonstrateConfig, console: Console | None = None) -> dict[str, Any]:
    """Record the scripted expert's demonstrations through the loop (any teacher: `teacher.run_demonstrations`)."""
    if config.teacher != EXPERT:
        raise ValueError(f"the teacher {config.teacher!r} runs with recipes.swe.teacher.run_demonstrations")
    demonstrate = Demonstrate(config, console or Console())

    def summarize(_progress: Progress, _config: ProbeConfig, console: Console, elapsed_s: float) -> dict[str, Any]:
        return demonstrate.summary(console, elapsed_s)

    return run_to_summary(demonstrate, summarize)
