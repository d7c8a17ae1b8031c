"""Grading a patch against an instance, and validating an instance.

Grading (`grade`): the base snapshot, the agent's patch applied (in Python, `snapshot.apply_patch`),
every file the ``test_patch`` touches reset to the base and the ``test_patch`` applied — so no edit
of the agent's reaches the tests that grade — unpacked in a fresh sandbox, FAIL_TO_PASS and
PASS_TO_PASS run. Reward 1 only if both sets pass; a patch that does not apply scores 0.

Both run the tests in the instance's environment when it needs one (`repo_env.py`: its requirements
in a virtualenv mounted at ``/venv``).

Validation (`validate`), run on every instance generated or loaded:
1. the reference ``patch`` makes FAIL_TO_PASS and PASS_TO_PASS pass;
2. the empty patch fails every FAIL_TO_PASS test (and PASS_TO_PASS still passes);
3. the tests that grade are hidden: no FAIL_TO_PASS test is defined in the agent's copy;
4. the agent's copy has no history that holds the fix: one commit, and no git object in it has the
   content of a file as the reference fix leaves it.
"""

from __future__ import annotations

import asyncio
import io
import re
import subprocess
import tarfile
import tempfile
from dataclasses import dataclass, field

from palaestra.environments.swe_agent.instance import SweInstance
from palaestra.environments.swe_agent.repo_env import EnvOptions, RepoEnvError, instance_env
from palaestra.environments.swe_agent.snapshot import (
    PatchError,
    Snapshot,
    agent_copy_tar,
    apply_patch,
    patch_paths,
)
from palaestra.environments.swe_agent.testrun import TestOutcome, run_tests
from palaestra.sandbox.base import Backend, Limits

GRADE_LIMITS = Limits(timeout_s=120.0, cpu_s=120, memory_mb=1024, pids=128)


@dataclass
class Grade:
    reward: float
    reason: str
    """resolved, unresolved, patch_does_not_apply, tests_did_not_finish, or test_command_failed (the
    test command exited reporting no test: it could not start; its exit status and last line)."""
    fail_to_pass: dict[str, TestOutcome] = field(default_factory=dict)
    pass_to_pass: dict[str, TestOutcome] = field(default_factory=dict)

    @property
    def f2p_passed(self) -> int:
        return sum(o.passed for o in self.fail_to_pass.values())

    @property
    def p2p_passed(self) -> int:
        return sum(o.passed for o in self.pass_to_pass.values())


def grading_tree(instance: SweInstance, base: Snapshot, model_patch: str) -> Snapshot:
    """Base + the agent's patch + the tests that grade (see the module docstring)."""
    tree = apply_patch(base, model_patch)
    for path in patch_paths(instance.test_patch):
        if path in base:
            tree[path] = base[path]
        else:
            tree.pop(path, None)
    return apply_patch(tree, instance.test_patch)


async def grade(
    instance: SweInstance,
    model_patch: str,
    backend: Backend,
    base: Snapshot | None = None,
    limits: Limits = GRADE_LIMITS,
    *,
    env_options: EnvOptions | None = None,
) -> Grade:
    """Raises `RepoEnvError` when the instance's environment (`repo_env.py`) cannot be built."""
    base = instance.base() if base is None else base
    try:
        tree = grading_tree(instance, base, model_patch)
    except PatchError as exc:
        return Grade(0.0, f"patch_does_not_apply: {exc}")
    venv = await instance_env(instance, base, env_options)
    ids = [*instance.FAIL_TO_PASS, *instance.PASS_TO_PASS]
    run = await run_tests(
        backend, tree, ids, instance.test_cmd, limits=limits, timeout_s=limits.timeout_s, venv=venv
    )
    f2p = {i: run.outcomes[i] for i in instance.FAIL_TO_PASS}
    p2p = {i: run.outcomes[i] for i in instance.PASS_TO_PASS}
    resolved = all(o.passed for o in f2p.values()) and all(o.passed for o in p2p.values())
    if resolved:
        reason = "resolved"
    elif run.command_failed:
        reason = f"test_command_failed: {run.command_failed}"
    elif run.exec.status != "ok" and any(o.outcome == "missing" for o in run.outcomes.values()):
        reason = f"tests_did_not_finish: {run.exec.status}"
    else:
        reason = "unresolved"
    return Grade(1.0 if resolved else 0.0, reason, f2p, p2p)


@dataclass(frozen=True)
class Validation:
    instance_id: str
    valid: bool
    reason: str = ""

    def to_json(self) -> dict[str, object]:
        row: dict[str, object] = {"instance_id": self.instance_id, "valid": self.valid}
        if not self.valid:
            row["reason"] = self.reason
        return row


def _test_name(test_id: str) -> str:
    return re.split(r"[.:]", test_id)[-1].split("[")[0]


def hidden_problems(instance: SweInstance, base: Snapshot) -> list[str]:
    """FAIL_TO_PASS tests that the agent's copy defines (it must define none)."""
    problems = []
    for test_id in instance.FAIL_TO_PASS:
        pattern = re.compile(rf"^\s*(async\s+)?def\s+{re.escape(_test_name(test_id))}\s*\(", re.MULTILINE)
        for path, data in base.items():
            if path.endswith(".py") and pattern.search(data.decode(errors="replace")):
                problems.append(f"{test_id} is defined in the agent's copy ({path})")
                break
    return problems


def history_problems(instance: SweInstance, base: Snapshot) -> list[str]:
    """What in the agent's copy's git history could reveal the fix."""
    fixed = apply_patch(base, instance.patch)
    changed = {p: fixed[p] for p in patch_paths(instance.patch) if p in fixed}
    with tempfile.TemporaryDirectory(prefix="palaestra-swe-check-") as tmp:
        with tarfile.open(fileobj=io.BytesIO(agent_copy_tar(base))) as tar:
            tar.extractall(tmp, filter="data")

        def git(*args: str, stdin: bytes | None = None) -> str:
            return subprocess.run(
                ["git", *args], cwd=tmp, input=stdin, capture_output=True, check=True
            ).stdout.decode()

        problems = []
        commits = int(git("rev-list", "--all", "--count").strip() or 0)
        head = git("rev-parse", "HEAD").strip()
        logged = set(git("log", "-g", "--all", "--format=%H").split())
        if commits != 1:
            problems.append(f"the agent's copy has {commits} commits (must have exactly 1)")
        if logged - {head} or git("stash", "list").strip():
            problems.append("the agent's copy has reflog or stash entries of other commits")
        objects = set(git("cat-file", "--batch-all-objects", "--batch-check=%(objectname)").split())
        for path, data in changed.items():
            blob = git("hash-object", "--stdin", stdin=data).strip()
            if blob in objects:
                problems.append(f"the agent's copy's git objects hold the fixed {path}")
    return problems


async def validate(
    instance: SweInstance,
    backend: Backend,
    limits: Limits = GRADE_LIMITS,
    *,
    env_options: EnvOptions | None = None,
) -> Validation:
    """Checks 1-4 of the module docstring, in the instance's environment (`repo_env.py`, built
    first: a requirement that cannot be installed makes the instance invalid, naming it); never
    raises for a bad instance."""
    fail = lambda reason: Validation(instance.instance_id, False, reason)  # noqa: E731
    try:
        base = instance.base()
        for label, patch in (("patch", instance.patch), ("test_patch", instance.test_patch)):
            try:
                apply_patch(base, patch)
            except PatchError as exc:
                return fail(f"'{label}' does not apply to the base: {exc}")
        problems = hidden_problems(instance, base) + history_problems(instance, base)
        if problems:
            return fail("; ".join(problems))
        await instance_env(instance, base, env_options)  # built once, before both runs use it
        fixed, empty = await asyncio.gather(
            grade(instance, instance.patch, backend, base, limits, env_options=env_options),
            grade(instance, "", backend, base, limits, env_options=env_options),
        )
    except RepoEnvError as exc:
        return fail(str(exc))
    except Exception as exc:  # a repo that is missing, a git error: the instance is unusable
        return fail(f"{type(exc).__name__}: {exc}")
    if fixed.reason.startswith("test_command_failed"):
        return fail(
            f"the test command {instance.test_cmd!r} could not run the tests in the sandbox "
            f"({fixed.reason.partition(': ')[2]}): the sandbox's Python, with the instance's environment "
            "when it has one (requirements, pyproject.toml; docs/environments.md), must have what it runs"
        )
    if fixed.reward != 1.0:
        bad = [o for o in [*fixed.fail_to_pass.values(), *fixed.pass_to_pass.values()] if not o.passed]
        detail = ", ".join(f"{o.id} {o.outcome}" for o in bad[:3])
        return fail(f"the reference patch does not resolve it ({fixed.reason}: {detail})")
    still_passing = [o.id for o in empty.fail_to_pass.values() if o.passed]
    if still_passing:
        return fail(f"FAIL_TO_PASS tests pass without any fix: {', '.join(still_passing[:3])}")
    broken = [o.id for o in empty.pass_to_pass.values() if not o.passed]
    if broken:
        return fail(f"PASS_TO_PASS tests fail on the base: {', '.join(broken[:3])}")
    return Validation(instance.instance_id, True)
