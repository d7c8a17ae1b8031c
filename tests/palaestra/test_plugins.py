"""`palaestra.plugins.load_object`: the one loader of ``package.module:attribute``, and its errors."""

from __future__ import annotations

import sys
import textwrap

import pytest

from palaestra.plugins import PluginError, is_import_path, load_object
from palaestra.sdk import Environment, load_environment


@pytest.fixture
def plugin_dir(tmp_path, monkeypatch):
    """A working directory holding a plug-in package, as a user's project would (not on sys.path)."""
    pkg = tmp_path / "myplugins"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "mod.py").write_text(
        textwrap.dedent(
            """
            from palaestra.sdk import Environment

            VALUE = 3

            def route(sample, teachers):
                return teachers[0]

            class Factory:
                @staticmethod
                def make():
                    return "made"

            class NotAnEnv:
                pass

            class WordEnv(Environment):
                name = "word"

                def tasks(self, split="train"):
                    return []

                async def rollout(self, session, task):
                    raise NotImplementedError
            """
        )
    )
    (pkg / "broken.py").write_text("import no_such_dependency_xyz\n")
    (pkg / "raises.py").write_text("raise RuntimeError('boom at import')\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    yield tmp_path
    for name in [m for m in sys.modules if m == "myplugins" or m.startswith("myplugins.")]:
        del sys.modules[name]


def test_finds_modules_in_the_working_directory(plugin_dir):
    assert load_object("myplugins.mod:VALUE", "thing") == 3
    assert load_object("myplugins.mod:Factory.make", "thing", callable_=True)() == "made"
    assert str(plugin_dir) == sys.path[-1]  # appended: never shadows an installed package


def test_an_environment_by_path_from_the_working_directory(plugin_dir):
    env = load_environment("myplugins.mod:WordEnv")
    assert isinstance(env, Environment) and env.name == "word"


@pytest.mark.parametrize(
    ("path", "kwargs", "message"),
    [
        ("myplugins.nope:X", {}, r"no module named 'myplugins.nope'.*working directory.*PYTHONPATH"),
        ("elsewhere.mod:X", {}, r"no module named 'elsewhere'.*run from the directory that holds 'elsewhere'"),
        ("myplugins.broken:X", {}, r"importing 'myplugins.broken' failed: No module named 'no_such_dependency_xyz'"),
        ("myplugins.raises:X", {}, r"importing 'myplugins.raises' raised RuntimeError: boom at import"),
        ("myplugins.mod:Missing", {}, r"'myplugins.mod' has no attribute 'Missing' \(it has: .*WordEnv"),
        ("myplugins.mod:Factory.nope", {}, r"'myplugins.mod:Factory' has no attribute 'nope'"),
        ("myplugins.mod:VALUE", {"callable_": True}, r"is a int \(3\), which is not callable"),
        ("myplugins.mod:NotAnEnv", {"subclass_of": Environment}, r"is the class myplugins.mod.NotAnEnv, not a subclass of palaestra.sdk.environment.Environment"),
        ("myplugins.mod:route", {"instance_of": str}, r"is the function route, not an instance of str"),
        ("no-colon-here", {}, r"expected an import path 'package.module:attribute'"),
    ],
)  # fmt: skip
def test_each_failure_names_the_path_the_kind_and_what_failed(plugin_dir, path, kwargs, message):
    with pytest.raises(PluginError, match=message) as info:
        load_object(path, "widget", **kwargs)
    assert str(info.value).startswith(f"widget {path!r}")


def test_import_path_shape():
    assert is_import_path("pkg.mod:attr")
    assert not is_import_path("http://host:8000")
    assert not is_import_path("local")
    assert not is_import_path(":attr") and not is_import_path("mod:")


def test_every_loader_uses_it(plugin_dir):
    """The five places that took an import path each had their own loader and errors; now one."""
    from palaestra.environments.episode import resolve_backend
    from palaestra.gateway.parsers import get_tool_parser
    from palaestra.models.registry import Preset
    from palaestra.trainer.opd_panel import load_route_fn

    for call in (
        lambda: load_environment("myplugins.nope:X"),
        lambda: resolve_backend("myplugins.nope:X"),
        lambda: get_tool_parser("myplugins.nope:X"),
        lambda: load_route_fn("myplugins.nope:X"),
        lambda: Preset("myplugins.nope:X", "").load_recipe(),
    ):
        with pytest.raises(PluginError, match="no module named 'myplugins.nope'"):
            call()
