"""A lower layer does not import a higher one, not even inside a function: the engine does not import
the model presets (`palaestra` resolves a preset name for `engine serve`), the presets do not import
an environment (a recipe built from an environment's tasks lives with that environment)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def imported_modules(folder: Path, root: Path = ROOT) -> dict[str, set[str]]:
    """Every module each file of `folder` imports, anywhere in the file (keys relative to `root`)."""
    found: dict[str, set[str]] = {}
    for path in sorted(folder.rglob("*.py")):
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names.add(node.module)
                names |= {f"{node.module}.{alias.name}" for alias in node.names}
        found[path.relative_to(root).as_posix()] = names
    return found


@pytest.mark.parametrize(
    ("folder", "higher"),
    [("engine", "palaestra.models"), ("palaestra/models", "palaestra.environments")],
)
def test_a_lower_layer_does_not_import_a_higher_one(folder, higher):
    offenders = {
        path: sorted(n for n in names if n == higher or n.startswith(higher + "."))
        for path, names in imported_modules(ROOT / folder).items()
    }
    offenders = {path: names for path, names in offenders.items() if names}
    assert not offenders, f"{folder}/ imports {higher}: {offenders}"


def test_the_scan_sees_imports_inside_functions(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "a.py").write_text("def f():\n    from palaestra.models import resolve_model\n")
    assert "palaestra.models.resolve_model" in imported_modules(tmp_path / "pkg", tmp_path)["pkg/a.py"]
