"""Held-out scoring per task kind (`orchestrator.actors.score`) and its metrics row (`loop.eval_row`)."""

from __future__ import annotations

from palaestra.environments.math.tasks import generate_tasks
from palaestra.orchestrator.actors import score
from palaestra.orchestrator.loop import eval_row
from palaestra.sdk.runner import RolloutResult


def _result(task_id: str, correct: float, status: str = "completed") -> RolloutResult:
    return RolloutResult(task_id, "g", "s", correct, status, {"correct": correct})


def test_one_kind_gives_the_overall_accuracy_only():
    tasks = generate_tasks(4, seed=3, difficulty=0, kinds=["arithmetic"])
    results = [_result(t.task_id, float(i % 2)) for i, t in enumerate(tasks)]
    out = score(tasks, results)
    assert out == {"accuracy": 0.5, "tasks": 4.0, "failed": 0.0}
    assert eval_row(out) == {"eval/accuracy": 0.5}


def test_two_kinds_are_scored_apart_and_failures_left_out():
    arith = generate_tasks(4, seed=3, difficulty=0, kinds=["arithmetic"])
    steps = generate_tasks(2, seed=3, difficulty=0, kinds=["worked_steps"])
    results = [_result(t.task_id, 1.0) for t in arith[:3]] + [_result(arith[3].task_id, 0.0, "failed")]
    results += [_result(steps[0].task_id, 0.0), _result(steps[1].task_id, 1.0)]
    out = score([*arith, *steps], results)
    assert out["accuracy"] == 4 / 5 and out["failed"] == 1.0
    assert out["accuracy/arithmetic"] == 1.0 and out["tasks/arithmetic"] == 3.0
    assert out["accuracy/worked_steps"] == 0.5 and out["tasks/worked_steps"] == 2.0
    assert eval_row(out) == {
        "eval/accuracy": 0.8,
        "eval/accuracy/arithmetic": 1.0,
        "eval/accuracy/worked_steps": 0.5,
    }
