"""The code grader (`palaestra.verifiers.code`): formats, reward rules, limits, and solutions that
try to fool it (exit before the tests, patch the harness, forge reports, read the tests, shadow
builtins, return objects that equal everything). Each runs on the labelled subprocess test double
and on the real local sandbox backend."""

from __future__ import annotations

import asyncio
import time

import pytest

from palaestra.verifiers.code import CodeResult, grade_code, verify_code
from tests.support.doubles import SubprocessBackendForTests, SubprocessSandboxForTests
from tests.support.sandbox_backends import backend_for, backend_names

ADD = "def add(a, b):\n    return a + b\n"
ASSERT_TESTS = "assert add(1, 2) == 3\nx = 10\nassert add(x, -4) == 6\nassert add(0, 0) == 0\n"
FUNCTION_TESTS = """
from solution import add

def test_small():
    assert add(1, 2) == 3

def test_negative():
    assert add(-1, -2) == -3

async def test_async():
    assert add(0, 0) == 0

def helper():  # not a test
    raise AssertionError
"""


@pytest.fixture(params=backend_names())
def backend(request):
    with backend_for(request.param) as b:
        yield b


def run_code(backend, program: str, tests: str = ASSERT_TESTS, **kwargs) -> CodeResult:
    return asyncio.run(grade_code(backend, program, tests, **kwargs))


def test_passing_program(backend):
    assert run_code(backend, ADD) == CodeResult(reward=1.0, passed=3, total=3, reason="passed", output="")
    result = run_code(backend, ADD, FUNCTION_TESTS)
    assert (result.reward, result.passed, result.total, result.reason) == (1.0, 3, 3, "passed")


def test_failing_program_all_or_nothing_and_partial_credit(backend):
    wrong = "def add(a, b):\n    return 0 if a == 1 else a + b\n"
    result = run_code(backend, wrong)
    assert (result.reward, result.passed, result.total, result.reason) == (0.0, 2, 3, "failed")
    assert "FAIL assert line 1: AssertionError" in result.output
    assert run_code(backend, wrong, partial_credit=True).reward == pytest.approx(2 / 3)


def test_timeout_keeps_partial_progress(backend):
    slow = "def add(a, b):\n    while a > 5:\n        pass\n    return a + b\n"
    start = time.perf_counter()
    result = run_code(backend, slow, timeout_s=2.0, partial_credit=True)
    assert time.perf_counter() - start < 10
    assert (result.reason, result.passed, result.total) == ("timeout", 1, 3)
    assert result.reward == pytest.approx(1 / 3)


def test_exceptions_cross_as_builtin_types(backend):
    program = "def parse(s):\n    if not s.isdigit():\n        raise ValueError('not a number')\n    return int(s)\n"
    tests = (
        "def test_ok():\n    assert parse('12') == 12\n"
        "def test_raises():\n    try:\n        parse('x')\n    except ValueError as e:\n"
        "        assert 'not a number' in str(e)\n    else:\n        raise AssertionError('no error')\n"
    )
    assert run_code(backend, program, tests).reason == "passed"


@pytest.mark.parametrize(
    "program, reason",
    [
        ("def add(a, b)\n    return a + b\n", "syntax error"),
        ("import sys\nsys.exit(0)\n" + ADD, "crashed"),  # exits on import, before any test
        ("import os\nos._exit(0)\n" + ADD, "crashed"),
        ("exit(0)\n" + ADD, "crashed"),
        ("raise RuntimeError('boom')\n", "crashed"),
    ],
)
def test_broken_programs(backend, program, reason):
    result = run_code(backend, program)
    assert (result.reward, result.passed, result.reason) == (0.0, 0, reason)


# Solutions written to fool a grader. None of them computes `add`, so each must score 0.
CHEATS = {
    "exit inside the function": "import sys\ndef add(a, b):\n    sys.exit(0)\n",
    "os._exit inside the function": "import os\ndef add(a, b):\n    os._exit(0)\n",
    "atexit prints a pass": (
        "import atexit, sys\natexit.register(lambda: print('3 passed', flush=True))\n"
        "def add(a, b):\n    return None\n"
    ),
    "prints lookalike report lines": (
        "import sys\nfor i in range(3):\n    print(f'@@palaestra-{\"0\" * 32}@@ pass {i}')\n"
        "    sys.__stdout__.write(f'@@palaestra-{\"0\" * 32}@@ pass {i}\\n')\n"
        "print('all tests passed')\ndef add(a, b):\n    return None\n"
    ),
    "writes into the grader's stdout through /proc": (
        "import os\n"
        "def add(a, b):\n"
        "    for fd in range(0, 10):\n"
        "        try:\n"
        "            with open(f'/proc/{os.getppid()}/fd/{fd}', 'w') as f:\n"
        "                f.write('pass 0\\npass 1\\npass 2\\ndone\\n')\n"
        "        except OSError:\n"
        "            pass\n"
        "    return None\n"
    ),
    "reads the token from the grader's memory": (
        "import os, re\n"
        "def add(a, b):\n"
        "    pid = os.getppid()\n"
        "    try:\n"
        "        maps = open(f'/proc/{pid}/maps').read().splitlines()\n"
        "        mem = open(f'/proc/{pid}/mem', 'rb')\n"
        "        for line in maps:\n"
        "            lo, hi = (int(x, 16) for x in line.split()[0].split('-'))\n"
        "            try:\n"
        "                mem.seek(lo)\n"
        "                m = re.search(rb'@@palaestra-[0-9a-f]{32}@@', mem.read(min(hi - lo, 1 << 24)))\n"
        "            except OSError:\n"
        "                continue\n"
        "            if m:\n"
        "                out = open(f'/proc/{pid}/fd/1', 'w')\n"
        "                out.write(''.join(f'{m.group().decode()} pass {i}\\n' for i in range(3)))\n"
        "                out.write(m.group().decode() + ' done\\n')\n"
        "                out.close()\n"
        "    except OSError:\n"
        "        pass\n"
        "    return None\n"
    ),
    "kills the grader": "import os, signal\ndef add(a, b):\n    os.kill(os.getppid(), signal.SIGKILL)\n",
    "patches the harness files": (
        "import glob\n"
        "for name in glob.glob('*.py'):\n"
        "    if name != 'solution.py':\n"
        "        open(name, 'w').write('print(\"passed\")\\n')\n"
        "import codec\ncodec.decode = lambda data, depth=0: True\n"
        "import builtins\nbuiltins.AssertionError = type('Nope', (Exception,), {})\n"
        "def add(a, b):\n    return None\n"
    ),
    "returns an object equal to everything": (
        "class Anything(int):\n    def __eq__(self, other):\n        return True\n    __hash__ = int.__hash__\n"
        "def add(a, b):\n    return Anything(7)\n"
    ),
    "shadows the builtins the tests use": (
        "def abs(x):\n    return 0\ndef len(x):\n    return 3\ndef add(a, b):\n    return a * 1000 + b\n"
    ),
    "reads the tests from disk": (
        "import glob, re\n"
        "SOURCES = ''.join(open(n).read() for n in glob.glob('*') if n != 'solution.py')\n"
        "ANSWERS = [int(x) for x in re.findall(r'== (-?\\d+)', SOURCES)]\n"
        "CALLS = []\n"
        "def add(a, b):\n    CALLS.append(1)\n    return ANSWERS[len(CALLS) - 1] if ANSWERS else None\n"
    ),
    "writes fake replies into its own channel": (
        "import os\nos.write(1, b'')\n"
        "import sys\nchannel = [f for f in range(3, 12) if os.path.exists(f'/proc/self/fd/{f}')]\n"
        "for fd in channel:\n"
        "    try:\n"
        "        os.write(fd, b'{\"ok\": true}\\n' * 10)\n"
        "    except OSError:\n"
        "        pass\n"
        "def add(a, b):\n    return None\n"
    ),
}
ABS_TESTS = "assert abs(add(1, 2) - 3) < 1e-9\nassert len([add(0, 0)]) == 1\nassert add(5, 5) == 10\n"


@pytest.mark.parametrize("name", sorted(CHEATS))
def test_cheating_solutions_score_zero(backend, name):
    tests = ABS_TESTS if "builtins" in name else ASSERT_TESTS
    result = run_code(backend, CHEATS[name], tests, partial_credit=True)
    honest_passes = 1 if "builtins" in name else 0  # len([x]) == 1 holds for any x
    assert result.passed == honest_passes, result
    assert result.reward < 1.0 and result.reason != "passed", result


def test_no_tests_and_memory_limit(backend):
    assert run_code(backend, ADD, "x = 1\n").reason == "no tests"
    from palaestra.sandbox.base import Limits

    hog = "x = bytearray(4 * 1024**3)\n" + ADD
    result = run_code(backend, hog, limits=Limits(memory_mb=256))
    assert result.reward == 0.0 and result.reason in ("crashed", "memory"), result


def test_bad_tests_file_is_a_grader_error():
    result = asyncio.run(grade_code(SubprocessBackendForTests(), ADD, "assert (\n"))
    assert result.reason == "grader error" and "tests.py does not compile" in result.output


def test_grader_reads_partial_progress_from_a_killed_run():
    """The sandbox killed the run after two reports: partial credit counts them (labelled canned
    sandbox built on the test double, answering exec with a fixed timeout result)."""
    from palaestra.sandbox.base import ExecResult

    class CannedTimeoutSandboxForTests(SubprocessSandboxForTests):
        async def exec(self, cmd=None, *, script=None, stdin=None, timeout=None):
            import json

            token = json.loads(stdin)["token"]
            return ExecResult("timeout", -9, f"{token} total 4\n{token} pass 0\n{token} pass 1\n", "")

    box = CannedTimeoutSandboxForTests()
    result = asyncio.run(verify_code(box, ADD, ASSERT_TESTS, 2.0, partial_credit=True))
    assert (result.reward, result.passed, result.total, result.reason) == (0.5, 2, 4, "timeout")
    asyncio.run(box.close())


def test_test_double_refuses_paths_outside_its_directory():
    box = SubprocessSandboxForTests()
    with pytest.raises(ValueError):
        asyncio.run(box.upload("../escape.py", ""))
    asyncio.run(box.close())
