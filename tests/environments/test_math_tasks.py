"""The math environment's tasks (generator, GSM8K loader) and its calculator tool.

Generated answers are checked by independent computation: the expression is read back from the
question text and evaluated here, and each word-problem template has its own solver below that
works from the numbers in the story."""

from __future__ import annotations

import ast
import json
import random
import re
import string
import time
from fractions import Fraction

import pytest

from palaestra.environments.math.calculator import CALCULATOR_TOOL, calculate, run_calculator_tool
from palaestra.environments.math.tasks import (
    KINDS,
    MathTask,
    TaskFileError,
    generate_task,
    generate_tasks,
    iter_tasks,
    load_gsm8k_jsonl,
)

DIFFICULTIES = range(1, 6)

# ------------------------------------------------------------------------------------ reproducibility


def test_generation_is_reproducible():
    for difficulty in DIFFICULTIES:
        assert generate_tasks(30, seed=7, difficulty=difficulty) == generate_tasks(
            30, seed=7, difficulty=difficulty
        )
    assert generate_tasks(30, seed=7) != generate_tasks(30, seed=8)


def test_pinned_task():
    """Guards against silent changes to the stream (which would change every seeded run)."""
    assert generate_task(0, 0, 1, "arithmetic") == MathTask(
        task_id="arithmetic-d1-s0-0",
        question="Evaluate 23 + 58.",
        answer="81",
        difficulty=1,
        kind="arithmetic",
    )


def test_prefixes_iterator_and_task_ids():
    short, long = generate_tasks(10, seed=3, difficulty=2), generate_tasks(25, seed=3, difficulty=2)
    assert long[:10] == short
    stream = iter_tasks(seed=3, difficulty=2)
    assert [next(stream) for _ in range(25)] == long
    assert [t.kind for t in long[:6]] == list(KINDS) * 2
    assert [t.task_id for t in long[:3]] == ["arithmetic-d2-s3-0", "word_problem-d2-s3-1", "fraction-d2-s3-2"]
    assert len({t.task_id for t in generate_tasks(300, seed=3, difficulty=2)}) == 300
    # A task depends only on (seed, index, kind, difficulty).
    assert generate_task(3, 4, 2, "word_problem") == long[4]
    only_fractions = generate_tasks(5, seed=3, difficulty=2, kinds=["fraction"])
    assert all(t.kind == "fraction" for t in only_fractions)


def test_difficulty_zero_is_single_digit_arithmetic_only():
    tasks = generate_tasks(400, seed=5, difficulty=0, kinds=["arithmetic"])
    problems = set()
    for t in tasks:
        x, op, y = t.question.rstrip("?.").split()[-3:]
        assert 0 <= int(x) <= 9 and 0 <= int(y) <= 9 and op in "+-"
        assert int(t.answer) == (int(x) + int(y) if op == "+" else int(x) - int(y))
        problems.add((x, op, y))
    assert len(problems) > 150  # of the 200 possible problems
    with pytest.raises(ValueError, match="0 exists only for arithmetic"):
        generate_tasks(2, seed=0, difficulty=0)  # the second task would be a word problem


def test_bad_arguments():
    with pytest.raises(ValueError):
        generate_tasks(1, seed=0, difficulty=-1)
    with pytest.raises(ValueError):
        generate_tasks(1, seed=0, difficulty=6)
    with pytest.raises(ValueError):
        generate_tasks(1, seed=0, kinds=["geometry"])
    with pytest.raises(ValueError):
        generate_tasks(1, seed=0, kinds=[])


# ------------------------------------------------------------------------------------ independent answers


def evaluate_text(expression: str) -> Fraction:
    """Our own evaluator for the question text: Python's grammar, exact rationals."""

    def ev(node: ast.AST) -> Fraction:
        match node:
            case ast.Expression(body=body):
                return ev(body)
            case ast.Constant(value=int() as v):
                return Fraction(v)
            case ast.UnaryOp(op=ast.USub(), operand=x):
                return -ev(x)
            case ast.BinOp(left=a, op=ast.Add(), right=b):
                return ev(a) + ev(b)
            case ast.BinOp(left=a, op=ast.Sub(), right=b):
                return ev(a) - ev(b)
            case ast.BinOp(left=a, op=ast.Mult(), right=b):
                return ev(a) * ev(b)
            case ast.BinOp(left=a, op=ast.Div(), right=b):
                return ev(a) / ev(b)
        raise AssertionError(f"unexpected syntax in a generated question: {ast.dump(node)}")

    return ev(ast.parse(expression, mode="eval"))


def many(kind: str, difficulty: int, n: int = 60) -> list[MathTask]:
    return [t for seed in range(3) for t in generate_tasks(n, seed=seed, difficulty=difficulty, kinds=[kind])]


@pytest.mark.parametrize("difficulty", DIFFICULTIES)
def test_arithmetic_answers(difficulty):
    for task in many("arithmetic", difficulty):
        m = re.fullmatch(r"(?:What is|Compute|Evaluate|Calculate) (.+?)[?.]", task.question)
        assert m, task.question
        tree = ast.parse(m.group(1), mode="eval")
        operators = [n for n in ast.walk(tree) if isinstance(n, ast.BinOp)]
        assert len(operators) == difficulty, task.question
        if difficulty == 1:
            assert all(isinstance(n.op, ast.Add | ast.Sub) for n in operators)
        value = evaluate_text(m.group(1))
        assert value.denominator == 1, task  # arithmetic answers are whole numbers
        assert task.answer == str(value.numerator), task


@pytest.mark.parametrize("difficulty", DIFFICULTIES)
def test_fraction_answers_are_correct_and_reduced(difficulty):
    for task in many("fraction", difficulty):
        m = re.fullmatch(r"Compute (.+)\. Give the answer as a fraction in lowest terms\.", task.question)
        assert m, task.question
        value = evaluate_text(m.group(1))
        assert Fraction(task.answer) == value, task
        assert task.answer == str(value)  # str(Fraction) is the reduced "a/b" (or "n")
        assert re.fullmatch(r"-?\d+(/\d+)?", task.answer)


# One solver per template, from the story's own numbers.
WORD_SOLVERS = [
    (r"buys (\d+) \w+ that cost \$(\d+) each and pays with \$(\d+)\.", lambda n, p, bill: bill - n * p),
    (r"is (\d+) years old\. \w+ is (\d+) times as old as \w+\. How old will \w+ be in (\d+) years\?",
     lambda age, k, years: age * k + years),
    (r"has (\d+) \w+\. \w+ gives (\d+) of them to \w+, then buys (\d+) packs with (\d+) \w+ in each\.",
     lambda have, give, packs, each: have - give + packs * each),
    (r"makes (\d+) \w+ every hour\. It runs for (\d+) hours a day for (\d+) days\. (\d+) of the \w+ are faulty\.",
     lambda rate, hours, days, faulty: rate * hours * days - faulty),
    (r"bakes (\d+) trays of \w+ with (\d+) on each tray\. \w+ keeps (\d+) and shares the rest equally among "
     r"(\d+) friends\.", lambda trays, per, keep, friends: Fraction(trays * per - keep, friends)),
    (r"costs \$(\d+)\. This week it is (\d+)% off\. \w+ buys (\d+) of them\.",
     lambda price, off, n: Fraction(n * price * (100 - off), 100)),
    (r"drives at (\d+) km per hour for (\d+) hours, then at (\d+) km per hour for (\d+) hours\.",
     lambda v, t1, u, t2: v * t1 + u * t2),
    (r"saves \$(\d+) every week for (\d+) weeks\. Then \w+ spends \$(\d+) on a \w+ and earns \$(\d+) from",
     lambda weekly, weeks, spend, earn: weekly * weeks - spend + earn),
]  # fmt: skip


@pytest.mark.parametrize("difficulty", DIFFICULTIES)
def test_word_problem_answers(difficulty):
    used = set()
    for task in many("word_problem", difficulty):
        story = re.sub(r"^\(\w+'s favourite number is \d+\.\) ", "", task.question)
        assert (story != task.question) == (difficulty >= 4)  # the distractor, from difficulty 4
        matches = [(i, m) for i, (pattern, _) in enumerate(WORD_SOLVERS) if (m := re.search(pattern, story))]
        assert len(matches) == 1, task.question
        i, m = matches[0]
        used.add(i)
        expected = WORD_SOLVERS[i][1](*map(int, m.groups()))
        assert Fraction(expected).denominator == 1 and expected > 0, task
        assert task.answer == str(int(expected)), task
    # Difficulty 1 uses only the two-step templates, 2 up to three steps (not savings), 3+ all of them.
    assert used == {1: {0, 1}, 2: set(range(7))}.get(difficulty, set(range(len(WORD_SOLVERS))))


def test_generated_answers_pass_the_math_verifier():
    from palaestra.verifiers.math import verify_math

    fraction = next(
        t for t in generate_tasks(20, seed=1, difficulty=3, kinds=["fraction"]) if "/" in t.answer
    )
    num, den = fraction.answer.lstrip("-").split("/")
    sign = "-" if fraction.answer.startswith("-") else ""
    assert verify_math(rf"so \boxed{{{sign}\frac{{{num}}}{{{den}}}}}", fraction.answer).correct
    word = generate_tasks(2, seed=1, difficulty=2)[1]
    assert verify_math(f"The answer is {int(word.answer):,}.", word.answer).correct


# ------------------------------------------------------------------------------------ GSM8K loader


def write_jsonl(path, lines):
    path.write_text("\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines) + "\n")
    return path


def test_gsm8k_loader(tmp_path):
    path = write_jsonl(
        tmp_path / "train.jsonl",
        [
            {"question": "Tom has 3 apples and buys 4. How many?", "answer": "3 + 4 = <<3+4=7>>7\n#### 7"},
            "",
            {"question": " A big one? ", "answer": "It costs 1,000 + 234 = 1,234 dollars.\n#### 1,234"},
            {"question": "Owed?", "answer": "#### -5", "id": "q-17"},
            {"question": "Price?", "answer": "#### $12.50"},
        ],
    )
    tasks = load_gsm8k_jsonl(path)
    assert [(t.task_id, t.answer) for t in tasks] == [
        ("gsm8k-train-1", "7"),
        ("gsm8k-train-3", "1234"),
        ("q-17", "-5"),
        ("gsm8k-train-5", "12.50"),
    ]
    assert tasks[1].question == "A big one?"
    assert {(t.kind, t.difficulty) for t in tasks} == {("gsm8k", 0)}


@pytest.mark.parametrize(
    "bad_line, message",
    [
        ('{"question": "Q", "answer": "#### 1"', "not valid JSON"),
        ('["question", "answer"]', "expected a JSON object"),
        ('{"answer": "#### 1"}', "'question'"),
        ('{"question": "Q"}', "'answer'"),
        ('{"question": "Q", "answer": "the rationale only, 42"}', "no '#### N'"),
        ('{"question": "Q", "answer": "####   "}', "no '#### N'"),
    ],
)
def test_gsm8k_loader_errors_name_the_line(tmp_path, bad_line, message):
    path = write_jsonl(tmp_path / "bad.jsonl", [{"question": "Q", "answer": "#### 1"}, "", bad_line])
    with pytest.raises(TaskFileError) as err:
        load_gsm8k_jsonl(path)
    assert f"{path}:3:" in str(err.value)
    assert message in str(err.value)


# ------------------------------------------------------------------------------------ calculator


@pytest.mark.parametrize(
    "expression, result",
    [
        ("2 + 3 * 4", "14"),
        ("(2 + 3) * 4", "20"),
        ("-3 - -2", "-1"),
        ("0.1 + 0.2", "0.3"),  # exact, not 0.30000000000000004
        ("1/3 + 1/6", "0.5"),
        ("1/3 + 1/3", "2/3 (about 0.666666666667)"),
        ("7 / 2", "3.5"),
        ("2 ** 10", "1024"),
        ("2^10", "1024"),
        ("3 × 4 − 10 ÷ 4", "9.5"),
        ("1,000 * 3", "3000"),
        ("sqrt(144) + sqrt(1/4)", "12.5"),
        ("sqrt(2)", "1.41421356237"),
        ("(-2) ** 3", "-8"),
        ("4 ** 0.5", "2"),
        ("1.5e3", "1500"),
    ],
)
def test_calculator_values(expression, result):
    assert calculate(expression) == result


@pytest.mark.parametrize(
    "expression, error",
    [
        ("__import__('os')", 'error: unexpected character "\'"'),
        ("__import__(os).system", "error: unsupported expression: Attribute"),
        ("__import__(os)", "error: unsupported expression: function call"),
        ("eval(1)", "error: unsupported expression: function call"),
        ("().__class__.__bases__[0].__subclasses__()", "error: unexpected character '['"),
        ("().__class__.__subclasses__()", "error: unsupported expression: function call"),
        ("(1).__class__", "error: unsupported expression: Attribute"),
        ("os", "error: unknown name 'os'"),
        ("open(passwd).read()", "error: unsupported expression: function call"),
        ("lambda: 1", "error: unexpected character ':'"),
        ("lambda x=1 : x", "error: unexpected character '='"),
        ("[x for x in range(10**9)]", "error: unexpected character '['"),
        ("(x for x in range(10**9))", "error: unsupported expression: GeneratorExp"),
        ("'a' * 10", 'error: unexpected character "\'"'),
        ("True", "error: unsupported value True"),
        ("1 if 2 else 3", "error: unsupported expression: IfExp"),
        ("1/0", "error: division by zero"),
        ("0 ** -1", "error: division by zero"),
        ("9 ** 9 ** 9", "error: exponent too large (limit 1000)"),
        ("2 ** 100000", "error: exponent too large (limit 1000)"),
        ("10 ** 10 ** 10", "error: exponent too large (limit 1000)"),
        ("999 ** 999", "error: result too large"),
        ("(10 ** 60) * (10 ** 60)", "error: result too large"),
        ("1e308 * 10", "error: result too large"),
        ("sqrt(-4)", "error: square root of a negative number"),
        ("(-8) ** (1/3)", "error: fractional power of a negative number"),
        ("7 % 3", "error: '%' is not supported (write 20% as 0.2 or 20/100)"),
        ("7 // 3", "error: operator // is not supported"),
        ("1 +", "error: could not parse the expression"),
        ("", "error: empty expression"),
        ("1 + " * 200 + "1", "error: expression too long (limit 500 characters)"),
        ("(" * 100 + "1" + ")" * 100, "error: too many nested parentheses (limit 40)"),
        ("-" * 400 + "1", "error: expression too long"),
    ],
)
def test_calculator_refuses(expression, error):
    assert calculate(expression) == error


def test_calculator_never_raises_and_is_fast():
    rng = random.Random(0)
    alphabet = string.digits + "+-*/^().e ,_" + "abcxyz'\"[]{}:;=<>!~@%&|\\" + "×÷−√"
    start = time.perf_counter()
    for _ in range(2000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 60)))
        assert isinstance(calculate(text), str)
    assert time.perf_counter() - start < 5


def test_calculator_tool_call_and_schema():
    assert run_calculator_tool('{"expression": "6 * 7"}') == "42"
    assert run_calculator_tool({"expression": "6 * 7"}) == "42"
    assert run_calculator_tool("not json").startswith("error: arguments must be JSON")
    assert run_calculator_tool('{"expr": "1"}').startswith("error: arguments must be JSON")
    assert run_calculator_tool('{"expression": 5}').startswith("error: arguments must be JSON")
    assert json.loads(json.dumps(CALCULATOR_TOOL)) == CALCULATOR_TOOL
    function = CALCULATOR_TOOL["function"]
    assert CALCULATOR_TOOL["type"] == "function" and function["name"] == "calculator"
    assert function["parameters"]["required"] == ["expression"]
    assert function["parameters"]["properties"]["expression"]["type"] == "string"


# -- worked steps --------------------------------------------------------------------------------
def test_worked_steps_solutions_are_correct_line_by_line():
    from palaestra.verifiers.math import verify_math

    for difficulty in (0, 1, 3, 5):
        for t in generate_tasks(60, seed=2, difficulty=difficulty, kinds=["worked_steps"]):
            *lines, boxed = t.solution.split("\n")
            assert boxed == f"\\boxed{{{t.answer}}}" and verify_math(t.solution, t.answer).correct
            assert len(lines) == (3 if difficulty <= 1 else difficulty + 2), t
            value = int(t.question.split(",")[0].removeprefix("Start with "))
            for line in lines:  # each line starts from the previous result and is arithmetic truth
                lhs, rhs = line.split("=")
                op = next(c for c in "+-*" if c in lhs[1:])
                a, b = lhs.split(op, 1)
                assert int(a) == value
                value = eval(f"{a}{op}{b}")  # noqa: S307 - our own digits and operators
                assert value == int(rhs) and 0 <= value <= 99
            assert str(value) == t.answer


def test_worked_steps_are_long_answers_and_opt_in():
    tasks = generate_tasks(50, seed=0, difficulty=0, kinds=["worked_steps"])
    assert min(len(t.solution) for t in tasks) >= 24  # ≥ 15 tokens with any tokenizer here
    assert len({t.question for t in tasks}) == 50
    assert "worked_steps" not in KINDS  # the default streams are unchanged
    assert all(t.solution == "" for t in generate_tasks(6, seed=0))
