"""What a run shows when it is done: the reward curve (PNG) and one summary line.

    from palaestra.orchestrator.report import plot_reward_curve, summary_line
    plot_reward_curve(step_rows, "runs/demo/reward_curve.png", teacher_accuracy=0.62)

`step_rows` are the per-step metric dicts the training loop logs (keys below; a row may lack any
of them, e.g. held-out accuracy exists only on evaluation steps). The trajectory viewer (HTML) is
`viewer.py`. `fault_summary` is the summary's part on process deaths (supervisor.py).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "EVAL_ACCURACY",
    "REWARD_MEAN",
    "REWARD_STD",
    "STEP",
    "TEACHER_ACCURACY",
    "accuracy_points",
    "dropped_totals",
    "fault_summary",
    "plot_reward_curve",
    "reward_band",
    "summary_line",
]

# Metric keys read from each step's row (the loop's namespaced metrics).
STEP = "train/step"
REWARD_MEAN = "rollout/reward_mean"
REWARD_STD = "rollout/reward_std"
REWARD_MIN = "rollout/reward_min"  # the step's least and greatest reward: the band stays within them
REWARD_MAX = "rollout/reward_max"
EVAL_TASKS = "eval/tasks"  # tasks an evaluation scored, where a row has it
EVAL_ACCURACY = "eval/accuracy"  # held-out accuracy of the student, on evaluation steps
TEACHER_ACCURACY = "eval/teacher_accuracy"  # the teacher's held-out accuracy (a reference line)


def _number(row: Mapping[str, Any], key: str) -> float | None:
    value = row.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value):
        return None
    return float(value)


def _steps(rows: Sequence[Mapping[str, Any]]) -> list[float]:
    """Each row's step: `train/step`, its index when absent."""
    steps = [_number(r, STEP) for r in rows]
    return [float(i) if s is None else s for i, s in enumerate(steps)]


def reward_band(rows: Sequence[Mapping[str, Any]]) -> list[tuple[float, float, float, float]]:
    """(step, mean, low, high) of each row with a reward: mean ± std, clipped to the step's least
    and greatest reward (`rollout/reward_min`/`max`) where the row has them: rewards in [0, 1] give
    a band in [0, 1], never below 0."""
    out = []
    for step, row in zip(_steps(rows), rows, strict=True):
        mean = _number(row, REWARD_MEAN)
        if mean is None:
            continue
        std = _number(row, REWARD_STD) or 0.0
        least, most = _number(row, REWARD_MIN), _number(row, REWARD_MAX)
        low = mean - std if least is None else max(mean - std, least)
        high = mean + std if most is None else min(mean + std, most)
        out.append((step, mean, low, high))
    return out


def accuracy_points(
    rows: Sequence[Mapping[str, Any]], eval_tasks: int | None = None
) -> list[tuple[float, float, float | None]]:
    """(step, accuracy, binomial standard error √(p(1-p)/n)) of each evaluation row; n is the row's
    `eval/tasks`, else `eval_tasks`; the error is None when neither is known."""
    out = []
    for step, row in zip(_steps(rows), rows, strict=True):
        p = _number(row, EVAL_ACCURACY)
        if p is None:
            continue
        n = _number(row, EVAL_TASKS) or eval_tasks
        out.append((step, p, math.sqrt(p * (1 - p) / n) if n else None))
    return out


def plot_reward_curve(
    rows: Sequence[Mapping[str, Any]],
    path: str | Path,
    *,
    title: str = "Training reward",
    teacher_accuracy: float | None = None,
    eval_tasks: int | None = None,
) -> Path:
    """Reward mean (± std band, `reward_band`) per step, held-out accuracy where measured (error
    bars: its binomial standard error over `eval_tasks` tasks, `accuracy_points`), the teacher's as
    a line.

    `teacher_accuracy` defaults to the last `eval/teacher_accuracy` in the rows. Writes a PNG
    (matplotlib's Agg canvas; no display needed).
    """
    from matplotlib.figure import Figure  # a Figure without pyplot: no global backend or state
    from matplotlib.ticker import MaxNLocator

    reward = reward_band(rows)
    accuracy = accuracy_points(rows, eval_tasks)
    if teacher_accuracy is None:
        teacher_values = [t for r in rows if (t := _number(r, TEACHER_ACCURACY)) is not None]
        teacher_accuracy = teacher_values[-1] if teacher_values else None

    show_accuracy = bool(accuracy) or teacher_accuracy is not None
    fig = Figure(figsize=(8, 6 if show_accuracy else 4.5), dpi=120, layout="constrained")
    if show_accuracy:  # two panels on one step axis: reward and accuracy have different scales
        ax, acc_ax = fig.subplots(2, 1, sharex=True, height_ratios=[3, 2])
    else:
        ax, acc_ax = fig.subplots(1, 1), None
    if reward:
        xs, means, lows, highs = zip(*reward, strict=True)
        ax.fill_between(
            xs,
            lows,
            highs,
            color="tab:blue",
            alpha=0.2,
            linewidth=0,
            label="± std over the step's samples (within their range)",
        )
        ax.plot(xs, means, color="tab:blue", marker="o", markersize=3, label="mean reward")
        ax.legend(loc="best", fontsize="small")
    else:
        ax.text(0.5, 0.5, "no reward recorded", transform=ax.transAxes, ha="center", color="gray")
    ax.set_ylabel("reward per sample")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    bottom = ax
    if acc_ax is not None:
        if accuracy:
            xs, values, errors = zip(*accuracy, strict=True)
            known = all(e is not None for e in errors)
            acc_ax.errorbar(
                xs,
                values,
                yerr=list(errors) if known else None,
                color="tab:green",
                marker="s",
                markersize=5,
                capsize=3,
                label="student (± binomial standard error)" if known else "student",
            )
            for x, v, _ in accuracy:
                acc_ax.annotate(
                    f"{v:.2f}",
                    (x, v),
                    textcoords="offset points",
                    xytext=(0, 7),
                    ha="center",
                    fontsize=8,
                    bbox={"boxstyle": "round,pad=0.1", "fc": "white", "ec": "none", "alpha": 0.8},
                )
        if teacher_accuracy is not None:
            acc_ax.axhline(
                teacher_accuracy, color="tab:red", linestyle="--", label=f"teacher ({teacher_accuracy:.2f})"
            )
        acc_ax.set_ylim(0, 1.08)
        acc_ax.set_ylabel("held-out accuracy")
        acc_ax.grid(alpha=0.3)
        acc_ax.legend(loc="lower right", fontsize="small")
        bottom = acc_ax
    bottom.set_xlabel("training step")
    bottom.xaxis.set_major_locator(MaxNLocator(integer=True))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")
    return path


def dropped_totals(rows: Sequence[Mapping[str, Any]]) -> dict[str, int]:
    """Samples not trained on over the run, per reason: the steps' `rollout/dropped_<reason>`."""
    totals: dict[str, int] = {}
    for row in rows:
        for key, value in row.items():
            if key.startswith("rollout/dropped_") and isinstance(value, (int, float)):
                reason = key.removeprefix("rollout/dropped_")
                totals[reason] = totals.get(reason, 0) + int(value)
    return {k: v for k, v in totals.items() if v}


def fault_summary(faults: Sequence[Any]) -> str:
    """`faults: engine-1 at 12:00:03 restarted ... (recovered in 4.1 s); trainer at ...` (each
    fault is a `supervisor.Fault`), or "" without any."""
    if not faults:
        return ""
    return "faults: " + "; ".join(
        f"{f.component} at {f.at[11:19]} during {f.phase}: {f.action} "
        + ("(not recovered)" if math.isnan(f.recovery_s) else f"(recovered in {f.recovery_s:.1f} s)")
        for f in faults
    )


def summary_line(
    rows: Sequence[Mapping[str, Any]],
    *,
    steps: int,
    mode: str,
    eval_after: Mapping[str, float] | None,
    teacher_accuracy: float | None,
    weight_version: int,
    engines: int,
    counts: Mapping[str, int],
    output_dir: Path,
    faults: Sequence[Any] = (),
) -> str:
    """`done: 200 steps (sync); reward 0.24 -> 0.37; held-out accuracy 0.34 -> 0.65 (200 tasks;
    teacher 0.98); weight version 200 on 2 engines; counts: ...; -> runs/demo/{...}`."""
    rewards = [v for r in rows if (v := _number(r, REWARD_MEAN)) is not None]
    parts = [f"done: {steps} steps ({mode})"]
    if rewards:
        parts.append(f"reward {rewards[0]:.3f} -> {rewards[-1]:.3f}")
    before = next((r[EVAL_ACCURACY] for r in rows if EVAL_ACCURACY in r), None)
    if before is not None and eval_after is not None:
        teacher = "" if teacher_accuracy is None else f"; teacher {teacher_accuracy:.3f}"
        parts.append(
            f"held-out accuracy {before:.3f} -> {eval_after['accuracy']:.3f} "
            f"({int(eval_after['tasks'])} tasks{teacher})"
        )
    parts.append(f"weight version {weight_version} on {engines} engines")
    dropped = dropped_totals(rows)
    if dropped:
        parts.append("not trained on: " + ", ".join(f"{k} {v}" for k, v in sorted(dropped.items())))
    noted = {k: v for k, v in counts.items() if v and k != "sessions_completed"}
    if noted:
        parts.append("counts: " + ", ".join(f"{k} {v}" for k, v in sorted(noted.items())))
    if faults:
        parts.append(fault_summary(faults))
    files = "reward_curve.png, viewer.html, metrics.jsonl" + (", faults.json" if faults else "")
    parts.append(f"-> {output_dir}/{{{files}}}")
    return "; ".join(parts)
