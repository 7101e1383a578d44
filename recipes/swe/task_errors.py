"""What is wrong with a task file or folder: each problem with where it is, nothing run (`recipes.swe.tasks`,
`recipes.swe.harbor`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from agentstream.schemas.errors import ConfigurationError


@dataclass(frozen=True)
class Problem:
    line: int
    reason: str

    def __str__(self) -> str:
        return f"line {self.line}: {self.reason}"


class InstanceFileError(ConfigurationError):
    """An SWE-bench instance file with bad lines; `problems` names each line and why."""

    def __init__(self, path: Path, problems: list[Problem]):
        self.path = path
        self.problems = problems
        shown = "\n  ".join(map(str, problems[:20]))
        more = f"\n  … and {len(problems) - 20} more" if len(problems) > 20 else ""
        super().__init__(f"{path}: {len(problems)} bad line(s), nothing was run:\n  {shown}{more}")
