"""Math tasks: a seeded procedural generator and a loader for GSM8K-format JSONL files.

    >>> generate_tasks(2, seed=0, difficulty=1)[0].question
    'Evaluate 23 + 58.'

Three kinds, cycled by index (``kinds[index % len(kinds)]``):

- ``arithmetic``: an expression tree over integers, rendered with only the parentheses it needs;
  the answer is always an integer (a product has one small factor, a quotient divides exactly).
  Difficulty 1-5 sets the number of operators (1-5), the operand size (up to 2, 2, 3, 3, 4 digits),
  the operators (``+ -``; then ``*``; from 3 on ``/``), factors up to 9 (19 from 4 on) and, from 4
  on, negative operands. Difficulty 0 (arithmetic only) is one ``+`` or ``-`` between two digits
  0-9: 200 problems in four phrasings, small enough for a 4M-parameter model to learn on a CPU in
  two minutes (the demo's distribution, `palaestra.environments.math.warmstart`).
- ``word_problem``: eight templates of 2-4 steps (shopping change, packs, a factory, sharing,
  savings, a discount, a trip, ages) with names, objects and quantities drawn at random; every
  answer is an integer. Difficulty raises the magnitudes, admits the longer templates (1: two
  steps, 2: up to three, 3+: all) and from 4 on adds an irrelevant number to the story.
- ``fraction``: sums, differences, products and quotients of 2-4 fractions; the answer is a
  reduced fraction string (``"7/12"``, ``"-3/4"``, or ``"2"`` when it is whole).
- ``worked_steps`` (not in the default `KINDS`; ask for it): "Start with 7, add 5, multiply by 3,
  subtract 9. Show each step." with a worked `MathTask.solution` of one line per step
  (``7+5=12`` / ``12*3=36`` / ``36-9=27`` / ``\\boxed{27}``: 20+ tokens). The reward only checks
  the final answer, so a per-answer reward cannot say which line went wrong; a teacher's per-token
  logprobs can — the task where on-policy distillation has something to add over GRPO.

Every task is drawn from its own ``random.Random`` seeded with (seed, index, kind, difficulty), so
task ``i`` does not depend on how many tasks were asked for, ``generate_tasks(n)`` is a prefix of
``generate_tasks(n + k)`` and of `iter_tasks`, and ``task_id`` (``"arithmetic-d2-s7-15"``) names
the task exactly. String seeds are hashed with SHA-512 by `random`, so this holds across runs and
machines regardless of ``PYTHONHASHSEED``.

`load_gsm8k_jsonl` reads a file you supply (one ``{"question": ..., "answer": "...#### 42"}`` per
line); nothing is downloaded.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from fractions import Fraction
from itertools import count
from pathlib import Path

__all__ = [
    "KINDS",
    "MAX_DIFFICULTY",
    "MathTask",
    "TaskFileError",
    "generate_task",
    "generate_tasks",
    "iter_tasks",
    "load_gsm8k_jsonl",
]

KINDS: tuple[str, ...] = ("arithmetic", "word_problem", "fraction")
MAX_DIFFICULTY = 5


@dataclass(frozen=True)
class MathTask:
    task_id: str
    question: str
    answer: str
    """The reference answer: an integer, a decimal or a reduced fraction ``"a/b"``."""
    difficulty: int
    """1-5 for generated tasks (0: single-digit arithmetic, or a loaded task)."""
    kind: str
    """``arithmetic``, ``word_problem``, ``fraction``, ``worked_steps`` or ``gsm8k``."""
    solution: str = ""
    """A worked solution in the answer format the verifier accepts (``worked_steps`` tasks: one
    line per step, then ``\\boxed{answer}``); empty for the other kinds."""


def format_fraction(value: Fraction) -> str:
    """``"3"``, ``"-7/12"``: the reduced form, sign on the numerator."""
    return str(value.numerator) if value.denominator == 1 else f"{value.numerator}/{value.denominator}"


# ------------------------------------------------------------------------------------ arithmetic

# A node is an int leaf or (op, left, right).
Node = int | tuple[str, "Node", "Node"]
_PRECEDENCE = {"+": 1, "-": 1, "*": 2, "/": 2}


def _evaluate(node: Node) -> Fraction:
    if isinstance(node, int):
        return Fraction(node)
    op, left, right = node
    a, b = _evaluate(left), _evaluate(right)
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    if op == "*":
        return a * b
    return a / b


def _render(node: Node) -> str:
    """Infix text with the parentheses standard precedence needs, and negative numbers in parens."""
    if isinstance(node, int):
        return f"({node})" if node < 0 else str(node)
    op, left, right = node
    left_text, right_text = _render(left), _render(right)
    if not isinstance(left, int) and _PRECEDENCE[left[0]] < _PRECEDENCE[op]:
        left_text = f"({left_text})"
    if not isinstance(right, int) and (
        _PRECEDENCE[right[0]] < _PRECEDENCE[op] or (_PRECEDENCE[right[0]] == _PRECEDENCE[op] and op in "-/")
    ):
        right_text = f"({right_text})"
    return f"{left_text} {op} {right_text}"


_QUESTIONS = ("What is {}?", "Compute {}.", "Evaluate {}.", "Calculate {}.")


def _arithmetic(rng: random.Random, difficulty: int) -> tuple[str, str]:
    if difficulty == 0:
        x, y, op = rng.randint(0, 9), rng.randint(0, 9), rng.choice("+-")
        return rng.choice(_QUESTIONS).format(f"{x} {op} {y}"), str(x + y if op == "+" else x - y)
    n_ops = difficulty
    digits = (2, 2, 3, 3, 4)[difficulty - 1]
    small = 9 if difficulty <= 3 else 19  # the largest factor or divisor
    ops = ("+", "-") if difficulty == 1 else ("+", "-", "*") if difficulty == 2 else ("+", "-", "*", "/")
    negatives = difficulty >= 4

    def leaf() -> int:
        value = rng.randint(1, 10**digits - 1)
        return -value if negatives and rng.random() < 0.2 else value

    def build(n: int) -> Node:
        """A tree with ``n`` operators whose value is an integer: a product has one small factor,
        a quotient a small divisor that divides its dividend exactly."""
        if n == 0:
            return leaf()
        op = rng.choice(ops)
        if op == "*":
            factor, rest = rng.randint(2, small), build(n - 1)
            return ("*", rest, factor) if rng.random() < 0.5 else ("*", factor, rest)
        if op == "/":
            dividend = build(n - 1)
            value = _evaluate(dividend)
            divisors = [d for d in range(2, small + 1) if value % d == 0]
            if divisors:
                return ("/", dividend, rng.choice(divisors))
            return (rng.choice(("+", "-")), dividend, leaf())
        k = rng.randint(0, n - 1)
        return (op, build(k), build(n - 1 - k))

    tree = build(n_ops)
    expression = _render(tree)
    question = rng.choice(_QUESTIONS).format(expression)
    return question, format_fraction(_evaluate(tree))


# ------------------------------------------------------------------------------------ fractions


def _fraction(rng: random.Random, difficulty: int) -> tuple[str, str]:
    n_terms = (2, 2, 3, 3, 4)[difficulty - 1]
    max_den = (6, 10, 12, 16, 20)[difficulty - 1]
    ops = (
        ("+",)
        if difficulty == 1
        else ("+", "-")
        if difficulty == 2
        else ("+", "-", "*")
        if difficulty == 3
        else ("+", "-", "*", "/")
    )

    def term() -> tuple[int, int]:
        den = rng.randint(2, max_den)
        while True:
            num = rng.randint(1, den - 1) if difficulty <= 2 else rng.randint(1, 2 * den)
            if num % den:  # not a whole number in disguise, like 11/11
                return num, den

    terms = [term() for _ in range(n_terms)]
    chosen = [rng.choice(ops) for _ in range(n_terms - 1)]
    # Every fraction in parentheses, so "a/b" always reads as one number under standard precedence.
    parts = [f"({terms[0][0]}/{terms[0][1]})"]
    for op, (num, den) in zip(chosen, terms[1:], strict=True):
        parts.append(f"{op} ({num}/{den})")
    expression = " ".join(parts)
    # Standard precedence: * and / bind to the running product, + and - start a new summand.
    values = [Fraction(num, den) for num, den in terms]
    sums: list[Fraction] = [values[0]]
    signs: list[str] = []
    for op, value in zip(chosen, values[1:], strict=True):
        if op == "*":
            sums[-1] *= value
        elif op == "/":
            sums[-1] /= value  # never zero: every numerator is >= 1
        else:
            signs.append(op)
            sums.append(value)
    total = sums[0]
    for op, value in zip(signs, sums[1:], strict=True):
        total = total + value if op == "+" else total - value
    question = f"Compute {expression}. Give the answer as a fraction in lowest terms."
    return question, format_fraction(total)


# ------------------------------------------------------------------------------------ word problems

_PEOPLE = [(name, "she") for name in ("Ava", "Maya", "Zara", "Lena", "Priya", "Chloe", "Ingrid", "Amara")] + [
    (name, "he") for name in ("Liam", "Noah", "Omar", "Kenji", "Mateo", "Tariq", "Diego", "Felix")
]
_OBJECTS = ["marbles", "stickers", "pencils", "stamps", "cards", "shells", "beads", "erasers"]
_ITEMS = ["notebooks", "pens", "apples", "tickets", "mugs"]
_FOODS = ["cookies", "muffins", "rolls", "brownies"]
_WIDGETS = ["bolts", "toys", "bottles", "bricks"]
_THINGS = ["bike", "game", "jacket", "lamp", "backpack"]
_JOBS = ["babysitting", "mowing lawns", "walking dogs", "tutoring"]


@dataclass(frozen=True)
class _Story:
    name: str
    pronoun: str
    friend: str
    scale: int  # 1, 2, 3, 5, 10 for difficulty 1..5

    @property
    def cap_pronoun(self) -> str:
        return self.pronoun.capitalize()


def _change(rng: random.Random, s: _Story) -> tuple[str, int]:
    items = rng.choice(_ITEMS)
    n, price = rng.randint(2, 4 + s.scale), rng.randint(2, 6 * s.scale)
    step = 10 if s.scale < 3 else 50
    bill = (n * price // step + 1) * step
    q = (
        f"{s.name} buys {n} {items} that cost ${price} each and pays with ${bill}. "
        f"How much change, in dollars, does {s.name} get back?"
    )
    return q, bill - n * price


def _ages(rng: random.Random, s: _Story) -> tuple[str, int]:
    age, times, years = rng.randint(2, 8 + s.scale), rng.randint(2, 4), rng.randint(1, 5 * s.scale)
    q = (
        f"{s.name} is {age} years old. {s.friend} is {times} times as old as {s.name}. "
        f"How old will {s.friend} be in {years} years?"
    )
    return q, age * times + years


def _packs(rng: random.Random, s: _Story) -> tuple[str, int]:
    obj = rng.choice(_OBJECTS)
    have = rng.randint(10, 40 * s.scale)
    give = rng.randint(1, have - 1)
    packs, per_pack = rng.randint(2, 3 + s.scale), rng.randint(3, 6 * s.scale)
    q = (
        f"{s.name} has {have} {obj}. {s.cap_pronoun} gives {give} of them to {s.friend}, then buys {packs} packs "
        f"with {per_pack} {obj} in each. How many {obj} does {s.name} have now?"
    )
    return q, have - give + packs * per_pack


def _factory(rng: random.Random, s: _Story) -> tuple[str, int]:
    widgets = rng.choice(_WIDGETS)
    rate, hours, days = rng.randint(5, 20 * s.scale), rng.randint(2, 10), rng.randint(2, 3 + s.scale)
    faulty = rng.randint(1, rate * hours * days // 4)
    q = (
        f"A machine makes {rate} {widgets} every hour. It runs for {hours} hours a day for {days} days. "
        f"{faulty} of the {widgets} are faulty. How many {widgets} are not faulty?"
    )
    return q, rate * hours * days - faulty


def _share(rng: random.Random, s: _Story) -> tuple[str, int]:
    food = rng.choice(_FOODS)
    friends, each = rng.randint(2, 4 + s.scale), rng.randint(2, 5 * s.scale)
    keep = rng.randint(1, 6 * s.scale)
    per_tray_options = [c for c in range(4, 25) if (friends * each + keep) % c == 0]
    if not per_tray_options:  # make the total a multiple of some tray size by keeping a few more
        keep += (-(friends * each + keep)) % 6
        per_tray_options = [6]
    per_tray = rng.choice(per_tray_options)
    trays = (friends * each + keep) // per_tray
    q = (
        f"{s.name} bakes {trays} trays of {food} with {per_tray} on each tray. {s.cap_pronoun} keeps {keep} and "
        f"shares the rest equally among {friends} friends. How many {food} does each friend get?"
    )
    return q, each


def _savings(rng: random.Random, s: _Story) -> tuple[str, int]:
    thing, job = rng.choice(_THINGS), rng.choice(_JOBS)
    weekly, weeks = rng.randint(3, 15 * s.scale), rng.randint(3, 8 + s.scale)
    spend = rng.randint(1, weekly * weeks - 1)
    earn = rng.randint(5, 30 * s.scale)
    q = (
        f"{s.name} saves ${weekly} every week for {weeks} weeks. Then {s.pronoun} spends ${spend} on a {thing} "
        f"and earns ${earn} from {job}. How many dollars does {s.name} have now?"
    )
    return q, weekly * weeks - spend + earn


def _discount(rng: random.Random, s: _Story) -> tuple[str, int]:
    thing = rng.choice(_THINGS)
    price = 20 * rng.randint(1, 5 * s.scale)  # a multiple of 20 and a multiple-of-5 percentage: whole dollars
    off = 5 * rng.randint(1, 15)
    n = rng.randint(2, 3 + s.scale)
    q = (
        f"A {thing} normally costs ${price}. This week it is {off}% off. {s.name} buys {n} of them. "
        f"How many dollars does {s.name} pay?"
    )
    return q, n * price * (100 - off) // 100


def _trip(rng: random.Random, s: _Story) -> tuple[str, int]:
    v, t1 = rng.randint(30, 60 + 10 * s.scale), rng.randint(2, 3 + s.scale)
    u, t2 = rng.randint(20, 50 + 10 * s.scale), rng.randint(2, 3 + s.scale)
    q = (
        f"{s.name} drives at {v} km per hour for {t1} hours, then at {u} km per hour for {t2} hours. "
        f"How many kilometres does {s.name} drive in total?"
    )
    return q, v * t1 + u * t2


# (template, number of steps)
_TEMPLATES: list[tuple[Callable[[random.Random, _Story], tuple[str, int]], int]] = [
    (_change, 2),
    (_ages, 2),
    (_packs, 3),
    (_factory, 3),
    (_share, 3),
    (_discount, 3),
    (_trip, 3),
    (_savings, 4),
]


def _word_problem(rng: random.Random, difficulty: int) -> tuple[str, str]:
    max_steps = {1: 2, 2: 3}.get(difficulty, 4)
    template = rng.choice([t for t, steps in _TEMPLATES if steps <= max_steps])
    (name, pronoun), (friend, _) = rng.sample(_PEOPLE, 2)
    story = _Story(name=name, pronoun=pronoun, friend=friend, scale=(1, 2, 3, 5, 10)[difficulty - 1])
    question, answer = template(rng, story)
    if difficulty >= 4:  # an irrelevant number, to be ignored
        question = f"({friend}'s favourite number is {rng.randint(2, 99)}.) {question}"
    return question, str(answer)


# ------------------------------------------------------------------------------------ worked steps

_STEP_WORDS = {"+": "add {}", "-": "subtract {}", "*": "multiply by {}"}


def _worked_steps(rng: random.Random, difficulty: int) -> tuple[str, str, str]:
    """A chain of operations applied left to right, to be answered one line per step.

    Difficulty 0 and 1: three steps on single digits; then 4, 5, 6, 7 steps, operands up to 9
    (0-2) or 19 (3+). Every intermediate value stays in 0..99 (a step that would leave it is
    replaced by an addition or subtraction that does not), so each line is a one- or two-digit
    sum, difference or product the model can learn, and the answer is only right if every line is.
    """
    steps = 3 if difficulty <= 1 else difficulty + 2
    top = 9 if difficulty <= 2 else 19
    value = rng.randint(1, 9)
    words, lines = [f"Start with {value}"], []
    for _ in range(steps):
        op, x = rng.choice("+-*"), rng.randint(2, top)
        if op == "*" and value * x > 99:
            op = "-" if value - x >= 0 else "+"
        if op == "-" and value - x < 0:
            op = "+"
        if op == "+" and value + x > 99:
            op = "-"
        result = value + x if op == "+" else value - x if op == "-" else value * x
        words.append(_STEP_WORDS[op].format(x))
        lines.append(f"{value}{op}{x}={result}")
        value = result
    question = ", ".join(words) + ". Show each step."
    solution = "\n".join(lines) + f"\n\\boxed{{{value}}}"
    return question, str(value), solution


# ------------------------------------------------------------------------------------ generation

_GENERATORS: dict[str, Callable[[random.Random, int], tuple[str, ...]]] = {
    "arithmetic": _arithmetic,
    "word_problem": _word_problem,
    "fraction": _fraction,
    "worked_steps": _worked_steps,
}


def generate_task(seed: int, index: int, difficulty: int, kind: str) -> MathTask:
    """Task ``index`` of the stream for ``seed``; depends on nothing else."""
    if kind not in _GENERATORS:
        raise ValueError(f"unknown kind {kind!r}; choose from {sorted(_GENERATORS)}")
    low = 0 if kind in ("arithmetic", "worked_steps") else 1
    if not low <= difficulty <= MAX_DIFFICULTY:
        raise ValueError(
            f"difficulty must be {low}..{MAX_DIFFICULTY} for {kind} tasks, got {difficulty}"
            + (" (0 exists only for arithmetic and worked_steps)" if difficulty == 0 else "")
        )
    rng = random.Random(f"palaestra.math/{kind}/d{difficulty}/s{seed}/{index}")
    question, answer, *worked = _GENERATORS[kind](rng, difficulty)
    task_id = f"{kind}-d{difficulty}-s{seed}-{index}"
    return MathTask(
        task_id=task_id, question=question, answer=answer, difficulty=difficulty, kind=kind,
        solution=worked[0] if worked else "",
    )  # fmt: skip


def iter_tasks(seed: int, difficulty: int = 1, kinds: Sequence[str] = KINDS) -> Iterator[MathTask]:
    """An endless stream of tasks; the first n equal ``generate_tasks(n, seed, difficulty, kinds)``."""
    if not kinds:
        raise ValueError("kinds must not be empty")
    for index in count():
        yield generate_task(seed, index, difficulty, kinds[index % len(kinds)])


def generate_tasks(n: int, seed: int, difficulty: int = 1, kinds: Sequence[str] = KINDS) -> list[MathTask]:
    """``n`` tasks, kinds cycled in order."""
    stream = iter_tasks(seed, difficulty, kinds)
    return [next(stream) for _ in range(n)]


# ------------------------------------------------------------------------------------ GSM8K files


class TaskFileError(ValueError):
    """A malformed line in a task file; the message starts with ``path:line:``."""


_DIGIT_COMMA = re.compile(r"(?<=\d),(?=\d)")


def _final_answer(answer: str) -> str | None:
    """``"... #### 1,234"`` -> ``"1234"``; None without a ``####`` line."""
    at = answer.rfind("####")
    if at < 0:
        return None
    final = answer[at + 4 :].strip().splitlines()[0] if answer[at + 4 :].strip() else ""
    final = _DIGIT_COMMA.sub("", final).replace("$", "").strip().rstrip(".").strip()
    return final or None


def load_gsm8k_jsonl(path: str | Path) -> list[MathTask]:
    """Tasks from a GSM8K-format JSONL file: each non-blank line an object with a ``question`` and
    an ``answer`` whose final ``#### N`` line is the reference (the rationale before it is dropped,
    thousands separators removed). ``task_id`` is the line's ``id`` field if it has one, else
    ``gsm8k-<file stem>-<line number>``. Raises `TaskFileError` naming the line on a bad one."""
    path = Path(path)
    tasks: list[MathTask] = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise TaskFileError(f"{where}: not valid JSON ({e.msg})") from None
            if not isinstance(record, dict):
                raise TaskFileError(f"{where}: expected a JSON object, got {type(record).__name__}")
            question, answer = record.get("question"), record.get("answer")
            if not isinstance(question, str) or not question.strip():
                raise TaskFileError(f"{where}: missing or empty 'question'")
            if not isinstance(answer, str):
                raise TaskFileError(f"{where}: missing 'answer' (a string ending in '#### N')")
            final = _final_answer(answer)
            if final is None:
                raise TaskFileError(f"{where}: 'answer' has no '#### N' final answer")
            task_id = str(record["id"]) if record.get("id") is not None else f"gsm8k-{path.stem}-{lineno}"
            tasks.append(
                MathTask(task_id=task_id, question=question.strip(), answer=final, difficulty=0, kind="gsm8k")
            )
    return tasks
