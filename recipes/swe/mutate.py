"""Procedural bugs: one small edit of a function's source, found through the `ast`, made on the text.

After SWE-smith's procedural modifiers (swesmith.bug_gen.procedural.python), whose names the kinds
keep. SWE-smith is not used as a library: its modifiers run on libcst and its own code-entity
adapters, flip every matching node of a function at random (several edits per bug), and print the
whole function again. Here each candidate is one edit at one place, enumerated in a fixed order, and
made on the text at the node's own offsets, so the gold patch is the smallest diff and the same
source, seed and order always give the same bugs.

Kinds:
  flip_operator     `a < b` → `a >= b`, `==` ↔ `!=`, `in` ↔ `not in`, `is` ↔ `is not`
                    (func_pm_flip_operators)
  change_operator   `+` ↔ `-`, `*` ↔ `//`, `and` ↔ `or` (func_pm_op_change)
  off_by_one        an integer constant n → n + 1 (or n - 1), `<` ↔ `<=`, `>` ↔ `>=`
  invert_condition  `if c:` → `if not c:`, `while c:` → `while not c:` (func_pm_ctrl_invert_if)
  drop_branch       an `if` without `else` removed (func_pm_remove_cond)
  swap_operands     `a - b` → `b - a` for non-commutative operators (func_pm_op_swap)
  misspell_name     one use of a local name misspelled (`seq` → `sqe`): a NameError whose traceback
                    points at the line, the easiest rung (not SWE-smith's; built only when asked for,
                    `KINDS` are the default) for a model too small to solve the others
"""

from __future__ import annotations

import ast
import builtins
import hashlib
import re
from collections.abc import Iterator
from dataclasses import dataclass

FLIP_COMPARE = {ast.Lt: ">=", ast.LtE: ">", ast.Gt: "<=", ast.GtE: "<", ast.Eq: "!=", ast.NotEq: "==",
                ast.In: "not in", ast.NotIn: "in", ast.Is: "is not", ast.IsNot: "is"}
BOUNDARY = {ast.Lt: "<=", ast.LtE: "<", ast.Gt: ">=", ast.GtE: ">"}
CHANGE_BINOP = {ast.Add: "-", ast.Sub: "+", ast.Mult: "//", ast.FloorDiv: "*", ast.Div: "*", ast.Mod: "//",
                ast.BitAnd: "|", ast.BitOr: "&"}
TOKEN = {ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">=", ast.Eq: "==", ast.NotEq: "!=",
         ast.In: "in", ast.NotIn: r"not\s+in", ast.Is: "is", ast.IsNot: r"is\s+not", ast.Add: r"\+",
         ast.Sub: "-", ast.Mult: r"\*", ast.FloorDiv: "//", ast.Div: "/", ast.Mod: "%", ast.BitAnd: "&",
         ast.BitOr: r"\|", ast.And: "and", ast.Or: "or"}
NON_COMMUTATIVE = (ast.Sub, ast.Div, ast.FloorDiv, ast.Mod)
KINDS = ("flip_operator", "change_operator", "off_by_one", "invert_condition", "drop_branch", "swap_operands")
"""what a build injects unless told otherwise: SWE-smith's kinds"""
EASY_KINDS = ("misspell_name",)


@dataclass(frozen=True)
class Mutation:
    path: str
    kind: str
    line: int
    function: str
    start: int
    """byte offsets into the file's source"""
    end: int
    replacement: str
    original: str

    @property
    def key(self) -> str:
        """A stable short name: the same edit of the same source always gets the same key."""
        text = f"{self.path}:{self.start}:{self.end}:{self.kind}:{self.replacement}"
        return hashlib.sha256(text.encode()).hexdigest()[:8]

    def apply(self, source: str) -> str:
        data = source.encode()
        return (data[:self.start] + self.replacement.encode() + data[self.end:]).decode()


def mutations(path: str, source: str) -> list[Mutation]:
    """Every candidate edit of the functions in `source`, in source order; each compiles."""
    tree = ast.parse(source)
    data = source.encode()
    offsets = _line_offsets(data)
    taken = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)} | set(dir(builtins))
    found: list[Mutation] = []
    for function in _functions(tree):
        local = _local_names(function)
        for node in ast.walk(function):
            if not isinstance(node, (ast.expr, ast.stmt)):
                continue
            edits = list(_edits(node, data, offsets))
            if isinstance(node, ast.Name):
                edits += _misspell(node, local, taken, data, offsets)
            for kind, start, end, replacement in edits:
                found.append(Mutation(path, kind, node.lineno, function.name, start, end, replacement,
                                      data[start:end].decode()))
    unique = {(m.start, m.end, m.replacement): m for m in found}
    return sorted((m for m in unique.values() if _compiles(m.apply(source))), key=lambda m: (m.start, m.kind, m.replacement))


def _functions(tree: ast.AST) -> Iterator[ast.FunctionDef | ast.AsyncFunctionDef]:
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.name.startswith("__"):
            yield node


def _line_offsets(data: bytes) -> list[int]:
    offsets = [0]
    for index, byte in enumerate(data):
        if byte == 0x0A:
            offsets.append(index + 1)
    return offsets


def _at(offsets: list[int], line: int, col: int) -> int:
    return offsets[line - 1] + col


def _span(node: ast.expr | ast.stmt, offsets: list[int]) -> tuple[int, int]:
    return _at(offsets, node.lineno, node.col_offset), _at(offsets, end_line(node), _end_col(node))


def end_line(node: ast.expr | ast.stmt) -> int:
    # `ast.parse` gives every node its end; the type allows None for trees built by hand
    if node.end_lineno is None:
        raise ValueError(f"{type(node).__name__} at line {node.lineno} has no end position (not from ast.parse)")
    return node.end_lineno


def _end_col(node: ast.expr | ast.stmt) -> int:
    if node.end_col_offset is None:
        raise ValueError(f"{type(node).__name__} at line {node.lineno} has no end position (not from ast.parse)")
    return node.end_col_offset


def _operator_between(data: bytes, offsets: list[int], left: ast.expr, right: ast.expr,
                      op: type[ast.AST]) -> tuple[int, int] | None:
    """The operator's token between two operands (skipping closing and opening parentheses)."""
    start = _at(offsets, end_line(left), _end_col(left))
    end = _at(offsets, right.lineno, right.col_offset)
    gap = data[start:end].decode()
    if "#" in gap or "\\" in gap:
        return None
    match = re.search(rf"(?<![=<>!*/]){TOKEN[op]}(?![=<>*/])", gap)
    if not match:
        return None
    before = gap[:match.start()].strip(" \t\n)")
    after = gap[match.end():].strip(" \t\n(")
    if before or after:
        return None
    return start + len(gap[:match.start()].encode()), start + len(gap[:match.end()].encode())


def _edits(node: ast.expr | ast.stmt, data: bytes, offsets: list[int]) -> Iterator[tuple[str, int, int, str]]:
    if isinstance(node, ast.Compare):
        left = node.left
        for op, right in zip(node.ops, node.comparators):
            where = _operator_between(data, offsets, left, right, type(op))
            if where:
                if type(op) in FLIP_COMPARE:
                    yield "flip_operator", *where, FLIP_COMPARE[type(op)]
                if type(op) in BOUNDARY:
                    yield "off_by_one", *where, BOUNDARY[type(op)]
            left = right
    elif isinstance(node, ast.BinOp) and type(node.op) in CHANGE_BINOP:
        where = _operator_between(data, offsets, node.left, node.right, type(node.op))
        if where:
            yield "change_operator", *where, CHANGE_BINOP[type(node.op)]
            if isinstance(node.op, NON_COMMUTATIVE) and node.lineno == node.end_lineno:
                yield from _swap(node, data, offsets, where)
    elif isinstance(node, ast.BoolOp):
        other = "or" if isinstance(node.op, ast.And) else "and"
        for left, right in zip(node.values, node.values[1:]):
            where = _operator_between(data, offsets, left, right, type(node.op))
            if where and len(node.values) == 2:
                yield "change_operator", *where, other
    elif isinstance(node, ast.Constant) and type(node.value) is int and node.lineno == node.end_lineno:
        start, end = _span(node, offsets)
        if data[start:end].decode().isdigit():
            yield "off_by_one", start, end, str(node.value + 1)
            if node.value > 0:
                yield "off_by_one", start, end, str(node.value - 1)
    elif isinstance(node, (ast.If, ast.While)):
        if not (isinstance(node.test, ast.Compare) and len(node.test.ops) == 1):  # flip_operator does that
            yield from _invert(node, data, offsets)
        if isinstance(node, ast.If) and not node.orelse:
            yield from _drop(node, data, offsets)


def _swap(node: ast.BinOp, data: bytes, offsets: list[int], where: tuple[int, int]) -> Iterator[tuple[str, int, int, str]]:
    start, end = _span(node, offsets)
    left_start, left_end = _span(node.left, offsets)
    right_start, right_end = _span(node.right, offsets)
    if (left_start, right_end) != (start, end) or not all(isinstance(n, (ast.Name, ast.Constant, ast.Attribute))
                                                          for n in (node.left, node.right)):
        return
    text = data[right_start:right_end] + data[left_end:right_start] + data[left_start:left_end]
    yield "swap_operands", start, end, text.decode()


def _invert(node: ast.If | ast.While, data: bytes, offsets: list[int]) -> Iterator[tuple[str, int, int, str]]:
    test = node.test
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        start, end = _span(test, offsets)
        inner_start, inner_end = _span(test.operand, offsets)
        yield "invert_condition", start, end, data[inner_start:inner_end].decode()
        return
    start, end = _span(test, offsets)
    text = data[start:end].decode()
    simple = isinstance(test, (ast.Name, ast.Call, ast.Attribute, ast.Subscript, ast.Compare))
    yield "invert_condition", start, end, f"not {text}" if simple else f"not ({text})"


def _drop(node: ast.If, data: bytes, offsets: list[int]) -> Iterator[tuple[str, int, int, str]]:
    start = offsets[node.lineno - 1]
    line = data[start:offsets[node.lineno] if node.lineno < len(offsets) else len(data)].decode()
    if not line.lstrip().startswith("if ") or end_line(node) >= len(offsets):
        return  # an elif, or an if sharing its line
    end = offsets[end_line(node)]
    indent = line[:len(line) - len(line.lstrip())]
    yield "drop_branch", start, end, f"{indent}pass\n"


def _local_names(function: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    arguments = function.args
    every = [*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs, arguments.vararg, arguments.kwarg]
    stored = {node.id for node in ast.walk(function) if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store)}
    return {argument.arg for argument in every if argument} | stored


def _misspell(node: ast.Name, local: set[str], taken: set[str], data: bytes,
              offsets: list[int]) -> Iterator[tuple[str, int, int, str]]:
    """A read of a local name, its last two letters swapped (or its last doubled): a name nothing
    defines, so the line raises NameError when it runs."""
    if not isinstance(node.ctx, ast.Load) or node.id not in local:
        return
    start, end = _span(node, offsets)
    if data[start:end].decode() != node.id:
        return  # positions that are not the name's own text (3.11 gets some nested f-strings wrong)
    name = node.id
    typo = name[:-2] + name[-1] + name[-2] if len(name) >= 3 and name[-1] != name[-2] else name + name[-1]
    if typo not in taken:
        yield "misspell_name", start, end, typo


def _compiles(source: str) -> bool:
    try:
        compile(source, "<mutation>", "exec")
    except (SyntaxError, ValueError):
        return False
    return True
