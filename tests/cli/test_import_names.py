"""No module is imported by a bare top-level name (`gateway`, `schemas`, …): the folders are `agentstream`'s
subpackages (linked in), and with the checkout on sys.path (`pythonpath = ["."]`) `schemas.errors` would load a
second copy of `agentstream.schemas.errors`, whose errors the first copy's `except` does not catch."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[2]
BARE = {path.name for path in (ROOT / "agentstream").iterdir() if path.is_symlink()}
SOURCES = ("agentstream", "tests", "bench", "samples", "scripts", "deploy")


def imported(tree: ast.AST) -> list[tuple[int, str]]:
    names: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.append((node.lineno, node.module))
    return names


def test_no_source_imports_a_bare_top_level_name():
    assert {"gateway", "schemas", "streams", "trainer"} <= BARE
    found = []
    for folder in SOURCES:
        for path in sorted((ROOT / folder).rglob("*.py")):
            if ".venv" in path.parts:
                continue
            for line, name in imported(ast.parse(path.read_text(), str(path))):
                if name.partition(".")[0] in BARE:
                    found.append(f"{path.relative_to(ROOT)}:{line}: {name}")
    assert not found, "import these as agentstream.<name>: " + ", ".join(found)


def test_the_services_and_the_cli_load_each_module_once():
    """The entrypoints' imports, and the built-in reward names tasks carry (`streams.rewards:…`), in one process:
    no module under a bare name."""
    code = ("import sys, agentstream.cli, agentstream.gateway.app, agentstream.streams.app, agentstream.controller.controller, "
            "agentstream.releases.judge, agentstream.dashboard.app, agentstream.eval\n"
            "from agentstream.streams.rewards import load\n"
            "load('streams.rewards:character_share'); load('recipes.swe.regrade:grade_diff')\n"
            f"print(sorted(m for m in sys.modules if m.partition('.')[0] in {sorted(BARE)!r}))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]", result.stdout
