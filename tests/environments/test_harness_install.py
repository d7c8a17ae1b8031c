"""The harness registry and its install cache, without a registry: paths of npm and PyPI installs
laid out by hand in a temporary cache, and `palaestra harness install` going on past a failure."""

from __future__ import annotations

import argparse
import os

import pytest

from palaestra.environments.harness import configure
from palaestra.environments.harness import install as inst


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PALAESTRA_HARNESS_CACHE", str(tmp_path))
    return tmp_path


def test_the_registry_maps_each_name_to_its_harness():
    assert {"claude-code", "codex", "opencode", "mini-swe-agent"} <= set(inst.HARNESSES)
    assert all(name == h.name for name, h in inst.HARNESSES.items())
    assert {h.registry for h in inst.HARNESSES.values()} == {"npm", "pypi", "palaestra"}
    assert set(configure.HARNESS_NAMES) == set(inst.HARNESSES)  # each has its headless command


def test_only_opencode_gets_an_address_space_beyond_its_sandboxs_memory():
    """OpenCode's JavaScriptCore crashes at a 4,096 MiB RLIMIT_AS (Harness.address_space_mb): its
    sandbox allows 64 GiB, or the memory when that is more; the others keep the memory limit."""
    opencode = inst.HARNESSES["opencode"]
    assert opencode.address_space(4096) == 64 << 10 and opencode.address_space(100_000) == 100_000
    others = [h for name, h in inst.HARNESSES.items() if name != "opencode"]
    assert all(h.address_space(4096) is None for h in others)


def test_a_pypi_harness_is_found_in_its_venv_and_mounted_whole(cache):
    h = inst.HARNESSES["mini-swe-agent"]
    assert inst.binary("mini-swe-agent") is None and inst.install_root("mini-swe-agent") is None
    root = cache / f"mini-swe-agent@{h.version}"
    (root / "venv/bin").mkdir(parents=True)
    (root / "venv/bin/mini").write_text("#!/x/python\n")
    (root / "venv/bin/python").write_text("")
    assert inst.binary("mini-swe-agent") == root / "venv/bin/mini"
    assert inst.native(root, "mini-swe-agent") == (root / "venv", "bin/python")


def test_an_npm_harness_without_its_platform_binary_is_refused_naming_the_command(cache):
    h = inst.HARNESSES["opencode"]
    root = cache / f"opencode@{h.version}"
    (root / "node_modules/.bin").mkdir(parents=True)
    (root / "node_modules/.bin/opencode").write_text("")
    assert inst.install_root("opencode") == root
    with pytest.raises(RuntimeError, match=f"palaestra harness install opencode@{h.version}"):
        inst.native(root, "opencode")


def test_our_harness_is_its_package_folder_at_its_one_version(cache, tmp_path, monkeypatch):
    """terminus needs no install: its folder in the package is mounted, or (where the sandbox's
    user cannot enter it) a copy named by its content, so an edited agent is never a stale copy."""
    h = inst.HARNESSES["terminus"]
    root = inst.install_root("terminus")
    assert root == inst.OURS / "terminus" and inst.binary(f"terminus@{h.version}") == root / "agent.py"
    assert inst.install("terminus") == root / "agent.py"  # nothing downloaded
    assert inst.native(root, "terminus") == (root, "agent.py")
    with pytest.raises(
        ValueError, match=f"terminus is part of palaestra: its one version is {h.version}, not 9"
    ):
        inst.binary("terminus@9")
    source = tmp_path / "ours" / "terminus"
    source.mkdir(parents=True)
    (source / "agent.py").write_text("print(1)\n")
    monkeypatch.setattr(inst, "OURS", source.parent)
    monkeypatch.setattr(inst, "_open_to_all", lambda path: False)
    monkeypatch.setattr(inst.tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    first = inst.shared_root("terminus")
    assert (
        first.name.startswith(f"terminus@{h.version}-") and (first / "agent.py").read_text() == "print(1)\n"
    )
    (source / "agent.py").unlink()
    (source / "agent.py").write_text("print(2)\n")  # edited (a new file, as editors save)
    second = inst.shared_root("terminus")
    assert second != first and (second / "agent.py").read_text() == "print(2)\n"


def test_a_shared_copy_of_a_python_harness_carries_its_bytecode(monkeypatch, tmp_path):
    """The shared copy is mounted read-only in the sandbox, where Python cannot write bytecode: it
    carries the install's own (hard-linked, so still valid), whether the copy is made now or was
    made before without it. An install tree made here (a test double of `make install`'s) whose
    module was compiled as pip compiles; then Python, not allowed to write bytecode, loads the
    module from the copy's."""
    import compileall
    import subprocess
    import sys

    h = inst.HARNESSES["mini-swe-agent"]
    cache = tmp_path / "cache"
    site = cache / f"mini-swe-agent@{h.version}" / "venv" / "lib" / "pkg"
    site.mkdir(parents=True)
    (site / "mod.py").write_text("VALUE = 41 + 1\n")
    assert compileall.compile_dir(site, quiet=1)
    launcher = cache / f"mini-swe-agent@{h.version}" / h.launcher
    launcher.parent.mkdir(parents=True)
    launcher.write_text("#!/bin/sh\n")
    monkeypatch.setenv("PALAESTRA_HARNESS_CACHE", str(cache))
    monkeypatch.setattr(inst, "_open_to_all", lambda path: False)
    monkeypatch.setattr(inst.tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    pyc = next((site / "__pycache__").iterdir())

    copy = inst.shared_root("mini-swe-agent")
    copied = copy / "venv" / "lib" / "pkg" / "__pycache__" / pyc.name
    assert copied.stat().st_ino == pyc.stat().st_ino and (copy / inst.BYTECODE_MARK).exists()

    # a copy made before (without bytecode) gets it on its next use
    import shutil

    shutil.rmtree(copied.parent)
    (copy / inst.BYTECODE_MARK).unlink()
    assert inst.shared_root("mini-swe-agent") == copy and copied.stat().st_ino == pyc.stat().st_ino

    # Python that cannot write bytecode (as in the read-only mount) loads the module from it
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    out = subprocess.run(
        [sys.executable, "-v", "-c", "import mod; print(mod.VALUE)"],
        cwd=copied.parent.parent,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() == "42" and f"code object from '{copied}'" in out.stderr, out.stderr[-2000:]


def test_install_goes_on_past_a_harness_that_fails(monkeypatch, capsys):
    done = []

    def fake(spec, quiet=False):
        if spec == "codex":
            raise RuntimeError("npm is not on PATH")
        done.append(spec)
        return f"/bin/{spec}"

    monkeypatch.setattr(inst, "install", fake)
    assert inst._install(argparse.Namespace(harness=["codex", "opencode"])) == 2
    assert done == ["opencode"] and "error: codex: npm is not on PATH" in capsys.readouterr().err
