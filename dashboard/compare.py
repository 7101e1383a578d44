"""Two weight versions side by side on the tasks both were launched on: reward, length, pass rate.

Length is the tokens the model generated in an attempt, summed from its calls' usage.
"""

from __future__ import annotations

from typing import Any

from agentstream.dashboard.overview import PASSED
from agentstream.dashboard.sql import run_many
from agentstream.schemas.kafka import KafkaSettings
from agentstream.schemas.scan import Bounds

SQL = """
    SELECT t.task_id AS task_id, t.weight_version_launch AS version, COUNT(*) AS attempts,
           AVG(t.reward) AS reward_mean, AVG({passed}) AS pass_rate, AVG(c.tokens) AS length_mean
    FROM trajectories AS t
    LEFT JOIN (SELECT rollout_id, attempt_id, SUM(usage_completion_tokens) AS tokens FROM calls
               GROUP BY rollout_id, attempt_id) AS c
      ON t.rollout_id = c.rollout_id AND t.attempt_id = c.attempt_id
    WHERE t.weight_version_launch IN ({a}, {b}) {split}
    GROUP BY t.task_id, t.weight_version_launch ORDER BY task_id, version"""


async def compare(settings: KafkaSettings, a: int, b: int, bounds: Bounds, split: str | None = None) -> dict[str, Any]:
    split_sql = f"AND t.split = '{split}'" if split else ""  # split is validated as train or validation
    sql = SQL.format(passed=PASSED.replace("reward", "t.reward"), a=a, b=b, split=split_sql)
    answer = (await run_many(settings, {"compare": sql}, bounds))["compare"]
    by_task: dict[str, dict[int, dict[str, Any]]] = {}
    for row in answer.rows:
        by_task.setdefault(row["task_id"], {})[row["version"]] = row
    shared = {task: v for task, v in by_task.items() if a in v and b in v}
    tasks = [{"task_id": task, "a": v[a], "b": v[b]} for task, v in sorted(shared.items(), key=lambda kv: str(kv[0]))]
    return {"a": a, "b": b, "split": split, "tasks": tasks, "totals": {"a": _total(tasks, "a"), "b": _total(tasks, "b")},
            "only_a": sum(1 for v in by_task.values() if a in v and b not in v),
            "only_b": sum(1 for v in by_task.values() if b in v and a not in v), "sql": sql, "error": answer.error}


def _total(tasks: list[dict[str, Any]], side: str) -> dict[str, Any]:
    """Means over the shared tasks, each task weighted by its attempts."""
    attempts = sum(t[side]["attempts"] for t in tasks)
    def mean(name: str) -> float | None:
        pairs = [(t[side][name], t[side]["attempts"]) for t in tasks if t[side][name] is not None]
        weight = sum(n for _, n in pairs)
        return sum(v * n for v, n in pairs) / weight if weight else None
    return {"attempts": attempts, "reward_mean": mean("reward_mean"), "pass_rate": mean("pass_rate"),
            "length_mean": mean("length_mean")}
