"""SWE instances: patches, bug planting, the JSONL format, and validation — generated instances
pass it, and instances that leak the tests or the fix, or whose patches do not decide, fail it.
Sandboxes: the labelled subprocess test double (fast); tests/environments/test_e2e.py runs the local one."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from palaestra.environments.swe_agent.generate import REPOS_DIR, bundled_repos, discover_tests, generate
from palaestra.environments.swe_agent.grading import grade, validate
from palaestra.environments.swe_agent.instance import InstanceError, load_jsonl, write_jsonl
from palaestra.environments.swe_agent.mutate import KINDS, mutations
from palaestra.environments.swe_agent.snapshot import (
    PatchError,
    apply_patch,
    diff_snapshots,
    patch_paths,
    read_directory,
    write_directory,
)
from tests.support.doubles import SubprocessBackendForTests

BACKEND = "tests.support.doubles:SubprocessBackendForTests"


def test_diff_round_trips_and_git_accepts_it(tmp_path):
    before = {"a.py": b"x = 1\ny = 2\nz = 3\n", "gone.txt": b"bye\n", "nonl": b"one\ntwo"}
    after = {"a.py": b"x = 1\ny = 20\nz = 3\nw = 4\n", "new/b.py": b"hi\n", "nonl": b"one\nTWO"}
    patch = diff_snapshots(before, after)
    assert apply_patch(before, patch) == after
    assert apply_patch(before, "") == before
    write_directory(before, tmp_path)
    (tmp_path / "p.diff").write_text(patch)
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    check = subprocess.run(
        ["git", "apply", "--check", "p.diff"], cwd=tmp_path, capture_output=True, text=True
    )
    assert check.returncode == 0, check.stderr
    with pytest.raises(PatchError, match="a.py: hunk 1 does not apply"):
        apply_patch({**before, "a.py": b"something else\n"}, patch)


def test_every_bug_kind_is_planted_in_the_bundled_repos():
    assert len(bundled_repos()) >= 3
    seen = set()
    for repo in bundled_repos():
        files = read_directory(REPOS_DIR / repo)
        assert len(discover_tests(files)) >= 15, repo
        for path, data in files.items():
            if path.endswith(".py") and not path.startswith("tests/"):
                for m in mutations(path, data.decode()):
                    compile(m.source, path, "exec")
                    assert m.source != data.decode()
                    seen.add(m.kind)
    assert seen == set(KINDS)


def test_mutation_edits_only_its_node():
    source = "def f(a, b=2):\n    # keep this comment\n    return a  +  b * 3\n"
    muts = list(mutations("m.py", source))
    operator = next(m for m in muts if m.description == "operator + became -")
    assert operator.source == "def f(a, b=2):\n    # keep this comment\n    return a - b * 3\n"
    default = next(m for m in muts if m.kind == "wrong_default")
    assert default.source.startswith("def f(a, b=4):")


@pytest.fixture(scope="module")
def generated(tmp_path_factory):
    out = tmp_path_factory.mktemp("swe") / "swe.jsonl"
    instances = asyncio.run(
        generate(out, SubprocessBackendForTests(), per_kind=1, repos=["ledger"], tries_per_kind=8)
    )
    return out, instances


@pytest.mark.parametrize("kinds", [["off_by_one", "no_such_kind"], [], "off_by_one"])
def test_generating_unknown_kinds_is_refused_before_any_work(tmp_path, kinds):
    with pytest.raises(ValueError, match="give one or more of off_by_one, wrong_operator"):
        asyncio.run(
            generate(tmp_path / "swe.jsonl", SubprocessBackendForTests(), repos=["ledger"], kinds=kinds)
        )
    assert not list(tmp_path.iterdir())


def test_generated_instances_are_valid_and_load_back(generated):
    out, instances = generated
    assert len(instances) >= 4 and len({i.bug_kind for i in instances}) >= 4
    loaded = load_jsonl(out)
    assert [i.instance_id for i in loaded] == [i.instance_id for i in instances]
    row = json.loads(out.read_text().splitlines()[0])
    assert {"instance_id", "repo", "base_commit", "problem_statement", "patch", "test_patch"} <= set(row)
    assert {"FAIL_TO_PASS", "PASS_TO_PASS", "test_cmd"} <= set(row)
    assert not Path(row["repo"]).is_absolute()  # relative to the JSONL: the pair can be moved together
    instance = loaded[0]
    assert instance.problem_statement and "fails with" in instance.problem_statement
    results = asyncio.run(_validate_all(loaded))
    assert all(r.valid for r in results), results


async def _validate_all(instances):
    backend = SubprocessBackendForTests()
    return [await validate(i, backend) for i in instances]


def test_grading_applies_the_agents_patch_and_restores_the_hidden_tests(generated):
    _, instances = generated
    instance = instances[0]
    backend = SubprocessBackendForTests()
    base = instance.base()
    assert asyncio.run(grade(instance, instance.patch, backend, base)).reward == 1.0
    assert asyncio.run(grade(instance, "", backend, base)).reward == 0.0
    # An agent that "fixes" the bug by writing its own version of the hidden test file gets it replaced.
    hidden = next(iter(p for p in instance.test_patch.split("+++ b/")[1:]))
    hidden_path = hidden.split("\n", 1)[0]
    cheat = diff_snapshots(base, {**base, hidden_path: b"import unittest\n"})
    assert asyncio.run(grade(instance, cheat, backend, base)).reward == 0.0
    broken = asyncio.run(
        grade(instance, "--- a/nope.py\n+++ b/nope.py\n@@ -1 +1 @@\n-x\n+y\n", backend, base)
    )
    assert broken.reward == 0.0 and broken.reason.startswith("patch_does_not_apply")


def test_validation_rejects_leaky_or_undecided_instances(generated):
    _, instances = generated
    instance = instances[0]
    backend = SubprocessBackendForTests()
    base = instance.base()
    checks = {}
    # 1. the reference fix does not fix it
    checks["no fix"] = replace(instance, patch="")
    # 2. the empty patch already passes: a FAIL_TO_PASS test that passes on the base
    hidden_modules = {p[:-3].replace("/", ".") for p in patch_paths(instance.test_patch)}
    passing_hidden = [t for t in instance.PASS_TO_PASS if t.rsplit(".", 2)[0] in hidden_modules]
    checks["passes unfixed"] = replace(
        instance, FAIL_TO_PASS=instance.FAIL_TO_PASS + tuple(passing_hidden[:1])
    )
    # 3. the tests that grade are visible in the agent's copy (shipped in the base, not the test patch)
    tests_in_base = replace(instance, test_patch="")
    checks["tests visible"] = tests_in_base
    # 4. the fix is in the agent's copy's git objects (a backup file of the fixed module)
    fixed = apply_patch(base, instance.patch)
    path = next(p for p in fixed if fixed[p] != base.get(p))
    leaky_dir = Path(instance.repo).parent / "leaky"
    write_directory({**base, path + ".orig": fixed[path]}, leaky_dir)
    checks["fix in history"] = replace(instance, repo=str(leaky_dir), base_commit="")
    reasons = {name: asyncio.run(validate(bad, backend)) for name, bad in checks.items()}
    assert not any(r.valid for r in reasons.values()), reasons
    assert "does not resolve" in reasons["no fix"].reason
    assert "pass without any fix" in reasons["passes unfixed"].reason
    assert "defined in the agent's copy" in reasons["tests visible"].reason or "does not resolve" in (
        reasons["tests visible"].reason
    )
    assert "git objects hold the fixed" in reasons["fix in history"].reason


def test_loader_names_the_bad_field(tmp_path):
    path = tmp_path / "bad.jsonl"
    good = {
        "instance_id": "x",
        "repo": ".",
        "base_commit": "",
        "problem_statement": "p",
        "patch": "",
        "test_patch": "",
        "FAIL_TO_PASS": '["tests.t.T.test_a"]',  # SWE-bench's JSON-in-a-string form is accepted
        "PASS_TO_PASS": [],
    }
    path.write_text(json.dumps(good) + "\n")
    assert load_jsonl(path)[0].FAIL_TO_PASS == ("tests.t.T.test_a",)
    for field, value, message in [
        ("FAIL_TO_PASS", [], "'FAIL_TO_PASS' must name at least one test"),
        ("patch", 3, "'patch' must be a string"),
        ("PASS_TO_PASS", "nope", "'PASS_TO_PASS' is a string but not a JSON list"),
    ]:
        path.write_text(json.dumps({**good, field: value}) + "\n")
        with pytest.raises(InstanceError, match=f"bad.jsonl line 1: {message}"):
            load_jsonl(path)


def test_validate_cli_prints_one_line_per_instance_and_fails_on_an_invalid_one(generated, tmp_path):
    out, instances = generated
    bad = replace(instances[1], instance_id="broken", patch="")
    mixed = tmp_path / "mixed.jsonl"
    write_jsonl([instances[0], bad], mixed)
    r = subprocess.run(
        [sys.executable, "-m", "palaestra.cli", "swe", "validate", str(mixed), "--backend", BACKEND],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 1, r.stderr
    rows = {row["instance_id"]: row for row in map(json.loads, r.stdout.splitlines())}
    assert rows[instances[0].instance_id] == {"instance_id": instances[0].instance_id, "valid": True}
    assert rows["broken"]["valid"] is False and "does not resolve" in rows["broken"]["reason"]
    ok = subprocess.run(
        [sys.executable, "-m", "palaestra.cli", "swe", "validate", str(out), "--backend", BACKEND],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert ok.returncode == 0, ok.stdout + ok.stderr


def test_a_test_command_that_cannot_start_is_reported_as_exactly_that(generated):
    """Not as tests "missing": the command's exit status and what it said (the sandbox's Python
    lacks the module it runs, as `python -m pytest` without pytest)."""
    _, instances = generated
    instance = replace(instances[0], test_cmd="python3 -m palaestra_no_such_test_runner -rA")
    backend = SubprocessBackendForTests()
    graded = asyncio.run(grade(instance, instance.patch, backend))
    assert graded.reward == 0.0 and graded.reason.startswith("test_command_failed: exit status 1: ")
    assert "No module named palaestra_no_such_test_runner" in graded.reason
    result = asyncio.run(validate(instance, backend))
    assert not result.valid and "could not run the tests in the sandbox" in result.reason
    assert "No module named palaestra_no_such_test_runner" in result.reason
