"""Code tests in a sandbox: the `Sandbox` interface and `verify_code`, which scores a program by
running Python tests against it.

The backends (docker, bubblewrap) live in ``palaestra.sandbox`` (a later issue); anything with an
``async def run(files, command, timeout_s, memory_mb) -> RunResult`` fits. For unit tests there is a
test double, ``palaestra.verifiers.testing.LocalSubprocessSandboxForTests`` — no isolation.

How a program is tested. ``verify_code`` writes three files into the sandbox and runs
``python3 _palaestra_harness.py``:

- ``solution.py``: the program. It is executed as module ``solution`` (so its
  ``if __name__ == "__main__":`` block does not run) and its names are visible to the tests, which
  may also ``from solution import f``.
- ``tests.py``: either ``def test_*()`` functions (each one a test; other top-level code is setup),
  or, when there are none, top-level ``assert`` statements (each one a test; any other statement is
  setup, run in order — HumanEval/MBPP style).
- the harness, which reports each test's outcome as it finishes, on stdout, behind a random
  per-run token; the program's own prints and the failure messages go to stderr and come back as
  ``CodeResult.output``.

Reward: ``partial_credit=False`` (the default) gives 1.0 only when every test passed and the run
finished; ``partial_credit=True`` gives ``passed / total``, counting tests that passed before a
timeout or crash. All-or-nothing is the default because fractional credit rewards passing the easy
tests and leaving the hard ones.

Not a security boundary by itself: the program runs in the same process as the harness, so a
program written to forge results (read the token from the harness file, write to the saved stdout)
can. The token defends against accidents — a program printing harness-like lines, calling
``sys.exit(0)`` or ``os._exit(0)`` (which ends the run before "done" and scores 0). Isolation from
the host is the sandbox's job.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Literal, Protocol

__all__ = ["CodeResult", "RunResult", "Sandbox", "verify_code"]


@dataclass(frozen=True)
class RunResult:
    """What one sandboxed command did."""

    exit_code: int
    """The command's exit status; negative for a signal, as in `subprocess`."""
    stdout: str
    stderr: str
    timed_out: bool
    """True if the sandbox killed the command at ``timeout_s``."""
    duration_s: float


class Sandbox(Protocol):
    """An isolated place to run a command over a few files."""

    async def run(
        self, files: dict[str, str], command: list[str], timeout_s: float, memory_mb: int
    ) -> RunResult:
        """Write ``files`` (relative path -> text) into a fresh working directory, run ``command``
        there with a wall-clock limit of ``timeout_s`` and a memory limit of ``memory_mb``, and
        return what happened. Must not raise for anything the command does."""
        ...


CodeReason = Literal["passed", "failed", "timeout", "syntax error", "crashed", "no tests"]


@dataclass(frozen=True)
class CodeResult:
    reward: float
    passed: int
    total: int
    reason: CodeReason
    """``passed`` (all tests), ``failed`` (some did not), ``timeout``, ``syntax error`` (the
    program does not compile), ``crashed`` (the run ended before the harness finished: the program
    exited, ran out of memory, or raised on import), ``no tests`` (the tests define none)."""
    output: str
    """The program's printed output and the failure messages, truncated to the last
    ``max_output_chars`` characters — fit to show the model in a multi-turn loop."""


PROGRAM_FILE = "solution.py"
TESTS_FILE = "tests.py"
HARNESS_FILE = "_palaestra_harness.py"

# Runs inside the sandbox with nothing but the standard library. {token} is filled in per run.
_HARNESS = r"""
import ast, asyncio, inspect, os, sys, traceback, types

TOKEN = "{token}"
_report_stream = os.fdopen(os.dup(1), "w")  # the harness's channel; fd 1 is then pointed at stderr
os.dup2(2, 1)
sys.stdout = sys.stderr


def report(*parts):
    _report_stream.write(" ".join([TOKEN, *map(str, parts)]) + "\n")
    _report_stream.flush()


def describe(exc):
    lines = traceback.format_exception_only(type(exc), exc)
    return lines[-1].strip() if lines else type(exc).__name__


def main():
    with open("tests.py") as f:
        tests_tree = ast.parse(f.read(), "tests.py")
    funcs = [n.name for n in tests_tree.body
             if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name.startswith("test")]
    asserts = [] if funcs else [n for n in tests_tree.body if isinstance(n, ast.Assert)]
    names = funcs or ["assert line %d" % n.lineno for n in asserts]
    report("total", len(names))
    if not names:
        report("done")
        return
    try:
        with open("solution.py") as f:
            code = compile(f.read(), "solution.py", "exec")
    except (SyntaxError, ValueError) as e:
        print("syntax error in solution.py: " + describe(e))
        report("syntax_error")
        return
    module = types.ModuleType("solution")
    module.__file__ = os.path.abspath("solution.py")
    sys.modules["solution"] = module
    try:
        exec(code, module.__dict__)
    except BaseException as e:
        print("solution.py raised on import:")
        traceback.print_exc()
        report("import_error")
        return
    ns = dict(module.__dict__)
    ns["__name__"] = "tests"
    if funcs:
        try:
            exec(compile(tests_tree, "tests.py", "exec"), ns)
        except BaseException:
            print("tests.py setup raised:")
            traceback.print_exc()
            report("done")
            return
        def call(name):
            result = ns[name]()
            if inspect.iscoroutine(result):  # an `async def test_*`
                asyncio.run(result)

        units = [(name, lambda name=name: call(name)) for name in funcs]
    else:
        units = []
        for node in tests_tree.body:
            one = compile(ast.Module(body=[node], type_ignores=[]), "tests.py", "exec")
            if isinstance(node, ast.Assert):
                units.append(("assert line %d" % node.lineno, lambda one=one: exec(one, ns)))
            else:
                units.append((None, lambda one=one: exec(one, ns)))
    index = 0
    for name, run in units:
        try:
            run()
        except BaseException as e:
            if name is None:
                print("tests.py setup raised:")
                traceback.print_exc()
                break
            print("FAIL %s: %s" % (name, describe(e)))
            report("fail", index)
        else:
            if name is not None:
                report("pass", index)
        if name is not None:
            index += 1
    report("done")


main()
sys.stdout.flush()
os._exit(0)  # skip atexit handlers and finalizers the program may have registered
"""


async def verify_code(
    sandbox: Sandbox,
    program: str,
    tests: str,
    timeout_s: float = 10.0,
    *,
    memory_mb: int = 512,
    partial_credit: bool = False,
    python: str = "python3",
    max_output_chars: int = 4000,
) -> CodeResult:
    """Run ``tests`` against ``program`` in ``sandbox`` (see the module docstring for the formats
    and the reward rule). ``timeout_s`` bounds the whole run, import and all tests together."""
    token = f"@@palaestra-{secrets.token_hex(8)}@@"
    files = {
        PROGRAM_FILE: program,
        TESTS_FILE: tests,
        HARNESS_FILE: _HARNESS.replace("{token}", token),
    }
    run = await sandbox.run(files, [python, HARNESS_FILE], timeout_s, memory_mb)

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
    if run.timed_out:
        reason = "timeout"
    elif event == "syntax_error":
        reason = "syntax error"
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
    return CodeResult(reward=reward, passed=passed, total=total, reason=reason, output=output)
