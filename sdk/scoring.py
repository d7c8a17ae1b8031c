"""Held-out scoring: how `palaestra eval` and `palaestra train`'s evaluations turn finished
episodes into an accuracy, overall and per task kind.

    score(tasks, results)   # {"accuracy": 0.8, "tasks": 5.0, "failed": 1.0,
                            #  "accuracy/arithmetic": 1.0, "tasks/arithmetic": 3.0, ...}

An episode is correct by its ``correct`` metric when the environment reports one, else when its
reward is above 0 (`correct`). Failed episodes are counted apart, never as wrong answers. Tasks
that carry a ``kind`` (math's arithmetic, word_problem, ...) are also scored per kind when there
are several, so a multi-domain run shows what each domain gained (`palaestra train` logs them as
``eval/accuracy/<kind>``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["accuracy", "by_kind", "correct", "score"]


def correct(result: Any) -> float:
    """How correct one `RolloutResult` is: its ``correct`` metric, else 1.0 for a reward above 0."""
    return result.metrics.get("correct", float(result.reward > 0))


def accuracy(results: Sequence[Any]) -> float:
    """The mean of `correct` over `results`; nan for none."""
    return sum(correct(r) for r in results) / len(results) if results else float("nan")


def score(tasks: Sequence[Any], results: Sequence[Any]) -> dict[str, float]:
    """Held-out accuracy of `results` (`RolloutResult`s of `tasks`; failed ones are counted apart).
    Tasks of several kinds (a `kind` attribute) also get each kind's ``accuracy/<kind>`` and
    ``tasks/<kind>``."""
    scored = [r for r in results if r.status != "failed"]
    out = {
        "accuracy": accuracy(scored),
        "tasks": float(len(scored)),
        "failed": float(len(results) - len(scored)),
    }
    kind_of = {str(t.task_id): getattr(t, "kind", None) for t in tasks}
    kinds = sorted({k for k in kind_of.values() if isinstance(k, str)})
    if len(kinds) > 1:
        for kind in kinds:
            of_kind = [r for r in scored if kind_of.get(r.task_id) == kind]
            out[f"accuracy/{kind}"] = accuracy(of_kind)
            out[f"tasks/{kind}"] = float(len(of_kind))
    return out


def by_kind(tasks: Sequence[Any], results: Sequence[Any], default: str) -> dict[str, tuple[float, int]]:
    """Each kind's (accuracy, tasks scored), in the order the kinds first appear in `tasks`, even
    when there is one (`palaestra eval` prints them all); tasks without a `kind` are `default`'s."""
    kind_of = {str(t.task_id): getattr(t, "kind", None) or default for t in tasks}
    kinds = list(dict.fromkeys(kind_of.values()))
    scored = [r for r in results if r.status != "failed"]
    out = {}
    for kind in kinds:
        of_kind = [r for r in scored if kind_of.get(r.task_id) == kind]
        out[kind] = (accuracy(of_kind), len(of_kind))
    return out
