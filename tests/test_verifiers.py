"""Verifiers: math answers (extraction, equivalence decisions, timeouts), checks and their
composition, and code tests through the labelled test double."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from palaestra.verifiers.checks import (
    CheckResult,
    exact_match,
    has_exactly_one_boxed,
    is_valid_json,
    nothing_after_answer,
    regex_match,
    weighted,
)
from palaestra.verifiers.code import CodeResult, RunResult, verify_code
from palaestra.verifiers.math import (
    MathVerifier,
    MathVerifierError,
    averify_math,
    extract_answer,
    normalize_answer,
    verify_math,
)
from palaestra.verifiers.testing import LocalSubprocessSandboxForTests


@pytest.fixture(scope="module")
def verifier():
    with MathVerifier(max_workers=2) as v:
        yield v


# ------------------------------------------------------------------------------------ extraction


@pytest.mark.parametrize(
    "text, answer",
    [
        (r"so \boxed{42}.", "42"),
        (r"\boxed{\frac{1}{2}}", r"\frac{1}{2}"),  # nested braces
        (r"first \boxed{1}, then corrected: \boxed{2}", "2"),  # the last box wins
        (r"\fbox{7}", "7"),
        (r"\boxed {3}", "3"),
        (r"\boxed{\boxed{5}}", r"\boxed{5}"),  # the outer box; normalisation unwraps the inner one
        (r"\boxed{4} and a dangling \boxed{5", "4"),  # an unclosed box is not a box
        (r"\boxed{ }", None),  # the model boxed nothing: no answer, no fallback to other numbers
        ("Step 1: 3 + 4 = 7\n#### 1,000", "1,000"),
        ("The answer is 12 apples. Step 5 was hard.", "12 apples"),
        ("The final answer is: **3.5**.", "3.5"),
        ("Answer: $-4$", "$-4$"),
        ("#### 5\nActually the answer is 6", "6"),  # whichever comes last
        ("We get 3 apples, then 1,250 and finally -17.5", "-17.5"),  # the last number
        ("half of it: 3/4 of the cake", "3/4"),
        ("about 50% of them", "50%"),
        ("no numbers at all", None),
        ("", None),
    ],
)
def test_extract_answer(text, answer):
    assert extract_answer(text) == answer


def test_require_boxed_ignores_other_answer_forms():
    assert extract_answer("The answer is 5", require_boxed=True) is None
    assert extract_answer("#### 5", require_boxed=True) is None
    assert extract_answer(r"The answer is \boxed{5}", require_boxed=True) == "5"


def test_extraction_is_linear_on_adversarial_text():
    text = r"\boxed{" * 50_000 + "1"
    start = time.perf_counter()
    assert extract_answer(text, require_boxed=True) is None
    assert time.perf_counter() - start < 1.0


@pytest.mark.parametrize(
    "raw, normalised",
    [
        ("1,000", "1000"),
        ("1{,}000", "1000"),
        ("$1,234,567.5$", "1234567.5"),
        (r"\$12", "12"),
        ("12 dollars", "12"),
        (r"12\text{ cm}", "12"),
        (r"\dfrac{1}{2}", r"\frac{1}{2}"),
        ("50 percent", "50%"),
        ("−3", "-3"),
        ("1e3", r"1\times10^{3}"),
        ("2 pi", "2 pi"),  # a math word is not a unit
        ("1,5", "1,5"),  # not a thousands separator
    ],
)
def test_normalize_answer(raw, normalised):
    assert normalize_answer(raw) == normalised


# ------------------------------------------------------------------------------------ equivalence

# (completion, expected, correct) — cases that trip naive string or float checkers.
EQUIVALENCE = [
    (r"\boxed{1/2}", "0.5", True),
    (r"\boxed{0.5}", "1/2", True),
    (r"\boxed{\frac{1}{2}}", "0.5", True),
    (r"\boxed{\dfrac{1}{2}}", "1/2", True),
    (r"\boxed{\frac12}", "0.5", True),
    (r"\boxed{1,000}", "1000", True),
    (r"\boxed{1000}", "1,000", True),
    ("#### 1,234,567", "1234567", True),
    (r"\boxed{1,5}", "15", False),  # a list, not a thousands separator
    (r"\boxed{1,5}", "1.5", False),
    (r"\boxed{-3}", "-3", True),
    (r"\boxed{3}", "-3", False),
    (r"\boxed{-\frac{3}{4}}", "-0.75", True),
    ("The answer is 12 dollars.", "12", True),
    (r"\boxed{\$12}", "12", True),
    (r"\boxed{12\text{ cm}}", "12", True),
    (r"\boxed{3.0}", "3", True),
    (r"\boxed{0.333333}", "1/3", True),  # rounded to 6 places, as math-verify does
    (r"\boxed{0.33}", "1/3", False),
    (r"\boxed{x = 5}", "5", True),
    (r"\boxed{\sqrt{2}}", "2^{1/2}", True),
    (r"\boxed{x+1}", "1+x", True),
    (r"\boxed{1e3}", "1000", True),
    (r"\boxed{7}", "8", False),
    (r"\boxed{Tuesday}", "Tuesday", True),  # identical text, no math needed
    (r"\boxed{\frac{3}{4}}", r"\boxed{\frac{3}{4}}", True),  # a gold answer given boxed
]


@pytest.mark.parametrize("completion, expected, correct", EQUIVALENCE)
def test_equivalence(verifier, completion, expected, correct):
    result = verifier.verify(completion, expected)
    assert result.correct is correct, result
    assert result.reward == (1.0 if correct else 0.0)
    assert result.reason == ("equivalent" if correct else "not equivalent")
    assert result.expected == expected


# The documented percentage decision: "X%" equals both X/100 and X, in either direction; a bare
# number is never rescaled.
PERCENT = [
    (r"\boxed{50\%}", "0.5", True),
    (r"\boxed{50%}", "1/2", True),
    (r"\boxed{50\%}", "50", True),
    ("The answer is 50%.", "50", True),
    (r"\boxed{0.5}", "50%", True),
    (r"\boxed{50}", "50%", True),
    ("The answer is 50 percent", "0.5", True),
    (r"\boxed{0.5}", "50", False),
    (r"\boxed{50}", "0.5", False),
    (r"\boxed{25\%}", "0.5", False),
]


@pytest.mark.parametrize("completion, expected, correct", PERCENT)
def test_percentage_decision(verifier, completion, expected, correct):
    assert verifier.verify(completion, expected).correct is correct


def test_result_fields(verifier):
    result = verifier.verify(r"Thus \boxed{\frac{1}{2}}.", "0.5")
    assert (result.reward, result.correct, result.parsed, result.expected, result.reason) == (
        1.0,
        True,
        r"\frac{1}{2}",
        "0.5",
        "equivalent",
    )


@pytest.mark.parametrize(
    "completion, reason",
    [
        ("I don't know.", "no answer found"),
        (r"\boxed{}", "no answer found"),
        (r"\boxed{", "no answer found"),  # unbalanced: no box at all, and no number either
        (r"\boxed{$$}", "no answer found"),
        (r"\boxed{" + "x" * 2000 + "}", "unparseable"),  # longer than any real answer
    ],
)
def test_malformed_outputs(verifier, completion, reason):
    result = verifier.verify(completion, "3")
    assert (result.reward, result.correct, result.reason) == (0.0, False, reason)


def test_require_boxed(verifier):
    assert verifier.verify("The answer is 3", "3", require_boxed=True).reason == "no answer found"
    assert verifier.verify(r"\boxed{3}", "3", require_boxed=True).correct


def test_unbalanced_braces_fall_back_to_earlier_box(verifier):
    assert verifier.verify(r"\boxed{3} ... \boxed{\frac{1}{2}", "3").correct


def test_huge_number_is_not_a_hang(verifier):
    # A 4000-digit literal: parsed or refused, but answered quickly either way.
    start = time.perf_counter()
    result = verifier.verify(r"\boxed{" + "9" * 900 + "}", "5", timeout_s=5)
    assert not result.correct
    assert time.perf_counter() - start < 5


@pytest.mark.parametrize(
    "answer",
    [
        r"10^{10^{10}}",  # a big-integer power: stuck in C code, where no signal could interrupt it
        "(" * 30 + "1" + ")" * 30,  # the LaTeX parser is exponential in nesting depth
    ],
)
def test_adversarial_answer_times_out_instead_of_hanging(verifier, answer):
    start = time.perf_counter()
    result = verifier.verify(rf"\boxed{{{answer}}}", "5", timeout_s=0.5)
    elapsed = time.perf_counter() - start
    assert (result.reason, result.reward, result.correct) == ("timeout", 0.0, False)
    assert elapsed < 0.5 + 2.0  # the limit, plus at most a worker start-up for this call
    # The killed worker was replaced; the verifier keeps working.
    assert verifier.verify(r"\boxed{0.5}", "1/2").correct


def test_timeout_works_off_the_main_thread(verifier):
    results = []

    def work():
        results.append(verifier.verify(r"\boxed{10^{10^{10}}}", "5", timeout_s=0.5).reason)
        results.append(verifier.verify(r"\boxed{0.5}", "1/2").reason)

    threads = [threading.Thread(target=work) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert sorted(results) == ["equivalent"] * 3 + ["timeout"] * 3


def test_async_and_module_level_api():
    async def main():
        return await asyncio.gather(
            averify_math(r"\boxed{\frac{1}{2}}", "0.5"),
            averify_math(r"\boxed{2}", "3"),
        )

    good, bad = asyncio.run(main())
    assert good.correct and not bad.correct
    assert verify_math("#### 1,000", "1000").correct


def test_worker_that_cannot_start_is_an_error_not_a_zero_reward(monkeypatch):
    import palaestra.verifiers.math as math_module

    monkeypatch.setattr(math_module, "_WORKER_COMMAND", "import sys; sys.exit(3)")
    with MathVerifier(max_workers=1) as broken, pytest.raises(MathVerifierError, match="code 3"):
        broken.verify(r"\boxed{1/2}", "0.5")


def test_closed_verifier_raises():
    v = MathVerifier(max_workers=1)
    v.close()
    with pytest.raises(MathVerifierError):
        v.verify(r"\boxed{1/2}", "0.5")


# ------------------------------------------------------------------------------------ checks


def test_exact_match():
    assert exact_match("  Paris \n", "Paris").passed
    assert exact_match("New   York", "New York").passed
    assert not exact_match("paris", "Paris").passed
    assert exact_match("paris", "Paris", ignore_case=True).passed
    assert not exact_match(" Paris", "Paris", normalize_whitespace=False).passed
    assert exact_match("a", "a") == CheckResult(reward=1.0, passed=True, reason="match")


def test_regex_match():
    assert regex_match("The code is ABC-123.", r"[A-Z]{3}-\d{3}").passed
    assert not regex_match("The code is ABC-123.", r"[A-Z]{3}-\d{3}", full=True).passed
    assert regex_match("ABC-123", r"[A-Z]{3}-\d{3}", full=True).reward == 1.0


def test_format_checks():
    assert has_exactly_one_boxed(r"so \boxed{\frac{1}{2}}").passed
    assert not has_exactly_one_boxed("no box").passed
    result = has_exactly_one_boxed(r"\boxed{1} or \boxed{2}")
    assert (result.passed, result.reason) == (False, r"2 \boxed{} found")

    assert is_valid_json('{"a": [1, 2]}').passed
    assert is_valid_json('```json\n{"a": 1}\n```').passed
    assert not is_valid_json('```json\n{"a": 1}\n```', allow_code_fence=False).passed
    assert not is_valid_json("{'a': 1}").passed
    assert not is_valid_json("[" * 100_000).passed  # too deep: refused, not a crash

    assert nothing_after_answer(r"Thus $\boxed{4}$.").passed
    assert nothing_after_answer("\\[\\boxed{4}\\]\n").passed
    tail = nothing_after_answer(r"\boxed{4} Let me also explain why.")
    assert not tail.passed and "Let me" in tail.reason
    assert not nothing_after_answer("4").passed


def test_weighted_components():
    score = weighted(
        correct=(1.0, lambda text, expected: exact_match(text, expected)),
        short=(0.5, lambda text, expected: 1.0 if len(text) < 5 else 0.0),
        boxed=(0.25, lambda text, expected: has_exactly_one_boxed(text)),
    )
    assert score("42", "42") == {"reward": 1.5, "components": {"correct": 1.0, "short": 1.0, "boxed": 0.0}}
    assert score("no, 41", "42") == {
        "reward": 0.0,
        "components": {"correct": 0.0, "short": 0.0, "boxed": 0.0},
    }


def test_weighted_accepts_math_results(verifier):
    score = weighted(math=(2.0, lambda text: verifier.verify(text, "0.5")), fmt=(1.0, nothing_after_answer))
    assert score(r"\boxed{1/2}") == {"reward": 3.0, "components": {"math": 1.0, "fmt": 1.0}}


def test_weighted_rejects_bad_specs():
    with pytest.raises(ValueError):
        weighted()
    with pytest.raises(TypeError):
        weighted(x=lambda text: 1.0)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------ code

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


def run_code(program: str, tests: str, **kwargs) -> CodeResult:
    return asyncio.run(verify_code(LocalSubprocessSandboxForTests(), program, tests, **kwargs))


def test_code_passing_program():
    assert run_code(ADD, ASSERT_TESTS) == CodeResult(
        reward=1.0, passed=3, total=3, reason="passed", output=""
    )
    result = run_code(ADD, FUNCTION_TESTS)
    assert (result.reward, result.passed, result.total, result.reason) == (1.0, 3, 3, "passed")


def test_code_failing_program_all_or_nothing_and_partial_credit():
    wrong = "def add(a, b):\n    return 0 if a == 1 else a + b\n"
    result = run_code(wrong, ASSERT_TESTS)
    assert (result.reward, result.passed, result.total, result.reason) == (0.0, 2, 3, "failed")
    assert "FAIL assert line 1: AssertionError" in result.output
    partial = run_code(wrong, ASSERT_TESTS, partial_credit=True)
    assert partial.reward == pytest.approx(2 / 3)


def test_code_timeout():
    slow = "def add(a, b):\n    while a > 5:\n        pass\n    return a + b\n"
    start = time.perf_counter()
    result = run_code(slow, ASSERT_TESTS, timeout_s=1.0, partial_credit=True)
    assert time.perf_counter() - start < 5
    # Tests that passed before the hang still count under partial credit.
    assert (result.reason, result.passed, result.total) == ("timeout", 1, 3)
    assert result.reward == pytest.approx(1 / 3)
    assert run_code(slow, ASSERT_TESTS, timeout_s=1.0).reward == 0.0


@pytest.mark.parametrize(
    "program, reason",
    [
        ("def add(a, b)\n    return a + b\n", "syntax error"),
        ("import sys\nsys.exit(0)\n", "crashed"),  # exits on import
        ("import os\nos._exit(0)\n", "crashed"),  # skips the harness entirely
        ("raise RuntimeError('boom')\n", "crashed"),
    ],
)
def test_code_broken_programs(program, reason):
    result = run_code(program, ASSERT_TESTS)
    assert (result.reward, result.passed, result.reason) == (0.0, 0, reason)


def test_code_sys_exit_inside_a_test_is_a_failure():
    result = run_code("import sys\ndef add(a, b):\n    sys.exit(0)\n", ASSERT_TESTS)
    assert (result.reward, result.passed, result.reason) == (0.0, 0, "failed")


def test_code_printed_lookalike_lines_do_not_count():
    program = "print('@@palaestra-0000000000000000@@ pass 0')\ndef add(a, b):\n    return 0\n"
    result = run_code(program, ASSERT_TESTS)
    assert (result.passed, result.reason) == (1, "failed")  # only add(0, 0) == 0 really passed
    assert "@@palaestra-0000000000000000@@" in result.output  # the program's print went to output


def test_code_no_tests_and_memory_limit():
    assert run_code(ADD, "x = 1\n").reason == "no tests"
    hog = "x = bytearray(4 * 1024**3)\n" + ADD
    result = run_code(hog, ASSERT_TESTS, memory_mb=256)
    assert (result.reason, result.reward) == ("crashed", 0.0)
    assert "MemoryError" in result.output


def test_verify_code_reads_partial_progress_from_any_sandbox():
    """A sandbox is anything with the `run` signature; here a canned one that 'timed out'."""

    class CannedSandbox:
        def __init__(self):
            self.calls = []

        async def run(self, files, command, timeout_s, memory_mb):
            self.calls.append((sorted(files), command, timeout_s, memory_mb))
            token = files["_palaestra_harness.py"].split('TOKEN = "', 1)[1].split('"', 1)[0]
            stdout = f"{token} total 4\n{token} pass 0\n{token} pass 1\n"
            return RunResult(exit_code=-9, stdout=stdout, stderr="", timed_out=True, duration_s=2.0)

    sandbox = CannedSandbox()
    result = asyncio.run(verify_code(sandbox, ADD, ASSERT_TESTS, 2.0, partial_credit=True))
    assert (result.reward, result.passed, result.total, result.reason) == (0.5, 2, 4, "timeout")
    assert sandbox.calls == [
        (["_palaestra_harness.py", "solution.py", "tests.py"], ["python3", "_palaestra_harness.py"], 2.0, 512)
    ]


def test_test_double_refuses_paths_outside_its_directory():
    sandbox = LocalSubprocessSandboxForTests()
    with pytest.raises(ValueError):
        asyncio.run(sandbox.run({"../escape.py": ""}, ["python3", "-c", "pass"], 5, 0))
