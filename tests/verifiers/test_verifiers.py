"""Verifiers: math answers (extraction, equivalence decisions, timeouts), checks and their
composition (code tests: tests/verifiers/test_code_grader.py)."""

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
from palaestra.verifiers.math import (
    MathVerifier,
    MathVerifierError,
    averify_math,
    extract_answer,
    normalize_answer,
    verify_math,
)


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
        (r"\boxed{@@ ?? @@}", "unparseable"),  # no math in it at all (not a wrong number)
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
