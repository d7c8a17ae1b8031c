"""Planting bugs by editing a module's syntax tree (the idea of SWE-smith's procedural
generator): each mutation finds one node, changes it, and rewrites only that node's source span,
so the rest of the file — and the diff that fixes it — stays as the author wrote it.

Bug kinds:

- ``off_by_one``: an integer constant moved by one, or a boundary comparison flipped
  (``<`` / ``<=``, ``>`` / ``>=``);
- ``wrong_operator``: ``+``/``-``, ``*``/``//``, ``and``/``or``, ``==``/``!=``, ``<``/``>``,
  ``in``/``not in``;
- ``missing_case``: a guard clause (an ``if`` without ``else`` that returns, raises or continues)
  or the last ``elif`` branch removed;
- ``wrong_default``: a keyword parameter's default changed (numbers moved, booleans flipped,
  strings replaced);
- ``swapped_arguments``: the first two positional arguments of a call swapped.
"""

from __future__ import annotations

import ast
import copy
from collections.abc import Iterator
from dataclasses import dataclass

KINDS = ("off_by_one", "wrong_operator", "missing_case", "wrong_default", "swapped_arguments")

SWAP_OPS = {
    ast.Add: ast.Sub,
    ast.Sub: ast.Add,
    ast.Mult: ast.FloorDiv,
    ast.FloorDiv: ast.Mult,
    ast.And: ast.Or,
    ast.Or: ast.And,
    ast.Eq: ast.NotEq,
    ast.NotEq: ast.Eq,
    ast.Lt: ast.Gt,
    ast.Gt: ast.Lt,
    ast.In: ast.NotIn,
    ast.NotIn: ast.In,
}
BOUNDARY = {ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt}
SYMBOL = {
    ast.Add: "+",
    ast.Sub: "-",
    ast.Mult: "*",
    ast.FloorDiv: "//",
    ast.And: "and",
    ast.Or: "or",
    ast.Eq: "==",
    ast.NotEq: "!=",
    ast.Lt: "<",
    ast.Gt: ">",
    ast.LtE: "<=",
    ast.GtE: ">=",
    ast.In: "in",
    ast.NotIn: "not in",
}


@dataclass(frozen=True)
class Mutation:
    kind: str
    path: str
    function: str
    """The function (``Class.method`` or ``name``) the bug is in."""
    line: int
    description: str
    source: str
    """The whole mutated file."""


def _offsets(source: str) -> list[int]:
    """Byte offset of each line's start (ast columns are UTF-8 byte offsets)."""
    starts, total = [0], 0
    for line in source.encode().splitlines(keepends=True):
        total += len(line)
        starts.append(total)
    return starts


def _replace(source: str, node: ast.AST, text: str) -> str:
    starts = _offsets(source)
    data = source.encode()
    begin = starts[node.lineno - 1] + node.col_offset
    end = starts[node.end_lineno - 1] + node.end_col_offset
    return (data[:begin] + text.encode() + data[end:]).decode()


def _remove_lines(source: str, first: int, last: int, indent: int | None) -> str:
    """Drops lines first..last (1-based); with ``indent``, leaves a ``pass`` so the block stays valid."""
    lines = source.splitlines(keepends=True)
    filler = [" " * indent + "pass\n"] if indent is not None else []
    return "".join(lines[: first - 1] + filler + lines[last:])


class _Sites(ast.NodeVisitor):
    """Walks a module, remembering the enclosing function of each node."""

    def __init__(self) -> None:
        self.stack: list[str] = []
        self.found: list[tuple[str, ast.AST, str]] = []  # (function, node, role)

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self.stack.append(node.name)
        self.generic_visit(node)
        self.stack.pop()

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        self.stack.append(node.name)
        self.found.append((self.function, node, "def"))
        for child in ast.iter_child_nodes(node):
            self.visit(child)
        self.stack.pop()

    @property
    def function(self) -> str:
        return ".".join(self.stack)

    def generic_visit(self, node: ast.AST) -> None:
        if self.stack and not isinstance(node, (ast.Module, ast.ClassDef)):
            self.found.append((self.function, node, "node"))
        super().generic_visit(node)


def mutations(path: str, source: str) -> Iterator[Mutation]:
    """Every mutation of every kind this module admits, in source order. Each compiles."""
    tree = ast.parse(source)
    sites = _Sites()
    sites.visit(tree)
    parents = {child: parent for parent in ast.walk(tree) for child in ast.iter_child_nodes(parent)}
    for function, node, role in sites.found:
        if not function:
            continue
        for kind, description, new_source in _mutate(source, node, role, parents):
            if new_source == source:
                continue
            try:
                compile(new_source, path, "exec")
            except SyntaxError:
                continue
            yield Mutation(kind, path, function, node.lineno, description, new_source)


def _mutate(source: str, node: ast.AST, role: str, parents: dict) -> Iterator[tuple[str, str, str]]:
    parent = parents.get(node)
    if role == "def":
        args = node.args
        positional = args.args[len(args.args) - len(args.defaults) :]
        pairs = list(zip(positional, args.defaults, strict=True)) + [
            (a, d) for a, d in zip(args.kwonlyargs, args.kw_defaults, strict=True) if d is not None
        ]
        for arg, default in pairs:
            changed = _other_default(default)
            if changed is not None:
                new = ast.unparse(changed)
                yield (
                    "wrong_default",
                    f"default of {arg.arg!r} changed from {ast.unparse(default)} to {new}",
                    _replace(source, default, new),
                )
        return
    if isinstance(node, ast.Constant) and type(node.value) is int and not isinstance(parent, ast.keyword):
        if isinstance(parent, (ast.Compare, ast.BinOp, ast.Subscript, ast.Slice, ast.Call, ast.Return)):
            for delta in (1, -1):
                value = node.value + delta
                if value >= 0 or node.value < 0:
                    yield (
                        "off_by_one",
                        f"constant {node.value} became {value}",
                        _replace(source, node, str(value)),
                    )
    if isinstance(node, ast.Compare) and len(node.ops) == 1:
        op = type(node.ops[0])
        for table, kind in ((BOUNDARY, "off_by_one"), (SWAP_OPS, "wrong_operator")):
            if op in table:
                changed = copy.deepcopy(node)
                changed.ops = [table[op]()]
                yield (
                    kind,
                    f"comparison {SYMBOL[op]} became {SYMBOL[table[op]]}",
                    _replace(source, node, ast.unparse(changed)),
                )
    if isinstance(node, ast.BinOp) and type(node.op) in SWAP_OPS:
        changed = copy.deepcopy(node)
        changed.op = SWAP_OPS[type(node.op)]()
        yield (
            "wrong_operator",
            f"operator {SYMBOL[type(node.op)]} became {SYMBOL[type(changed.op)]}",
            _replace(source, node, ast.unparse(changed)),
        )
    if isinstance(node, ast.BoolOp):
        changed = copy.deepcopy(node)
        changed.op = SWAP_OPS[type(node.op)]()
        yield (
            "wrong_operator",
            f"{SYMBOL[type(node.op)]} became {SYMBOL[type(changed.op)]}",
            _replace(source, node, ast.unparse(changed)),
        )
    if (
        isinstance(node, ast.Call)
        and len(node.args) >= 2
        and not any(isinstance(a, ast.Starred) for a in node.args)
    ):
        first, second = node.args[0], node.args[1]
        if ast.dump(first) != ast.dump(second):
            changed = copy.deepcopy(node)
            changed.args[0], changed.args[1] = changed.args[1], changed.args[0]
            yield (
                "swapped_arguments",
                f"arguments {ast.unparse(first)} and {ast.unparse(second)} of {ast.unparse(node.func)}() swapped",
                _replace(source, node, ast.unparse(changed)),
            )
    if isinstance(node, ast.If):
        yield from _missing_case(source, node, parent)


def _ends_branch(body: list[ast.stmt]) -> bool:
    return isinstance(body[-1], (ast.Return, ast.Raise, ast.Continue, ast.Break))


def _missing_case(source: str, node: ast.If, parent: ast.AST | None) -> Iterator[tuple[str, str, str]]:
    condition = ast.unparse(node.test)
    is_elif = isinstance(parent, ast.If) and parent.orelse == [node] and _starts_with(source, node, "elif")
    if is_elif and not node.orelse:
        yield (
            "missing_case",
            f"the branch `elif {condition}:` removed",
            _remove_lines(source, node.lineno, node.end_lineno, None),
        )
    elif not is_elif and not node.orelse and _ends_branch(node.body):
        block = next(
            (getattr(parent, f) for f in ("body", "orelse") if node in getattr(parent, f, [])),
            [],
        )
        indent = node.col_offset if len(block) == 1 else None
        yield (
            "missing_case",
            f"the case `if {condition}:` removed",
            _remove_lines(source, node.lineno, node.end_lineno, indent),
        )


def _starts_with(source: str, node: ast.AST, word: str) -> bool:
    line = source.splitlines()[node.lineno - 1]
    return line[node.col_offset - len(word) - 1 : node.col_offset].strip().startswith(
        word
    ) or line.strip().startswith(word)


def _other_default(default: ast.expr) -> ast.expr | None:
    if not isinstance(default, ast.Constant):
        return None
    value = default.value
    if isinstance(value, bool):
        return ast.Constant(not value)
    if isinstance(value, int):
        return ast.Constant(value + 1 if value <= 1 else value * 2)
    if isinstance(value, str):
        replacements = {"-": "_", "_": "-", " ": "", "$": "EUR", "...": "..", "#": "@"}
        return ast.Constant(replacements.get(value, value + "x" if value else " "))
    return None
