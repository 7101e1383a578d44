"""Benchmark output: a table on the terminal and a JSON file under bench/results/."""

from __future__ import annotations

import json
import os
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console
from rich.table import Table

RESULTS = Path(__file__).parent / "results"


@dataclass
class Report:
    name: str
    rows: list[tuple[str, str, float | None]] = field(default_factory=list)
    details: dict = field(default_factory=dict)
    """raw figures, written to the JSON file as they are"""

    def add(self, what: str, figure: str, ratio: float | None = None) -> None:
        self.rows.append((what, figure, ratio))

    def print(self, ratio_note: str = "ratio vs. baseline") -> None:
        table = Table(title=f"bench: {self.name}", caption=ratio_note)
        for column in ("measurement", "figure", "ratio"):
            table.add_column(column)
        for what, figure, ratio in self.rows:
            table.add_row(what, figure, "" if ratio is None else f"{ratio:.2f}×")
        Console().print(table)
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / f"{self.name}.json").write_text(json.dumps({
            "name": self.name, "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
            "rows": [{"measurement": w, "figure": f, "ratio": r} for w, f, r in self.rows],
            **({"details": self.details} if self.details else {}),
        }, indent=2) + "\n")
