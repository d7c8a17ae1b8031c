"""The driver's console says, once, when a run trains on no learning signal (every group's rewards
equal: advantage 0 everywhere, gradient 0), with the counts and what to change."""

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
