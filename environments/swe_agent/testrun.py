"""Running an instance's tests on a tree of files in a fresh sandbox.

    outcomes = await run_tests(backend, files, ["tests.test_x.TestY.test_z"], "python3 -m unittest")
    outcomes["tests.test_x.TestY.test_z"].outcome      # "passed", "failed", "error", "missing"

The tree is unpacked under ``repo/`` of the sandbox with python's tarfile (no tar or git needed in
the image). An instance's environment (`repo_env.py`), when it has one, is mounted at ``/venv`` and
first on ``PATH`` of the test command. ``python3 -m unittest`` ids run through `unittest_runner.py`, which reports behind a
per-run token; any other ``test_cmd`` gets the ids appended and its output read as pytest's
``-rA`` summary (``PASSED id`` / ``FAILED id`` / ``ERROR id``).
"""

from __future__ import annotations

import json
import re
import secrets
import shlex
from dataclasses import dataclass
from pathlib import Path

from palaestra.environments.swe_agent.instance import UNITTEST
from palaestra.environments.swe_agent.repo_env import ACTIVATE, venv_mount
from palaestra.environments.swe_agent.snapshot import Snapshot, pack_tar
from palaestra.sandbox.base import Backend, ExecResult, Limits, Sandbox

RUNNER = Path(__file__).with_name("unittest_runner.py")
UNPACK = (
    "import sys, tarfile; t = tarfile.open(sys.argv[1]); "
    "t.extractall(sys.argv[2], filter='data') if hasattr(tarfile, 'data_filter') else t.extractall(sys.argv[2])"
)


@dataclass(frozen=True)
class TestOutcome:
    id: str
    outcome: str
    """passed, failed, error, skipped, or missing (never reported: the run ended first, or the
    test command could not run them: `TestRun.command_failed`)."""
    message: str = ""
    at: dict | None = None
    """Where in the test file it failed: {file, line, code}."""

    @property
    def passed(self) -> bool:
        return self.outcome == "passed"


@dataclass
class TestRun:
    outcomes: dict[str, TestOutcome]
    exec: ExecResult

    @property
    def command_failed(self) -> str | None:
        """Why the test command ran none of the tests, when it exited non-zero reporting none of
        them (it could not start: ``No module named pytest``, a missing file, a collection error):
        its exit status and the last line it wrote. None when any test was reported, or the run was
        cut (a timeout, a limit: `exec.status`)."""
        if self.exec.status != "ok" or self.exec.exit_code == 0:
            return None
        if any(o.outcome != "missing" for o in self.outcomes.values()):
            return None
        written = [line.strip() for line in (self.exec.stdout + "\n" + self.exec.stderr).splitlines()]
        last = next((line for line in reversed(written) if line), "no output")
        return f"exit status {self.exec.exit_code}: {last[:300]}"


def pytest_outcomes(stdout: str, test_ids: list[str]) -> dict[str, TestOutcome]:
    """The outcomes pytest's ``-rA`` summary reports for ``test_ids`` (``PASSED <id>``,
    ``FAILED <id> - <message>``); a parametrized id may hold spaces."""
    wanted = set(test_ids)
    outcomes: dict[str, TestOutcome] = {}
    for match in re.finditer(r"^(PASSED|FAILED|ERROR) (.+)$", stdout, re.MULTILINE):
        status, rest = match.group(1).lower(), match.group(2).rstrip()
        if rest in wanted:
            outcomes[rest] = TestOutcome(rest, status)
            continue
        head, _, message = rest.partition(" - ")
        while head not in wanted and " - " in message:  # an id that itself holds " - "
            more, _, message = message.partition(" - ")
            head = f"{head} - {more}"
        if head in wanted:
            outcomes[head] = TestOutcome(head, status, message)
    return outcomes


async def collect_pytest_ids(
    box: Sandbox, test_cmd: str, targets: list[str], timeout_s: float = 120.0
) -> list[str]:
    """The node ids ``test_cmd --collect-only -q`` lists for ``targets`` in the tree under ``repo/``."""
    quoted = " ".join(shlex.quote(t) for t in targets)
    quiet = "" if " -q" in f" {test_cmd}" else "-q "  # one -q lists node ids; two only counts per file
    result = await box.exec(
        f"{ACTIVATE}cd repo && {test_cmd} --collect-only {quiet}{quoted}", timeout=timeout_s
    )
    ids = [line.strip() for line in result.stdout.splitlines() if "::" in line and not line.startswith(" ")]
    if not ids:
        tail = (result.stdout + result.stderr).strip().splitlines()[-3:]
        raise RuntimeError(f"{test_cmd} collected no test ({result.status}, exit {result.exit_code}): {tail}")
    return ids


async def upload_tree(box: Sandbox, files: Snapshot | bytes, where: str = "repo") -> ExecResult:
    """Unpacks ``files`` (a snapshot, or a ready .tar.gz) into ``where`` in ``box``."""
    await box.upload("_tree.tgz", files if isinstance(files, bytes) else pack_tar(files))
    return await box.exec(["python3", "-c", UNPACK, "_tree.tgz", where], timeout=60)


async def run_tests_in(
    box: Sandbox, test_ids: list[str], test_cmd: str = UNITTEST, timeout_s: float = 60.0
) -> TestRun:
    """Runs ``test_ids`` in the tree already unpacked under ``repo/`` of ``box``."""
    if test_cmd.strip() == UNITTEST:
        token = f"@@swe-{secrets.token_hex(16)}@@"
        await box.upload("_unittest_runner.py", RUNNER.read_text())
        result = await box.exec(
            ACTIVATE + "cd repo && exec python3 -I -B ../_unittest_runner.py",
            stdin=json.dumps({"token": token, "tests": test_ids}),
            timeout=timeout_s,
        )
        outcomes: dict[str, TestOutcome] = {}
        for line in result.stdout.splitlines():
            if not line.startswith(token + " "):
                continue
            message = json.loads(line[len(token) + 1 :])
            if isinstance(message, dict) and message.get("id") in test_ids:
                outcomes[message["id"]] = TestOutcome(
                    message["id"], message["outcome"], message.get("message", ""), message.get("at")
                )
    else:
        command = f"{ACTIVATE}cd repo && {test_cmd} " + " ".join(shlex.quote(t) for t in test_ids)
        result = await box.exec(command, timeout=timeout_s)
        outcomes = pytest_outcomes(result.stdout, test_ids)
    for test_id in test_ids:
        outcomes.setdefault(test_id, TestOutcome(test_id, "missing", f"not reported ({result.status})"))
    return TestRun(outcomes, result)


async def run_tests(
    backend: Backend,
    files: Snapshot,
    test_ids: list[str],
    test_cmd: str = UNITTEST,
    *,
    limits: Limits | None = None,
    timeout_s: float = 60.0,
    venv: Path | None = None,
) -> TestRun:
    """``files`` unpacked in a fresh sandbox of ``backend`` (with ``venv``, a built per-repository
    environment, mounted: `repo_env.py`), ``test_ids`` run there."""
    box = await backend.create("python", limits, mounts=(venv_mount(venv),) if venv else ())
    try:
        unpacked = await upload_tree(box, files)
        if not unpacked.ok:
            raise RuntimeError(f"could not unpack the repository: {unpacked.status} {unpacked.stderr[-500:]}")
        return await run_tests_in(box, test_ids, test_cmd, timeout_s)
    finally:
        await box.close()
