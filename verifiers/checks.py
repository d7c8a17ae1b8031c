"""Small deterministic checks (exact, regex, format) and `weighted`, which sums named components.

Every check returns a `CheckResult` (``reward`` 1.0 or 0.0, ``passed``, a short ``reason``), so
checks compose with each other and with `verify_math` / `verify_code` results::

    score = weighted(
        correct=(1.0, lambda text, task: verify_math(text, task.answer)),
        one_box=(0.1, lambda text, task: has_exactly_one_boxed(text)),
    )
    score(completion, task)  # {"reward": 1.1, "components": {"correct": 1.0, "one_box": 1.0}}
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypedDict

from palaestra.verifiers.math import boxed_spans

__all__ = [
    "CheckResult",
    "RubricScore",
    "exact_match",
    "has_exactly_one_boxed",
    "is_valid_json",
    "nothing_after_answer",
    "regex_match",
    "weighted",
]


@dataclass(frozen=True)
class CheckResult:
    reward: float
    passed: bool
    reason: str


def _check(passed: bool, reason: str) -> CheckResult:
    return CheckResult(reward=1.0 if passed else 0.0, passed=passed, reason=reason)


def exact_match(
    response: str, expected: str, *, ignore_case: bool = False, normalize_whitespace: bool = True
) -> CheckResult:
    """``response == expected``; by default leading/trailing whitespace is ignored and inner runs
    of whitespace count as one space."""
    a, b = response, expected
    if normalize_whitespace:
        a, b = " ".join(a.split()), " ".join(b.split())
    if ignore_case:
        a, b = a.casefold(), b.casefold()
    return _check(a == b, "match" if a == b else "no match")


def regex_match(response: str, pattern: str | re.Pattern[str], *, full: bool = False) -> CheckResult:
    """Passes if ``pattern`` is found anywhere in ``response`` (or matches all of it, ``full=True``).
    The pattern is the task author's, not the model's; keep it free of catastrophic backtracking."""
    regex = re.compile(pattern) if isinstance(pattern, str) else pattern
    found = regex.fullmatch(response) if full else regex.search(response)
    return _check(found is not None, "match" if found else "no match")


def has_exactly_one_boxed(response: str) -> CheckResult:
    """Exactly one balanced ``\\boxed{...}`` (a box nested in another counts separately)."""
    n = len(boxed_spans(response))
    return _check(n == 1, "one \\boxed{}" if n == 1 else f"{n} \\boxed{{}} found")


_CODE_FENCE = re.compile(r"^\s*```[\w-]*\s*\n(.*)\n\s*```\s*$", re.DOTALL)


def is_valid_json(response: str, *, allow_code_fence: bool = True) -> CheckResult:
    """The whole response parses as JSON (optionally inside one ```` ``` ```` / ```` ```json ```` fence)."""
    text = response
    if allow_code_fence and (m := _CODE_FENCE.match(text)):
        text = m.group(1)
    try:
        json.loads(text)
    except ValueError as e:  # json.JSONDecodeError
        return _check(False, f"invalid JSON: {e}")
    except RecursionError:  # "[[[[..." thousands deep
        return _check(False, "invalid JSON: nested too deeply")
    return _check(True, "valid JSON")


def nothing_after_answer(response: str) -> CheckResult:
    """The response ends with its last ``\\boxed{...}``: only whitespace, punctuation and closing
    math delimiters (``$``, ``\\]``, ``\\)``) may follow it."""
    spans = boxed_spans(response)
    if not spans:
        return _check(False, "no \\boxed{} answer")
    tail = response[spans[-1][2] :]
    tail = tail.replace("\\]", "").replace("\\)", "")
    ok = re.fullmatch(r"[\s$.*!]*", tail) is not None
    return _check(ok, "nothing after the answer" if ok else f"text after the answer: {tail.strip()[:40]!r}")


# ------------------------------------------------------------------------------------ composition


class _HasReward(Protocol):
    @property
    def reward(self) -> float: ...


class RubricScore(TypedDict):
    reward: float
    """Sum of weight * value over the components."""
    components: dict[str, float]
    """Each component's unweighted value."""


Component = Callable[..., "float | _HasReward"]


def weighted(**components: tuple[float, Component]) -> Callable[..., RubricScore]:
    """A scorer that calls every component with its own arguments and sums ``weight * value``.

    A component returns a float or anything with a ``.reward`` (`CheckResult`, `MathResult`,
    `CodeResult`). The total is a plain weighted sum, not a weighted mean: normalise the weights
    yourself if you want the reward in [0, 1]."""
    if not components:
        raise ValueError("weighted() needs at least one component")
    for name, spec in components.items():
        if not (isinstance(spec, tuple) and len(spec) == 2 and callable(spec[1])):
            raise TypeError(f"component {name!r} must be (weight, callable), got {spec!r}")

    def score(*args: Any, **kwargs: Any) -> RubricScore:
        values: dict[str, float] = {}
        for name, (_, fn) in components.items():
            out = fn(*args, **kwargs)
            values[name] = float(out if isinstance(out, int | float) else out.reward)
        total = sum(weight * values[name] for name, (weight, _) in components.items())
        return {"reward": total, "components": values}

    return score
