"""The driver's console says, once, when a run trains on no learning signal (every group's rewards
equal: advantage 0 everywhere, gradient 0), with the counts and what to change; and metrics.jsonl
gets one row per step, the step-0 evaluation's included."""

from __future__ import annotations

import json
import logging

from palaestra.config import LoggingOptions
from palaestra.orchestrator.metrics import make_tracker, no_signal_message

FLAT = {"train/zero_advantage_fraction": 1.0, "train/zero_variance_groups": 8.0, "train/groups": 8.0,
        "train/reward_mean": 0.0, "train/grad_norm": 0.0}  # fmt: skip
SIGNAL = {**FLAT, "train/zero_advantage_fraction": 0.25, "train/zero_variance_groups": 2.0}


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_the_first_step_without_signal_is_warned_once_and_the_end_counts_them(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="palaestra.orchestrator.metrics")
    tracker = make_tracker(LoggingOptions(), tmp_path, run_name="t", config={})
    tracker.log(SIGNAL, step=1)
    assert _warnings(caplog) == []  # a step with some signal says nothing
    for step in (2, 3, 4):
        tracker.log(FLAT, step=step)
    tracker.log({"eval/accuracy": 0.5}, step=4)  # an evaluation row is not a trained step
    tracker.log(SIGNAL, step=5)
    (warning,) = _warnings(caplog)  # once, however many steps had no signal
    assert warning.startswith(
        "step 2: no learning signal: all 8 groups gave every one of their samples the same"
    )
    assert "reward mean 0" in warning and "train/zero_advantage_fraction 1.0" in warning
    for advice in ("env.samples_per_task", "easier tasks", "model.teacher", "trainer.opd.kl_coef",
                   "trainer.advantage_estimator"):  # fmt: skip
        assert advice in warning, advice
    tracker.close()
    assert (
        _warnings(caplog)[1]
        == "no learning signal in 3 of 5 trained steps (the first: step 2; see the warning there)"
    )
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["train/zero_advantage_fraction"] for r in rows if "train/zero_advantage_fraction" in r] == [
        0.25, 1.0, 1.0, 1.0, 0.25,
    ]  # fmt: skip


def test_a_run_with_signal_says_nothing(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="palaestra.orchestrator.metrics")
    tracker = make_tracker(LoggingOptions(), tmp_path, run_name="t", config={})
    for step in range(1, 4):
        tracker.log(SIGNAL, step=step)
    tracker.close()
    assert _warnings(caplog) == []


def test_the_message_names_the_estimator_when_the_groups_differ():
    # `none` without a teacher: rewards vary, the estimator still gives 0
    m = no_signal_message(7, {**FLAT, "train/zero_variance_groups": 1.0, "train/groups": 4.0})
    assert m.startswith("step 7: no learning signal: the advantage estimator gave 0 to every sample "
                        "(1 of 4 groups had equal rewards) and no teacher added a term")  # fmt: skip


# -- metrics.jsonl's rows, as the run's loop logs them ------------------------------------------
class _Counters:
    """TEST DOUBLE of the run's supervisor: no faults counted."""

    def new_counters(self) -> dict[str, float]:
        return {}


class _Feed:
    def close(self) -> None:
        pass


def _run_without_a_cluster(tmp_path, steps: int, eval_tasks: int):
    """The real `Run` methods that log rows, on a `Run` built without a cluster: its evaluation a
    TEST DOUBLE answering accuracy 0.25 before and 0.75 after."""
    from palaestra.config import load_config
    from palaestra.orchestrator.checkpoint import RunState
    from palaestra.orchestrator.loop import Run

    run = Run.__new__(Run)
    run.cfg = load_config(None, [f"run.steps={steps}", f"env.eval_tasks={eval_tasks}"])
    run.state, run._bar, run._held_row = RunState(), None, None
    run.tracker = make_tracker(LoggingOptions(), tmp_path, run_name="t", config={})
    run.supervisor, run.feed = _Counters(), _Feed()
    run.evaluate = lambda tag: {"accuracy": 0.25 if tag == "before" else 0.75, "tasks": float(eval_tasks)}
    return run


def _rows(tmp_path) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]


def test_metrics_jsonl_has_the_step_0_evaluation_and_one_row_per_step(tmp_path):
    run = _run_without_a_cluster(tmp_path, steps=2, eval_tasks=4)
    with run:
        run.evaluate_before()
        for step in range(2):
            run.log(step, {"rollout/reward_mean": 0.5 + step})
        run.evaluate_after()
    assert _rows(tmp_path) == [
        {"step": 0, "train/step": 0.0, "eval/accuracy": 0.25},
        {"step": 1, "rollout/reward_mean": 0.5},
        {"step": 2, "rollout/reward_mean": 1.5, "eval/accuracy": 0.75},
    ]
    assert run.state.rows[-1] == {"rollout/reward_mean": 1.5, "eval/accuracy": 0.75}


def test_the_last_row_is_written_when_its_evaluation_never_comes_and_without_evaluations(tmp_path):
    run = _run_without_a_cluster(tmp_path / "cut", steps=1, eval_tasks=4)
    with run:
        run.log(0, {"rollout/reward_mean": 0.5})  # the evaluation after it fails: the run exits
    assert _rows(tmp_path / "cut") == [{"step": 1, "rollout/reward_mean": 0.5}]
    run = _run_without_a_cluster(tmp_path / "none", steps=2, eval_tasks=0)
    with run:
        run.log(0, {"rollout/reward_mean": 0.5})
        assert len(_rows(tmp_path / "none")) == 1  # written as the step ends, not held
        run.log(1, {"rollout/reward_mean": 0.25})
    assert [r["step"] for r in _rows(tmp_path / "none")] == [1, 2]


def test_a_redone_last_step_keeps_both_rows_as_other_redone_steps_do(tmp_path):
    run = _run_without_a_cluster(tmp_path, steps=1, eval_tasks=4)
    with run:
        run.log(0, {"train/loss": 1.0})  # held for the evaluation ...
        run.log(0, {"train/loss": 0.5})  # ... but a fault's recovery redid the step
        run.evaluate_after()
    assert _rows(tmp_path) == [
        {"step": 1, "train/loss": 1.0},
        {"step": 1, "train/loss": 0.5, "eval/accuracy": 0.75},
    ]
