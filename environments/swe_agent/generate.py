"""Generating SWE instances by planting bugs in repositories: the ones bundled under ``repos/``
(unittest suites, the standard library only) or real packages' source distributions, which ship
their own test suites (pytest, run in the package's environment: `repo_env.py`).

    instances = await generate(Path("swe.jsonl"), backend, seed=0, per_kind=3)
    instances = await generate(Path("one.jsonl"), backend, per_kind=1, kinds=["off_by_one"])  # one kind
    instances = await generate(Path("real.jsonl"), backend, sources=[sdist_source(Path("toolz-1.2.0.tar.gz"))])

For each repository: every mutation `mutate.py` admits in its source (not its tests) is listed per
bug kind and shuffled (seeded); a mutant is tried by running the tests that pass on the original in
a sandbox. It becomes an instance when 1 to ``max_failing`` of them fail: those are FAIL_TO_PASS,
the rest PASS_TO_PASS.
The test modules that hold FAIL_TO_PASS tests are removed from the base and come back in
``test_patch``; ``patch`` is the diff from the mutant back to the original source. Each instance's
base is a commit of a git repository written next to the JSONL (``<stem>.repos/<repo>``, one
branch per instance), so the JSONL has exactly the loader's format. An instance is kept only if
`grading.validate` passes.

The problem statement is written from the failing behaviour: the failing call from the test, what
it raised, and the test's name.
"""

from __future__ import annotations

import ast
import asyncio
import os
import random
import re
import shutil
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from palaestra.environments.swe_agent.grading import GRADE_LIMITS, validate
from palaestra.environments.swe_agent.instance import UNITTEST, SweInstance, write_jsonl
from palaestra.environments.swe_agent.mutate import KINDS, Mutation, mutations
from palaestra.environments.swe_agent.repo_env import EnvOptions, ensure_env, files_spec, venv_mount
from palaestra.environments.swe_agent.snapshot import (
    Snapshot,
    diff_snapshots,
    read_directory,
    unpack_tar,
    write_directory,
)
from palaestra.environments.swe_agent.testrun import TestOutcome, collect_pytest_ids, run_tests, upload_tree
from palaestra.sandbox.base import Backend, Limits

REPOS_DIR = Path(__file__).with_name("repos")
PYTEST = "python -m pytest -rA -p no:cacheprovider"
"""The test command of instances generated from real packages (their environment has pytest)."""
REAL_PACKAGES = ("inflection==0.5.1", "toolz==1.2.0")
"""Pure-Python packages whose sdists ship their test suites, fast ones (~1 s): `palaestra swe
fetch` downloads them, `palaestra swe generate --real` plants bugs in them."""
MUTANT_LIMITS = Limits(timeout_s=60.0, cpu_s=20, memory_mb=1024, pids=128)
"""A mutant's test run: a mutant that loops is given up on after 20 s of CPU (the suites here take ~1 s)."""
NOT_SOURCE = ("docs/", "doc/", "examples/", "benchmarks/", "bench/", "scripts/")


def bundled_repos() -> list[str]:
    return sorted(p.name for p in REPOS_DIR.iterdir() if (p / "tests").is_dir())


def is_test_file(path: str) -> bool:
    parts = path.split("/")
    name = parts[-1]
    return path.endswith(".py") and (
        name.startswith("test_")
        or name.endswith("_test.py")
        or name == "conftest.py"
        or "tests" in parts[:-1]
    )


@dataclass(frozen=True)
class RepoSource:
    """A repository to plant bugs in: its files and how its tests run."""

    name: str
    files: Snapshot
    test_cmd: str = UNITTEST
    """`UNITTEST` (ids from `discover_tests`) or a pytest command (ids collected in a sandbox)."""

    def source_files(self) -> list[str]:
        """Where bugs are planted: its Python modules, not its tests, setup or docs."""
        return [
            p
            for p in sorted(self.files)
            if p.endswith(".py") and not is_test_file(p) and p != "setup.py" and not p.startswith(NOT_SOURCE)
        ]

    def test_file(self, test_id: str) -> str:
        if self.test_cmd == UNITTEST:
            return "/".join(test_id.split(".")[:-2]) + ".py"
        return test_id.split("::")[0]


def bundled_source(name: str) -> RepoSource:
    return RepoSource(name, read_directory(REPOS_DIR / name))


def sdist_source(path: Path) -> RepoSource:
    """A source distribution (``name-version.tar.gz``) as it ships: its top directory stripped,
    its ``*.egg-info`` left out; tested with `PYTEST`."""
    files: Snapshot = {}
    for member, data in unpack_tar(Path(path).read_bytes()).items():
        inner = member.partition("/")[2]
        if inner and ".egg-info/" not in inner:
            files[inner] = data
    name = re.split(r"-\d", Path(path).name, maxsplit=1)[0].lower().replace("_", "-")
    if not any(is_test_file(p) for p in files):
        raise ValueError(f"{Path(path).name} ships no tests (no test_*.py, *_test.py or tests/)")
    return RepoSource(name, files, PYTEST)


def discover_tests(files: Snapshot) -> list[str]:
    """unittest ids (``tests.test_x.TestY.test_z``) of the test methods in ``tests/test_*.py``."""
    ids = []
    for path in sorted(files):
        if not (path.startswith("tests/") and Path(path).name.startswith("test") and path.endswith(".py")):
            continue
        module = path[:-3].replace("/", ".")
        for node in ast.parse(files[path]).body:
            if isinstance(node, ast.ClassDef):
                ids += [
                    f"{module}.{node.name}.{item.name}"
                    for item in node.body
                    if isinstance(item, ast.FunctionDef) and item.name.startswith("test")
                ]
    return ids


def problem_statement(repo: str, mutation: Mutation, failing: list[TestOutcome]) -> str:
    """An issue as a user would file it: what they ran, what happened. Names no fix."""
    parts = [f"{repo}: wrong behaviour\n"]
    for outcome in failing[:2]:
        at = outcome.at or {}
        call = (at.get("code") or "").strip()
        what = re.split(r"[.:]", outcome.id)[-1].removeprefix("test_").replace("_", " ")
        if call:
            parts.append(f"Expected behaviour ({what}) does not hold. Running\n\n    {call}\n\nfails with:\n")
        else:  # pytest's summary names the failure, not the line
            parts.append(f"Expected behaviour ({what}) does not hold; it fails with:\n")
        parts.append(f"    {outcome.message or outcome.outcome}\n")
    parts.append(
        "Please fix the library so that it behaves as documented; the existing behaviour that works "
        "must keep working."
    )
    return "\n".join(parts)


def _git(*args: str, cwd: Path, env: dict | None = None) -> str:
    base_env = {
        **os.environ,
        "GIT_AUTHOR_NAME": "palaestra",
        "GIT_AUTHOR_EMAIL": "palaestra@localhost",
        "GIT_COMMITTER_NAME": "palaestra",
        "GIT_COMMITTER_EMAIL": "palaestra@localhost",
        "GIT_AUTHOR_DATE": "2000-01-01T00:00:00Z",
        "GIT_COMMITTER_DATE": "2000-01-01T00:00:00Z",
    }
    done = subprocess.run(
        ["git", *args], cwd=cwd, capture_output=True, text=True, env={**base_env, **(env or {})}
    )
    if done.returncode != 0:
        raise RuntimeError(f"git {' '.join(args)}: {done.stderr.strip()}")
    return done.stdout.strip()


def _commit_tree(git_dir: Path, files: Snapshot, message: str, parent: str | None, branch: str) -> str:
    """Commits ``files`` as a tree of ``git_dir`` on ``branch``, without touching its work tree."""
    work = git_dir.parent / f".work-{branch.replace('/', '-')}"
    shutil.rmtree(work, ignore_errors=True)
    write_directory(files, work)
    env = {
        "GIT_INDEX_FILE": str(work / ".index"),
        "GIT_WORK_TREE": str(work),
        "GIT_DIR": str(git_dir / ".git"),
    }
    try:
        _git("add", "-A", ".", cwd=work, env=env)
        tree = _git("write-tree", cwd=work, env=env)
        commit = _git(
            "commit-tree", tree, *(["-p", parent] if parent else []), "-m", message, cwd=work, env=env
        )
        _git("update-ref", f"refs/heads/{branch}", commit, cwd=work, env=env)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return commit


async def generate(
    out: Path,
    backend: Backend,
    *,
    seed: int = 0,
    per_kind: int = 3,
    repos: list[str] | None = None,
    sources: list[RepoSource] | None = None,
    max_failing: int = 4,
    tries_per_kind: int = 12,
    concurrency: int = 4,
    env_options: EnvOptions | None = None,
    progress: Callable[[str], None] | None = None,
    kinds: Sequence[str] = KINDS,
) -> list[SweInstance]:
    """Writes ``out`` (JSONL) and ``<out stem>.repos/``; returns the validated instances. The
    repositories are ``sources``, else the bundled ``repos`` (default: all of them); the bug kinds
    tried are ``kinds`` (default: every kind of `mutate.KINDS`, in that order)."""
    unknown = [k for k in kinds if k not in KINDS]
    if unknown or not kinds:
        raise ValueError(f"kinds {list(kinds)}: give one or more of {', '.join(KINDS)}")
    out = Path(out)
    repo_root = out.parent / f"{out.stem}.repos"
    if sources is None:
        sources = [bundled_source(name) for name in repos or bundled_repos()]
    kept: list[SweInstance] = []
    for source in sources:
        kept += await _generate_repo(
            source,
            repo_root / source.name,
            backend,
            seed,
            per_kind,
            max_failing,
            tries_per_kind,
            concurrency,
            env_options or EnvOptions(),
            progress,
            kinds,
        )
    write_jsonl(kept, out, relative_to=out.parent)
    return kept


async def _suite(source: RepoSource, backend: Backend, venv: Path | None) -> list[str]:
    """The ids of the tests that pass on the original (those a mutant is judged by)."""
    if source.test_cmd == UNITTEST:
        ids = discover_tests(source.files)
    else:
        box = await backend.create("python", GRADE_LIMITS, mounts=(venv_mount(venv),) if venv else ())
        try:
            unpacked = await upload_tree(box, source.files)
            if not unpacked.ok:
                raise RuntimeError(f"could not unpack {source.name}: {unpacked.stderr[-300:]}")
            targets = sorted(
                {p.rsplit("/", 1)[0] if "/" in p else p for p in source.files if is_test_file(p)}
            )
            ids = await collect_pytest_ids(
                box, source.test_cmd, [t for t in targets if not t.endswith("conftest.py")]
            )
        finally:
            await box.close()
    run = await run_tests(
        backend, source.files, ids, source.test_cmd, limits=GRADE_LIMITS, timeout_s=120, venv=venv
    )
    passing = [i for i in ids if run.outcomes[i].passed]
    if not passing:
        raise RuntimeError(
            f"{source.name}: no test passes on the original ({run.command_failed or run.exec.status})"
        )
    return passing


async def _generate_repo(
    source: RepoSource,
    git_dir: Path,
    backend: Backend,
    seed: int,
    per_kind: int,
    max_failing: int,
    tries_per_kind: int,
    concurrency: int,
    env_options: EnvOptions,
    progress: Callable[[str], None] | None,
    kinds: Sequence[str],
) -> list[SweInstance]:
    sem = asyncio.Semaphore(concurrency)
    kept: list[SweInstance] = []
    name, pristine = source.name, source.files
    spec = files_spec(pristine, source.test_cmd, name)
    venv = await ensure_env(spec, env_options) if spec else None
    all_tests = await _suite(source, backend, venv)
    shutil.rmtree(git_dir, ignore_errors=True)
    git_dir.mkdir(parents=True)
    _git("init", "-q", "-b", "main", cwd=git_dir)
    root_commit = _commit_tree(git_dir, pristine, f"{name}: original", None, "main")
    by_kind: dict[str, list[Mutation]] = {kind: [] for kind in KINDS}
    for path in source.source_files():
        try:
            text = pristine[path].decode()
        except UnicodeDecodeError:
            continue
        for mutation in mutations(path, text):
            by_kind[mutation.kind].append(mutation)

    async def attempt(mutation: Mutation, index: int) -> SweInstance | None:
        mutant = {**pristine, mutation.path: mutation.source.encode()}
        async with sem:
            run = await run_tests(
                backend, mutant, all_tests, source.test_cmd, limits=MUTANT_LIMITS, timeout_s=60, venv=venv
            )
        failing = [run.outcomes[t] for t in all_tests if not run.outcomes[t].passed]
        if not 1 <= len(failing) <= max_failing or any(o.outcome == "missing" for o in failing):
            return None
        hidden = {source.test_file(o.id) for o in failing}
        base = {p: d for p, d in mutant.items() if p not in hidden}
        instance_id = f"{name}__{mutation.kind}__{index}"
        commit = _commit_tree(git_dir, base, f"{name}: snapshot", root_commit, f"instances/{instance_id}")
        f2p = [o.id for o in failing]
        instance = SweInstance(
            instance_id=instance_id,
            repo=str(git_dir),
            base_commit=commit,
            problem_statement=problem_statement(name, mutation, failing),
            patch=diff_snapshots(
                {mutation.path: base[mutation.path]}, {mutation.path: pristine[mutation.path]}
            ),
            test_patch=diff_snapshots({}, {p: mutant[p] for p in sorted(hidden)}),
            FAIL_TO_PASS=tuple(f2p),
            PASS_TO_PASS=tuple(t for t in all_tests if t not in f2p),
            test_cmd=source.test_cmd,
            bug_kind=mutation.kind,
            source="generated",
            extra={
                "description": f"{mutation.path}:{mutation.line} in {mutation.function}: {mutation.description}"
            },
        )
        async with sem:
            check = await validate(instance, backend, env_options=env_options)
        if progress:
            progress(f"{instance_id}: {'valid' if check.valid else 'invalid: ' + check.reason}")
        return instance if check.valid else None

    for kind in kinds:
        candidates = by_kind[kind]
        random.Random(f"swe/{seed}/{name}/{kind}").shuffle(candidates)
        found: list[SweInstance] = []
        index = 0
        for start in range(0, min(len(candidates), tries_per_kind), concurrency):
            batch = candidates[start : start + concurrency]
            results = await asyncio.gather(*[attempt(m, index + k) for k, m in enumerate(batch)])
            index += len(batch)
            found += [r for r in results if r is not None]
            if len(found) >= per_kind:
                break
        kept += found[:per_kind]
    return kept
