#!/usr/bin/env python3
"""Figures of a Python project's shape: import cycles between components and between modules, long
functions and files, the CLI's size, mypy-strict coverage, ruff findings, environment variables used
outside a settings model, and the top-level import names the wheel installs.

    python scripts/code_report.py ROOT [--json] [--ruff-select E,F,W,...]

Product code is every package under ROOT (a top-level folder with an __init__.py, and its
subpackages) except tests/, bench/, examples/, native/, deploy/ and scripts/. Symlinked folders are
followed; each real file counts once. Stdlib only; ruff runs as a subprocess.
"""
from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

NOT_PRODUCT = {"tests", "bench", "examples", "native", "deploy", "scripts", ".venv"}
LONG_FUNCTION, LONG_FILE = 40, 400
ENV_WRITES = {"setdefault", "update", "pop", "popitem", "clear", "__setitem__", "__delitem__"}


@dataclass
class Module:
    name: str
    path: Path  # as reached from ROOT (through a symlink if that is how the package mounts it)
    tree: ast.Module
    lines: int


@dataclass(frozen=True)
class Import:
    source: str
    target: str
    site: str  # file:line
    where: str  # "module", "function" (runs when called) or "type-checking" (never at runtime)


def component(module: str) -> str:
    """the top-level package; the grab-bag `agentstream` is split by its direct child"""
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "agentstream" and len(parts) > 1 else parts[0]


def find_modules(root: Path) -> tuple[dict[str, Module], dict[str, str]]:
    """The product's modules by name, and every name a file is reachable by -> its canonical name
    (the deepest: `agentstream.gateway.app` over `gateway.app` when one folder links the other)."""
    names: dict[str, list[tuple[str, Path]]] = defaultdict(list)  # real path -> (name, path)
    for top in sorted(root.iterdir()):
        if top.name in NOT_PRODUCT or not (top / "__init__.py").is_file():
            continue
        walked: set[str] = set()  # a symlink loop would otherwise never end
        for folder, dirs, files in os.walk(top, followlinks=True):
            here = Path(folder)
            if not (here / "__init__.py").is_file() or os.path.realpath(here) in walked:
                dirs.clear()
                continue
            walked.add(os.path.realpath(here))
            package = here.relative_to(root).parts
            for file in sorted(f for f in files if f.endswith(".py")):
                parts = package if file == "__init__.py" else (*package, file[:-3])
                names[os.path.realpath(here / file)].append((".".join(parts), here / file))
    modules: dict[str, Module] = {}
    aliases: dict[str, str] = {}
    for candidates in names.values():
        name, path = max(candidates, key=lambda c: (c[0].count("."), c[0]))
        text = path.read_text(encoding="utf-8")
        modules[name] = Module(name, path, ast.parse(text, str(path)), len(text.splitlines()))
        aliases.update((alias, name) for alias, _ in candidates)
    return modules, aliases


def imports_of(module: Module, aliases: dict[str, str], root: Path) -> list[Import]:
    """Every import statement at any depth that names a product module, resolved to that module."""
    package = module.name if module.path.name == "__init__.py" else module.name.rpartition(".")[0]
    found: list[Import] = []

    def resolve(dotted: str) -> str | None:
        while dotted and dotted not in aliases:
            dotted = dotted.rpartition(".")[0]
        return aliases.get(dotted)

    def visit(node: ast.AST, where: str) -> None:
        for child in ast.iter_child_nodes(node):
            targets: list[str] = []
            if isinstance(child, ast.Import):
                targets = [alias.name for alias in child.names]
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:  # relative: `.` is this package, `..` its parent
                    kept = package.split(".")[: len(package.split(".")) - child.level + 1]
                    base = ".".join([*kept, *([child.module] if child.module else [])])
                targets = [f"{base}.{alias.name}" for alias in child.names]
            for target in sorted({t for t in map(resolve, targets) if t and t != module.name}):
                site = f"{module.path.relative_to(root)}:{getattr(child, 'lineno', 0)}"
                found.append(Import(module.name, target, site, where))
            inner = where
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                inner = "type-checking"
            elif isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda) and where == "module":
                inner = "function"
            visit(child, inner)

    visit(module.tree, "module")
    return found


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node, largest first (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if nxt not in index:
                connect(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            scc = stack[stack.index(node):]
            del stack[stack.index(node):]
            if len(scc) > 1:
                found.append(sorted(scc))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for node in sorted(edges):
        if node not in index:
            connect(node)
    return sorted(found, key=len, reverse=True)


def import_cycles(imports: list[Import]) -> dict[str, Any]:
    """Component cycles with the edges inside each (fewest import sites first: the cheapest to
    cut), and module cycles."""
    sites: dict[tuple[str, str], list[Import]] = defaultdict(list)
    module_edges: dict[str, set[str]] = defaultdict(set)
    for imp in imports:
        module_edges[imp.source].add(imp.target)
        if component(imp.source) != component(imp.target):
            sites[(component(imp.source), component(imp.target))].append(imp)
    component_edges: dict[str, set[str]] = defaultdict(set)
    for source, target in sites:
        component_edges[source].add(target)
    found = []
    for scc in cycles(component_edges):
        inside = sorted((e for e in sites if e[0] in scc and e[1] in scc), key=lambda e: (len(sites[e]), e))
        edges = [{"from": s, "to": t, "sites": [f"{i.site} ({i.where})" for i in sites[(s, t)]]}
                 for s, t in inside]
        found.append({"components": scc, "edges": edges})
    module_sccs = cycles(module_edges)
    return {"component_cycles": found, "module_sccs": module_sccs,
            "module_scc_largest": len(module_sccs[0]) if module_sccs else 0}


def functions(modules: dict[str, Module], root: Path) -> dict[str, Any]:
    found: list[tuple[int, str, str]] = []  # (lines, Class.name, file:line)

    def visit(node: ast.AST, prefix: str, path: Path) -> None:
        for child in ast.iter_child_nodes(node):
            if not isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                visit(child, prefix, path)
                continue
            if not isinstance(child, ast.ClassDef):
                length = (child.end_lineno or child.lineno) - child.lineno + 1
                found.append((length, prefix + child.name, f"{path.relative_to(root)}:{child.lineno}"))
            visit(child, f"{prefix}{child.name}.", path)

    for module in modules.values():
        visit(module.tree, "", module.path)
    found.sort(reverse=True)
    over = [{"lines": n, "name": name, "site": site} for n, name, site in found if n > LONG_FUNCTION]
    return {"count": len(found), "over_40": len(over), "longest": over[:10]}


def env_access(module: Module, root: Path) -> list[dict[str, str]]:
    """os.environ / os.getenv uses outside a BaseSettings class: site, kind, read or write."""
    tree = module.tree
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    imported = {a.asname or a.name for n in ast.walk(tree)  # `from os import environ, getenv`
                if isinstance(n, ast.ImportFrom) and n.module == "os" for a in n.names}
    environ = {"os.environ"} | ({"environ"} & imported)
    found: list[dict[str, str]] = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute | ast.Name):
            continue
        text, parent = ast.unparse(node), parents.get(node)
        if text in ({"os.getenv", "os.putenv", "os.unsetenv"} | ({"getenv"} & imported)):
            kind = text.removeprefix("os.")
            mode = "read" if kind == "getenv" else "write"
        elif text in environ and isinstance(parent, ast.Subscript):
            mode = "read" if isinstance(parent.ctx, ast.Load) else "write"
            kind = "environ[]" if mode == "read" else "environ[] ="
        elif text in environ and isinstance(parent, ast.Attribute):
            kind, mode = f"environ.{parent.attr}", "write" if parent.attr in ENV_WRITES else "read"
        elif text in environ and not isinstance(parent, ast.ImportFrom):
            kind, mode = "environ (whole)", "read"
        else:
            continue
        owner = parent
        while owner is not None and not (isinstance(owner, ast.ClassDef)
                                         and any("BaseSettings" in ast.unparse(b) for b in owner.bases)):
            owner = parents.get(owner)
        if owner is None:
            site = f"{module.path.relative_to(root)}:{node.lineno}"
            found.append({"site": site, "kind": kind, "mode": mode})
    return found


def ruff(root: Path, files: list[Path], select: str | None) -> dict[str, Any]:
    """ruff's counts per rule: with `select` (ROOT's config ignored), else with ROOT's own config."""
    found = shutil.which("ruff")
    if not found and importlib.util.find_spec("ruff") is None:
        sys.exit("ruff is not installed: `pip install ruff` (or `uv tool install ruff`), then run this again")
    command = [found] if found else [sys.executable, "-m", "ruff"]
    args = ["check", "--no-cache", "--statistics", "--output-format", "json"]
    if select:
        project = tomllib.loads((root / "pyproject.toml").read_text()).get("project", {})
        minor = re.search(r">=\s*3\.(\d+)", project.get("requires-python", ""))
        args += ["--isolated", "--select", select, "--line-length", "110"]
        args += [f"--target-version=py3{minor.group(1)}"] if minor else []
    else:
        args += ["--config", str(root / "pyproject.toml"), "--force-exclude"]

    def run(*words: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*command, *words], cwd=root, capture_output=True, text=True, check=False)

    done = run(*args, *map(str, files))
    if done.returncode not in (0, 1):
        sys.exit(f"ruff failed: {done.stderr.strip()}")
    rules = sorted(json.loads(done.stdout or "[]"), key=lambda rule: -rule["count"])
    version = run("--version").stdout.strip()
    rule_set = f"{select}, line length 110" if select else "the project's config"
    return {"ruff": version, "select": rule_set, "total": sum(r["count"] for r in rules),
            "by_rule": {f"{r['code']} {r['name']}": r["count"] for r in rules}}


def as_list(value: str | list[str]) -> list[str]:
    """A mypy option given as a comma-separated string or a list."""
    return value.split(",") if isinstance(value, str) else value


def mypy_strict(tool: dict[str, Any], modules: list[str]) -> dict[str, Any]:
    """[tool.mypy] files and packages against the components: all of a component's modules strict, some, or none."""
    mypy = tool.get("mypy", {})
    listed = [name for key in ("files", "packages") for name in as_list(mypy.get(key, []))]
    files = [f.strip().removesuffix(".py").strip("/").replace("/", ".") for f in listed]
    by_component: dict[str, list[bool]] = defaultdict(list)
    for name in modules:
        by_component[component(name)].append(any(name == f or name.startswith(f + ".") for f in files))
    status = {c: "strict" if all(s) else "part" if any(s) else "no" for c, s in sorted(by_component.items())}
    return {"files": files, "components": status}


def report(root: Path, select: str) -> dict[str, Any]:
    modules, aliases = find_modules(root)
    imports = [imp for m in modules.values() for imp in imports_of(m, aliases, root)]
    tool = tomllib.loads((root / "pyproject.toml").read_text()).get("tool", {})
    cli = sorted(((m.lines, str(m.path.relative_to(root))) for name, m in modules.items()
                  if name == "agentstream.cli" or name.startswith("agentstream.cli.")), reverse=True)
    env = [hit for m in modules.values() if m.path.name != "settings.py" for hit in env_access(m, root)]
    env.sort(key=lambda hit: (hit["site"].split(":")[0], int(hit["site"].split(":")[1])))
    include = tool.get("setuptools", {}).get("packages", {}).get("find", {}).get("include", [])
    files = sorted(m.path for m in modules.values())
    return {
        "root": str(root), "modules": len(modules), "lines": sum(m.lines for m in modules.values()),
        "imports": {"total": len(imports), "in_functions": sum(i.where == "function" for i in imports),
                    "type_checking": sum(i.where == "type-checking" for i in imports)},
        **import_cycles(imports),
        "functions": functions(modules, root),
        "long_files": [{"lines": m.lines, "file": str(m.path.relative_to(root))}
                       for m in sorted(modules.values(), key=lambda m: -m.lines) if m.lines > LONG_FILE],
        "cli": {"lines": sum(n for n, _ in cli), "files": len(cli), "largest": cli[0] if cli else None},
        "mypy_strict": mypy_strict(tool, list(modules)),
        "ruff": ruff(root, files, select),
        "ruff_project": ruff(root, files, None) if "ruff" in tool else None,
        "env": {"reads": sum(hit["mode"] == "read" for hit in env),
                "writes": sum(hit["mode"] == "write" for hit in env), "sites": env},
        "wheel_top_level": sorted({pattern.split(".")[0].rstrip("*") for pattern in include}),
    }


def print_text(r: dict[str, Any]) -> None:
    imports, components = r["imports"], r["mypy_strict"]["components"]
    print(f"{r['root']}: {r['modules']} modules, {r['lines']} lines, {len(components)} components")
    print(f"\n1. import cycles ({imports['total']} internal imports: {imports['in_functions']} inside "
          f"functions, {imports['type_checking']} under TYPE_CHECKING)")
    print(f"   component cycles (SCCs > 1): {len(r['component_cycles'])}")
    for scc in r["component_cycles"]:
        print(f"   - {' <-> '.join(scc['components'])}")
        for edge in scc["edges"]:
            more = " ..." if len(edge["sites"]) > 4 else ""
            print(f"       {edge['from']} -> {edge['to']} ({len(edge['sites'])}): "
                  f"{', '.join(edge['sites'][:4])}{more}")
    print(f"   module cycles: {len(r['module_sccs'])} SCCs, largest {r['module_scc_largest']} modules")
    for modules in r["module_sccs"]:
        print(f"   - ({len(modules)}) {', '.join(modules)}")
    functions = r["functions"]
    print(f"\n2. functions: {functions['count']}; over {LONG_FUNCTION} lines: {functions['over_40']}; "
          "the longest:")
    for function in functions["longest"]:
        print(f"   {function['lines']:5}  {function['name']}  {function['site']}")
    print(f"\n3. files over {LONG_FILE} lines: {len(r['long_files'])}")
    for file in r["long_files"]:
        print(f"   {file['lines']:5}  {file['file']}")
    cli = r["cli"]
    print(f"\n4. CLI: {cli['lines']} lines in {cli['files']} file(s); largest: {cli['largest']}")
    print(f"\n5. mypy strict files: {', '.join(r['mypy_strict']['files'])}")
    for status in ("strict", "part", "no"):
        print(f"   {status:6}  {', '.join(c for c, s in components.items() if s == status) or '-'}")
    for run in filter(None, (r["ruff"], r["ruff_project"])):
        print(f"\n6. ruff ({run['ruff']}; {run['select']}): {run['total']} findings")
        for rule, count in list(run["by_rule"].items())[:12]:
            print(f"   {count:5}  {rule}")
    print(f"\n7. environment outside settings: {r['env']['reads']} reads, {r['env']['writes']} writes")
    for hit in r["env"]["sites"]:
        print(f"   {hit['mode']:5}  {hit['kind']:18}  {hit['site']}")
    names = r["wheel_top_level"]
    print(f"\n8. the wheel's top-level import names: {len(names)}: {', '.join(names)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("root", type=Path)
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    parser.add_argument("--ruff-select", default="E,F,W,I,UP,B,SIM,RUF")
    args = parser.parse_args()
    figures = report(args.root.resolve(), args.ruff_select)
    if args.json:
        print(json.dumps(figures, indent=2))
    else:
        print_text(figures)


if __name__ == "__main__":
    main()
