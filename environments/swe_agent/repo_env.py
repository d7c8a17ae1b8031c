"""Per-repository Python environments: what an instance's tests need, in a virtualenv for the
sandbox's Python, built on the host with pip, cached by content hash, and mounted read-only into
every sandbox that runs the instance (at ``/venv``, first on ``PATH``).

    spec = env_spec(instance, base)                   # None: the sandbox's own Python is enough
    venv = await ensure_env(spec, EnvOptions())        # built once per content hash
    box = await backend.create("python", limits, mounts=(venv_mount(venv),))

What goes in (`requirements_of`, `env_spec`): the instance's own ``requirements`` (a list of pip
requirement strings; SWE-bench instances have none, their harness keeps them per repository), the
repository's declared ones (``requirements*.txt``, ``requirements/test*.txt``, pyproject.toml's
``[project] dependencies`` and its ``test``/``tests``/``testing`` extras, setup.cfg's
``install_requires`` and those extras), read at ``environment_setup_commit`` when the instance
names one (SWE-bench's commit whose environment serves every instance of a ``version``), and pytest
when the test command runs it. The repository itself is not installed: tests run from its root.

How it is built (`ensure_env`): ``/usr/bin/python3 -m venv --without-pip`` (the sandboxes run the
host's system Python), then this process's pip with ``--python`` installs the requirements from
the package index, or offline from ``EnvOptions.find_links`` with ``index=False`` (pip's own
``PIP_*`` settings apply as usual). Console scripts are rewritten to start ``/venv/bin/python``,
where the sandbox sees them. The directory is ``<cache_dir>/<sha256 of python version and
requirements>``, renamed into place complete (`palaestra.models.cache.build_once`), so a second
instance of the same repository and version, or a second process, reuses it. A requirement that
cannot be installed is a `RepoEnvError` naming it and pip's reason.
"""

from __future__ import annotations

import asyncio
import configparser
import functools
import hashlib
import json
import re
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

from palaestra.environments.swe_agent.instance import SweInstance
from palaestra.environments.swe_agent.snapshot import Snapshot, read_git
from palaestra.models.cache import build_once, cache_root, write_marker
from palaestra.sandbox.base import Mount
from palaestra.sandbox.bwrap import SANDBOX_PYTHON

__all__ = [
    "ACTIVATE",
    "SANDBOX_ENV",
    "EnvOptions",
    "EnvSpec",
    "RepoEnvError",
    "activate",
    "ensure_env",
    "env_spec",
    "files_spec",
    "instance_env",
    "packages_dir",
    "venv_mount",
]

SANDBOX_ENV = "/venv"
"""Where a sandbox sees the instance's environment."""
ACTIVATE = (
    f'if [ -d {SANDBOX_ENV}/bin ]; then export PATH="{SANDBOX_ENV}/bin:$PATH" VIRTUAL_ENV={SANDBOX_ENV}; fi; '
)
"""Shell prefix of every command run for an instance: its environment, when mounted, comes first."""


def activate(env: dict[str, str]) -> dict[str, str]:
    """A sandbox process's environment variables with the instance's environment first on
    ``PATH`` (what `ACTIVATE` does in a shell, for a process started without one)."""
    return {**env, "PATH": f"{SANDBOX_ENV}/bin:{env.get('PATH', '')}", "VIRTUAL_ENV": SANDBOX_ENV}


RECIPE_VERSION = 1
"""Bumped when the way an environment is built changes, so older builds are not reused."""
TEST_EXTRAS = ("test", "tests", "testing")
REQUIREMENT_FILES = re.compile(
    r"^(requirements[^/]*\.txt|(test|dev)-requirements\.txt|requirements/(test|tests|testing)[^/]*\.txt)$"
)


def packages_dir() -> Path:
    """Where `palaestra swe fetch` puts what offline builds and the generator need: pytest's wheels
    and real packages' source distributions (``~/.cache/palaestra/swe/packages``)."""
    return cache_root() / "swe" / "packages"


class RepoEnvError(RuntimeError):
    """An instance's environment could not be built; the message names the requirement and why."""


@functools.cache
def python_version(python: str) -> str:
    """`sys.version` of the interpreter `python`, asked once per process: every instance's key needs
    it, and an interpreter started per key made building a task list of thousands slow (issue 37)."""
    return subprocess.run(
        [python, "-c", "import sys; print(sys.version)"], capture_output=True, text=True
    ).stdout.strip()


@dataclass(frozen=True)
class EnvSpec:
    """What an environment holds: it is identified by its `key`, a hash of these fields."""

    requirements: tuple[str, ...]
    """pip requirement strings, sorted and without duplicates."""
    label: str = ""
    """For messages: the repository and version it serves."""
    python: str = SANDBOX_PYTHON

    def key(self) -> str:
        data = {
            "recipe": RECIPE_VERSION,
            "python": python_version(self.python),
            "requirements": list(self.requirements),
        }
        return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:24]


@dataclass(frozen=True)
class EnvOptions:
    """How environments are built and where they are kept."""

    cache_dir: str | None = None
    """Where the environments live (default: ``~/.cache/palaestra/swe/envs``)."""
    find_links: tuple[str, ...] = ()
    """Directories of wheels and sdists pip may install from (pip's ``--find-links``)."""
    index: bool = True
    """Whether pip may ask the package index; False: only ``find_links`` (offline)."""
    timeout_s: float = 900.0
    """Longest a build may take."""
    extra_pip_args: tuple[str, ...] = ()
    """Passed through to ``pip install`` as they are."""

    def root(self) -> Path:
        return (
            Path(self.cache_dir).expanduser().absolute() if self.cache_dir else cache_root() / "swe" / "envs"
        )


def _requirement_lines(text: str) -> list[str]:
    """A requirements file's requirement lines (options, includes and editable installs dropped)."""
    lines = []
    for line in text.splitlines():
        line = line.split(" #", 1)[0].strip()
        if line and not line.startswith(("#", "-", ".", "/")):
            lines.append(line)
    return lines


def requirements_of(files: Snapshot) -> list[str]:
    """What the repository declares it needs to run and test (see the module docstring)."""
    found: list[str] = []
    for path in sorted(files):
        if REQUIREMENT_FILES.match(path):
            found += _requirement_lines(files[path].decode(errors="replace"))
    if "pyproject.toml" in files:
        try:
            project = tomllib.loads(files["pyproject.toml"].decode()).get("project", {})
        except (tomllib.TOMLDecodeError, UnicodeDecodeError):
            project = {}
        found += list(project.get("dependencies") or [])
        extras = project.get("optional-dependencies") or {}
        for extra in TEST_EXTRAS:
            found += list(extras.get(extra) or [])
    if "setup.cfg" in files:
        config = configparser.ConfigParser(interpolation=None)
        try:
            config.read_string(files["setup.cfg"].decode(errors="replace"))
        except configparser.Error:
            config = configparser.ConfigParser()
        if config.has_option("options", "install_requires"):
            found += _requirement_lines(config.get("options", "install_requires"))
        for extra in TEST_EXTRAS:
            if config.has_option("options.extras_require", extra):
                found += _requirement_lines(config.get("options.extras_require", extra))
    return found


def _name(requirement: str) -> str:
    return re.split(r"[\s<>=!~;\[(@]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def env_spec(instance: SweInstance, base: Snapshot) -> EnvSpec | None:
    """The environment ``instance`` needs, or None when it needs none beyond the sandbox's Python
    (no requirement declared anywhere and a test command that is not pytest)."""
    declared = instance.extra.get("requirements", [])
    if isinstance(declared, str):
        declared = _requirement_lines(declared)
    setup_commit = instance.extra.get("environment_setup_commit")
    files = read_git(Path(instance.repo), setup_commit) if setup_commit and instance.base_commit else base
    label = Path(instance.repo).name
    if instance.extra.get("version"):
        label += f"@{instance.extra['version']}"
    return files_spec(files, instance.test_cmd, label, list(declared))


def files_spec(
    files: Snapshot, test_cmd: str, label: str = "", declared: list[str] | None = None
) -> EnvSpec | None:
    """`env_spec` of a repository's files (the generator's, before there is an instance)."""
    requirements = [*(declared or []), *requirements_of(files)]
    if "pytest" in test_cmd and "pytest" not in {_name(r) for r in requirements}:
        requirements.append("pytest")
    if not requirements:
        return None
    return EnvSpec(tuple(sorted(set(requirements))), label)


def venv_mount(venv: Path) -> Mount:
    return Mount(str(venv), SANDBOX_ENV)


PIP_FAILURE = re.compile(
    r"(No matching distribution found for (?P<a>\S+)"
    r"|Could not find a version that satisfies the requirement (?P<b>\S+)"
    r"|Invalid requirement: '?(?P<c>[^'\n]+)'?"
    r"|Failed to build (?P<d>\S+))"
)


def _pip_failure(spec: EnvSpec, output: str) -> RepoEnvError:
    match = PIP_FAILURE.search(output)
    errors = [line.strip() for line in output.splitlines() if line.strip().startswith("ERROR")]
    why = errors[-1] if errors else (output.strip().splitlines() or ["pip failed"])[-1]
    which = next((g for g in (match.groupdict().values() if match else ()) if g), None)
    what = f"requirement {which!r} failed" if which else "pip failed"
    return RepoEnvError(
        f"the environment of {spec.label or 'the instance'} could not be built: {what}: {why}"
    )


def _build(spec: EnvSpec, options: EnvOptions, out: Path) -> None:
    made = subprocess.run(
        [spec.python, "-m", "venv", "--without-pip", str(out)], capture_output=True, text=True
    )
    if made.returncode != 0:
        raise RepoEnvError(f"{spec.python} -m venv failed: {made.stderr.strip()[-500:]}")
    (out / "requirements.txt").write_text("\n".join(spec.requirements) + "\n")
    pip = [sys.executable, "-m", "pip", "--python", str(out / "bin" / "python"), "install"]
    pip += ["--no-input", "--disable-pip-version-check", "--no-warn-script-location"]
    for link in options.find_links:
        pip += ["--find-links", link]
    if not options.index:
        pip.append("--no-index")
    pip += [*options.extra_pip_args, "-r", str(out / "requirements.txt")]
    try:
        done = subprocess.run(pip, capture_output=True, text=True, timeout=options.timeout_s)
    except subprocess.TimeoutExpired:
        raise RepoEnvError(
            f"the environment of {spec.label or 'the instance'} took longer than {options.timeout_s} s to build"
        ) from None
    if done.returncode != 0:
        raise _pip_failure(spec, done.stdout + "\n" + done.stderr)
    for script in (out / "bin").iterdir():  # shebangs name the build directory: point them at /venv
        if script.is_file() and not script.is_symlink():
            data = script.read_bytes()
            if data.startswith(b"#!") and str(out).encode() in data.split(b"\n", 1)[0]:
                script.write_bytes(data.replace(str(out).encode(), SANDBOX_ENV.encode(), 1))
    frozen = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(out / "bin" / "python"), "freeze"],
        capture_output=True,
        text=True,
    ).stdout.split()
    for path in [out, *out.rglob("*")]:  # the sandboxes' user reads it
        if not path.is_symlink():
            path.chmod(path.stat().st_mode | (0o555 if path.is_dir() else 0o444))
    write_marker(
        out,
        "swe-env",
        RECIPE_VERSION,
        label=spec.label,
        requirements=list(spec.requirements),
        installed=frozen,
    )


def build_env(spec: EnvSpec, options: EnvOptions) -> Path:
    """The environment's directory, built now unless the cache holds it (blocking: run it in a
    thread from async code, as `ensure_env` does)."""
    return build_once(options.root() / spec.key(), lambda out: _build(spec, options, out))


async def ensure_env(spec: EnvSpec, options: EnvOptions) -> Path:
    return await asyncio.to_thread(build_env, spec, options)


async def instance_env(
    instance: SweInstance, base: Snapshot, options: EnvOptions | None = None
) -> Path | None:
    """The built environment ``instance`` needs (None: none needed); raises `RepoEnvError`."""
    spec = await asyncio.to_thread(env_spec, instance, base)
    return None if spec is None else await ensure_env(spec, options or EnvOptions())
