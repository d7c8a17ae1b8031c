"""Docs that stay true: cheap checks of text against the code it describes.

* docs/architecture.md's module list names every module of the package folders (the
  `package-dir` and `packages` of pyproject.toml), each under its folder, and no module that is gone;
* every help text that lists environments is built from `palaestra.sdk.registry.BUILTIN`;
* palaestra/cli.py's docstring names every command `palaestra --help` lists;
* no help text prints a doubled ``%%`` (argparse %-formats `help=`, not `description=`).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


# ----------------------------------------------------------------------------------------------
# docs/architecture.md's module list
# ----------------------------------------------------------------------------------------------
def package_modules() -> set[str]:
    """Every module of the distribution as ``folder/path.py`` (e.g. ``sandbox/images/build.py``),
    from pyproject.toml: each package of `packages` in the folder `package-dir` maps it to.
    ``__init__.py`` and ``__main__.py`` are left out (a package's docstring, not a module's line)."""
    setup = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    dirs: dict[str, str] = setup["package-dir"]
    modules = set()
    for package in setup["packages"]:
        root = max((p for p in dirs if package == p or package.startswith(p + ".")), key=len)
        folder = Path(dirs[root], *package[len(root) :].split(".")[1:])
        assert (ROOT / folder / "__init__.py").is_file(), f"pyproject.toml lists {package}, not at {folder}"
        for path in (ROOT / folder).glob("*.py"):
            if path.name not in ("__init__.py", "__main__.py"):
                modules.add(path.relative_to(ROOT).as_posix())
    return modules


def documented_modules(text: str) -> set[str]:
    """The modules docs/architecture.md's "## Modules" section names, as ``folder/path.py``.

    Each bullet is ``- `folder/`: ...``; a backticked ``name.py`` belongs to the folder, or to the
    subfolder whose backticked ``sub/`` the parentheses it sits in follow (``sub/` (`a.py`, ...)``);
    other parentheses are prose and change nothing."""
    section = text.split("## Modules", 1)[1].split("\n## ", 1)[0]
    named = set()
    for line in section.splitlines():
        head = re.match(r"- `([\w/]+)/`: ", line)
        if not head:
            continue
        stack, pending, rest, last = [head.group(1)], None, line[head.end() :], 0
        for m in re.finditer(r"`([^`]+)`|\(|\)", rest):
            token, between, last = m.group(1), rest[last : m.start()], m.end()
            if m.group(0) == "(":
                follows = pending is not None and not between.strip()
                stack.append(f"{stack[-1]}/{pending}" if follows else stack[-1])
            elif m.group(0) == ")":
                if len(stack) > 1:
                    stack.pop()
            elif token.endswith(".py"):
                named.add(f"{stack[-1]}/{token}")
            pending = token[:-1] if token and token.endswith("/") else None
    return named


def test_the_parser_reads_folders_subfolders_and_prose():
    text = (
        "## Modules\n"
        "- `pkg/`: `a.py` (prose naming `other.py`), `sub/` (`b.py`, `c.py` (prose)), `d.py`.\n"
        "- `two/`: `sub/`, `e.py` + `f.py`\n"
        "## Next\n- `pkg/`: `never.py`\n"
    )
    assert documented_modules(text) == {
        "pkg/a.py",
        "pkg/other.py",  # inside prose parentheses still the folder's: names only the folder owns
        "pkg/sub/b.py",
        "pkg/sub/c.py",
        "pkg/d.py",
        "two/e.py",
        "two/f.py",
    }


def test_architecture_names_every_module_and_no_missing_one():
    modules = package_modules()
    assert len(modules) > 100 and "sandbox/images/build.py" in modules
    named = documented_modules((ROOT / "docs" / "architecture.md").read_text())
    missing = sorted(modules - named)
    assert not missing, (
        f"docs/architecture.md's module list (## Modules) does not name {len(missing)} module(s): "
        f"{', '.join(missing)}. Add each to its folder's line, a subfolder's inside `sub/` (...)"
    )
    gone = sorted(named - modules)
    assert not gone, f"docs/architecture.md names module(s) that do not exist: {', '.join(gone)}"


# ----------------------------------------------------------------------------------------------
# Help texts
# ----------------------------------------------------------------------------------------------
def subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """Every (sub-)command's parser by its command line, ``palaestra``, ``palaestra engine serve``..."""
    found = {parser.prog: parser}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in dict.fromkeys(action.choices.values()):  # aliases share a parser
                found |= subparsers(child)
    return found


def test_help_texts_list_the_environments_of_the_registry(monkeypatch):
    """Registered in BUILTIN, a name appears in every help text that lists environments; none of
    them holds a list of its own."""
    from palaestra.cli import build_parser
    from palaestra.config import config_help
    from palaestra.sdk import registry

    monkeypatch.setitem(registry.BUILTIN, "fake-env-for-help", "fake.module:Env")
    parsers = subparsers(build_parser())
    names = registry.builtin_names()
    assert names.startswith("math, math-tool, code, swe, reasoning-gym, textarena, mix")
    assert names.endswith(", fake-env-for-help")
    for command in ("palaestra rollout", "palaestra eval", "palaestra train"):
        # argparse wraps a line after a hyphen: "fake-env-for-\n    help" is the name unbroken
        text = " ".join(re.sub(r"-\n\s+", "-", parsers[command].format_help()).split())
        assert names in text, command
    assert f"built-in: {names}" in " ".join(config_help().split())


def test_the_docs_show_every_built_in_environment():
    from palaestra.sdk.registry import BUILTIN

    environments = (ROOT / "docs" / "environments.md").read_text()
    training = (ROOT / "docs" / "training.md").read_text()
    env_row = next(line for line in training.splitlines() if line.startswith("| `env` |"))
    for name in BUILTIN:
        assert f"--env {name} " in environments or f"--env {name}`" in environments, name
        assert f"`{name}`" in env_row, f"docs/training.md's env row does not list {name}"


def test_the_cli_docstring_names_every_command():
    import palaestra.cli
    from palaestra.cli import build_parser

    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    doc = palaestra.cli.__doc__ or ""
    missing = [name for name in commands.choices if not re.search(rf"palaestra .*\b{re.escape(name)}\b", doc)]
    assert not missing, f"palaestra/cli.py's docstring does not name: {missing}"


def test_each_command_is_built_from_the_module_that_registers_it():
    """`palaestra <command>` builds only COMMANDS[command]'s parser: the table must name, for every
    command, the module whose `register` adds it, and nothing else."""
    import importlib

    from palaestra.cli import COMMANDS

    registered: dict[str, str] = {}
    for module in dict.fromkeys(COMMANDS.values()):
        groups = argparse.ArgumentParser().add_subparsers()
        importlib.import_module(module).register(groups)
        registered |= {name: module for name in groups.choices}
    assert registered == COMMANDS


def test_a_server_command_starts_without_torch_openai_or_ray():
    """`palaestra gateway serve --help` (and so a gateway's or a router's start-up) imports only its
    own command's module: no torch (~1 s), openai or Ray, which other commands need."""
    code = (
        "import sys\n"
        "from palaestra.cli import main\n"
        "for argv in (['gateway', 'serve', '--help'], ['router', 'serve', '--help'], ['sandbox', '--help']):\n"
        "    try:\n"
        "        main(argv)\n"
        "    except SystemExit as exc:\n"
        "        assert exc.code == 0, (argv, exc.code)\n"
        "print(sorted({'torch', 'openai', 'ray'} & set(sys.modules)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout[-2000:]


def test_no_help_text_prints_a_doubled_percent():
    from palaestra.cli import build_parser

    parsers = subparsers(build_parser())
    assert len(parsers) > 15
    doubled = [command for command, parser in parsers.items() if "%%" in parser.format_help()]
    assert not doubled, f"these --help texts print '%%': {doubled}"
