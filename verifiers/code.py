"""Code tests in a sandbox: `verify_code` scores a Python program by running tests against it in a
sandbox from ``palaestra.sandbox`` (local bubblewrap, docker, remote); `grade_code` does it in a
fresh sandbox of a backend.

    async with await backend.create("python") as box:
        result = await verify_code(box, program, tests, timeout_s=10)
    result.reward, result.passed, result.total, result.reason

Formats. ``program`` is the solution, imported as module ``solution`` (so its
``if __name__ == "__main__":`` block does not run). ``tests`` is either ``def test_*()`` functions
(each one a test; other top-level code is setup) or, when there are none, top-level ``assert``
statements (each one a test; any other statement is setup, run in order — HumanEval/MBPP style).
The solution's top-level names are visible to the tests, which may also ``from solution import f``.

How it cannot be fooled. The tests run in a grader process that never runs the solution's code: the
solution lives in a second process and the tests call its functions through proxies that carry only
plain data (``code_harness/``). The tests reach the grader through stdin, never the disk; it reports
each outcome behind a random per-run token that stays in its memory. So a solution that exits
(``exit(0)``, ``os._exit``), patches the harness, reads the tests from disk or prints a fake
"passed" line scores what its functions' answers score. Isolation from the host is the sandbox's job.

Reward: ``partial_credit=False`` (the default) gives 1.0 only when every test passed and the run
finished; ``partial_credit=True`` gives ``passed / total``, counting tests that passed before a
timeout or crash. All-or-nothing is the default because fractional credit rewards passing the easy
tests and leaving the hard ones.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from palaestra.sandbox.base import Backend, Limits, Sandbox

__all__ = ["CodeResult", "grade_code", "verify_code"]

CodeReason = Literal[
    "passed",
    "failed",
    "timeout",
    "syntax error",
    "crashed",
    "no tests",
    "memory",
    "output limit",
    "grader error",
]


@dataclass(frozen=True)
class CodeResult:
    reward: float
    passed: int
    total: int
    reason: CodeReason
    """``passed`` (all tests), ``failed`` (some did not), ``timeout``, ``syntax error`` (the
    program does not compile), ``crashed`` (the solution failed on import, e.g. exited or raised),
    ``no tests`` (the tests define none), ``memory`` / ``output limit`` (the sandbox killed the run),
    ``grader error`` (the grader itself could not run: no python3 in the sandbox, bad tests file)."""
    output: str
    """The program's printed output and the failure messages, truncated to the last
    ``max_output_chars`` characters — fit to show the model in a multi-turn loop."""


PROGRAM_FILE = "solution.py"
HARNESS_DIR = Path(__file__).with_name("code_harness")
HARNESS_FILES = ("grader.py", "worker.py", "codec.py")


async def verify_code(
    sandbox: Sandbox,
    program: str,
    tests: str,
    timeout_s: float = 10.0,
    *,
    partial_credit: bool = False,
    python: str = "python3",
    max_output_chars: int = 4000,
) -> CodeResult:
    """Run ``tests`` against ``program`` in ``sandbox`` (see the module docstring for the formats
    and the reward rule). ``timeout_s`` bounds the whole run, import and all tests together. Use a
    fresh sandbox: files an earlier command left there are visible to the solution."""
    try:
        compile(tests, "tests.py", "exec")
    except (SyntaxError, ValueError) as exc:
        return CodeResult(0.0, 0, 0, "grader error", f"tests.py does not compile: {exc}")
    token = f"@@palaestra-{secrets.token_hex(16)}@@"
    for name in HARNESS_FILES:
        await sandbox.upload(name, (HARNESS_DIR / name).read_text())
    await sandbox.upload(PROGRAM_FILE, program)
    run = await sandbox.exec(
        [python, "-B", "-E", "-s", "grader.py"],
        stdin=json.dumps({"token": token, "tests": tests}),
        timeout=timeout_s,
    )

    total, done, event = 0, False, None
    passed_ids: set[str] = set()  # a test reported twice still counts once
    for line in run.stdout.splitlines():
        if not line.startswith(token + " "):
            continue
        kind, *rest = line[len(token) + 1 :].split()
        if kind == "total" and rest and rest[0].isdigit():
            total = int(rest[0])
        elif kind == "pass" and rest:
            passed_ids.add(rest[0])
        elif kind == "done":
            done = True
        elif kind in ("syntax_error", "import_error"):
            event = kind

    passed = min(len(passed_ids), total)
    reason: CodeReason
    if run.status == "timeout":
        reason = "timeout"
    elif run.status == "memory":
        reason = "memory"
    elif run.status == "output_limit":
        reason = "output limit"
    elif run.status == "error" or (total == 0 and not done):
        reason = "grader error"
    elif event == "syntax_error":
        reason = "syntax error"
    elif event == "import_error":
        reason = "crashed"
    elif done and total == 0:
        reason = "no tests"
    elif done and passed == total:
        reason = "passed"
    elif done:
        reason = "failed"
    else:
        reason = "crashed"
    if partial_credit:
        reward = passed / total if total else 0.0
    else:
        reward = 1.0 if reason == "passed" else 0.0
    output = run.stderr[-max_output_chars:] if max_output_chars > 0 else ""
    if reason == "grader error":
        output = f"{run.status} {run.detail}: {run.stderr[-max_output_chars:]}".strip()
    return CodeResult(reward=reward, passed=passed, total=total, reason=reason, output=output)


async def grade_code(
    backend: Backend,
    program: str,
    tests: str,
    *,
    limits: Limits | None = None,
    timeout_s: float = 10.0,
    partial_credit: bool = False,
    profile: str = "python",
) -> CodeResult:
    """`verify_code` in a fresh sandbox of ``backend``, closed afterwards."""
    box = await backend.create(profile, limits)
    try:
        return await verify_code(box, program, tests, timeout_s, partial_credit=partial_credit)
    finally:
        await box.close()
