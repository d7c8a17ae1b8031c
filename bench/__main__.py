"""Lists the benchmarks, one line each: the module to run and what it answers (its docstring's first
paragraph). Read from the source, so no benchmark is imported (nothing heavy starts)."""

from __future__ import annotations

import ast
from pathlib import Path

HERE = Path(__file__).resolve().parent


def benchmarks() -> dict[str, str]:
    """`bench.NAME` -> its question, for every module of this folder that runs as a script."""
    found = {}
    for path in sorted(HERE.glob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        runs = any(isinstance(node, ast.If) and "__main__" in ast.unparse(node.test) for node in tree.body)
        if path.stem.startswith("_") or not runs:
            continue
        doc = ast.get_docstring(tree) or "(no docstring)"
        found[f"bench.{path.stem}"] = " ".join(doc.split("\n\n", 1)[0].split())
    return found


def main() -> int:
    rows = benchmarks()
    width = max(map(len, rows))
    print("Run one from the repository root: .venv/bin/python -m bench.NAME [--help]\n")
    for name, question in rows.items():
        print(f"{name:{width}s}  {question}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
