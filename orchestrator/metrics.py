"""A run's metrics: what a step's batch measured, and where metrics go (a console line per step,
TensorBoard, W&B, a JSON-lines file).

    metrics = rollout_metrics(batch)                   # rollout/* (and perf/gen_s) of one step's batch
    tracker = make_tracker(cfg.logging, output_dir, run_name="demo", config=config_to_dict(cfg))
    tracker.log({"rollout/reward_mean": 0.4, "train/loss": 0.1}, step=3)
    print(console_line(3, 20, metrics))
    tracker.close()

Keys are namespaced by what produced them — `rollout/` (generation and the sample feed), `train/`
(the optimizer step), `opd/` (distillation), `mismatch/` (rollout vs trainer logprobs), `perf/`
(time and throughput), `eval/` (held-out accuracy) — and go to every backend unchanged.

The loop never asks which backends are on: `make_tracker` always returns one object. TensorBoard
is used when `logging.tensorboard_dir` is set (`torch.utils.tensorboard`, the `tensorboard`
package); W&B when `logging.wandb_project` is set and `wandb` is installed (offline by default;
`wandb sync` uploads later); without either the tracker is a no-op. `metrics.jsonl` in the output
directory is always written: one JSON object per step, what `report.plot_reward_curve` plots.

`make_tracker` also adds a `NoSignalWarning`: the first step that trained on no learning signal
(``train/zero_advantage_fraction`` = 1: every group's rewards equal, so every advantage is 0 and
the gradient too) is a warning on the driver's console saying why and what to change, once; the
run's end says how many steps had none.
"""

from __future__ import annotations

import json
import logging
import math
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from palaestra.config import LoggingOptions
from palaestra.orchestrator.batching import Batch

__all__ = [
    "NAMESPACES",
    "JsonlTracker",
    "MultiTracker",
    "NoSignalWarning",
    "NoopTracker",
    "TensorBoardTracker",
    "Tracker",
    "WandbTracker",
    "console_line",
    "make_tracker",
    "rollout_metrics",
]

log = logging.getLogger(__name__)

NAMESPACES = ("rollout/", "train/", "opd/", "mismatch/", "perf/", "eval/")


def rollout_metrics(batch: Batch) -> dict[str, float]:
    """`rollout/*` of one step's batch: reward, sizes, staleness, what was dropped and why,
    sessions per status and failed sessions per reason (`rollout/failed_<reason>`: ``sandbox_error``
    when the sandbox died under the episode, ``error`` for any other exception), the environment's own metrics (`rollout/env_*`), for tasks of several kinds
    each kind's reward and groups (`rollout/reward_mean/<kind>`, `rollout/groups/<kind>`); `perf/gen_s` is the
    wall time from the first group's start to the last one's end, `perf/longest_group_s` the longest
    group's and `perf/longest_sample_tokens_per_s` its longest session's sampled tokens per second."""
    rewards = [r for g in batch.groups for r in g.rewards]
    samples = batch.samples
    m: dict[str, float] = {
        "rollout/reward_mean": statistics.fmean(rewards) if rewards else math.nan,
        "rollout/reward_std": statistics.pstdev(rewards) if len(rewards) > 1 else 0.0,
        "rollout/reward_min": min(rewards, default=math.nan),  # the reward curve's band stays within
        "rollout/reward_max": max(rewards, default=math.nan),
        "rollout/samples": float(len(samples)),
        "rollout/groups": float(len(batch.groups)),
        "rollout/sampled_tokens": float(sum(s.num_sampled for s in samples)),
        "rollout/response_len_mean": statistics.fmean(s.response_len for s in samples) if samples else 0.0,
        "rollout/staleness_mean": statistics.fmean(batch.lags) if batch.lags else 0.0,
        "rollout/staleness_max": max(batch.lags, default=0.0),
        "rollout/stale_dropped": float(batch.counts["stale_dropped"]),
        "rollout/stale_masked": float(batch.counts["stale_masked"]),
        "rollout/groups_zero_variance": float(batch.counts["groups_zero_variance"]),
        "rollout/groups_dropped": float(len(batch.considered) - len(batch.groups)),
        "rollout/rounds": float(batch.rounds),
        "rollout/samples_generated": float(batch.samples_generated),
        "rollout/dropped": float(batch.counts["stale_dropped"] + batch.counts["zero_variance_samples"]),
    }
    if samples:  # dynamic sampling's cost: how many samples were made for each one that trains
        m["rollout/generated_per_trained"] = batch.samples_generated / len(samples)
    for reason, n in batch.dropped_counts().items():  # samples not trained on, per reason
        m[f"rollout/dropped_{reason}"] = float(n)
    for status, n in batch.session_statuses().items():
        m[f"rollout/sessions_{status}"] = float(n)
    for reason, n in batch.session_failures().items():  # why they failed: sandbox_error, error, ...
        m[f"rollout/failed_{reason}"] = float(n)
    if batch.groups:
        m["perf/gen_s"] = max(g.finished for g in batch.groups) - min(g.started for g in batch.groups)
        # the straggler: the group that took longest (its sessions run together, so its wall is its
        # longest session's) and that session's sampled tokens per second of it
        longest = max(batch.groups, key=lambda g: g.finished - g.started)
        m["perf/longest_group_s"] = longest.finished - longest.started
        m["perf/longest_sample_tokens_per_s"] = longest.longest_tokens / max(m["perf/longest_group_s"], 1e-9)
    for k in sorted({k for g in batch.groups for k in g.metrics}):
        m[f"rollout/env_{k}"] = statistics.fmean(g.metrics.get(k, 0.0) for g in batch.groups)
    kinds = sorted({g.kind for g in batch.groups if g.kind is not None})
    if len(kinds) > 1:  # tasks of several kinds (datasets, games, a mix's families): each one's reward
        for kind in kinds:
            of_kind = [r for g in batch.groups if g.kind == kind for r in g.rewards]
            m[f"rollout/reward_mean/{kind}"] = statistics.fmean(of_kind) if of_kind else math.nan
            m[f"rollout/groups/{kind}"] = float(sum(g.kind == kind for g in batch.groups))
    return m


class Tracker(Protocol):
    def log(self, metrics: Mapping[str, float], step: int) -> None: ...

    def close(self) -> None: ...


def _scalars(metrics: Mapping[str, Any]) -> dict[str, float]:
    """The finite-or-not numeric entries (bools count as 0/1); anything else is not a scalar."""
    return {k: float(v) for k, v in metrics.items() if isinstance(v, int | float)}


class NoopTracker:
    """Takes everything, does nothing (so the loop has no `if tensorboard:` branches)."""

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        pass

    def close(self) -> None:
        pass


class JsonlTracker:
    """Appends `{"step": k, **metrics}` per call: the run logs one row per step (step 0: the
    held-out evaluation before training; the last step's row carries the evaluation after it). A
    resumed run appends again, and faults counted after the last row add one: readers merge the
    rows of a step, later keys winning."""

    def __init__(self, path: str | Path, *, append: bool = True):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a" if append else "w", encoding="utf-8")  # noqa: SIM115

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        row = {"step": step, **{k: (v if math.isfinite(v) else None) for k, v in _scalars(metrics).items()}}
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class TensorBoardTracker:
    def __init__(self, log_dir: str | Path):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(log_dir))

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        for key, value in _scalars(metrics).items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbTracker:
    def __init__(self, project: str, mode: str, name: str, directory: Path, config: Mapping[str, Any]):
        import wandb

        directory.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(project=project, name=name, mode=mode, dir=str(directory), config=dict(config))

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        self.run.log(_scalars(metrics), step=step)

    def close(self) -> None:
        self.run.finish()


def no_signal_message(step: int, metrics: Mapping[str, Any]) -> str:
    """Why step `step` taught nothing, with its numbers, and what to change (`NoSignalWarning`)."""
    flat, groups = metrics.get("train/zero_variance_groups"), metrics.get("train/groups")
    reward = metrics.get("train/reward_mean", metrics.get("rollout/reward_mean"))
    if isinstance(flat, int | float) and isinstance(groups, int | float) and groups and flat == groups:
        cause = (
            f"all {int(groups)} groups gave every one of their samples the same reward "
            f"(train/zero_variance_groups {int(flat)}"
            + (f", reward mean {reward:.3g}" if isinstance(reward, int | float) else "")
            + "), so every group-centred advantage is 0"
        )
    else:
        of = (
            f" ({int(flat)} of {int(groups)} groups had equal rewards)"
            if isinstance(groups, int | float) and isinstance(flat, int | float)
            else ""
        )
        cause = f"the advantage estimator gave 0 to every sample{of} and no teacher added a term"
    return (
        f"step {step}: no learning signal: {cause}; every training token's advantage is 0 "
        "(train/zero_advantage_fraction 1.0), so the policy gradient is 0 and the rewards teach "
        "nothing. To get a signal: more samples per task (env.samples_per_task) so a group's rewards can "
        "differ; a task mix the model sometimes solves and sometimes fails (easier tasks if every "
        "reward is the lowest, harder ones if every reward is the highest; or check the verifier); "
        "a teacher (on-policy distillation: model.teacher and trainer.opd.kl_coef > 0); or another "
        "trainer.advantage_estimator. Warned once; both metrics are in every step's row."
    )


class NoSignalWarning:
    """A tracker that warns, once, when a trained step had no learning signal
    (``train/zero_advantage_fraction`` >= 1), and at `close` how many steps had none.
    Steps without the metric (nothing trained, or an evaluation row) are not counted."""

    def __init__(self) -> None:
        self.trained = 0
        self.without: list[int] = []

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        fraction = metrics.get("train/zero_advantage_fraction")
        if not isinstance(fraction, int | float) or math.isnan(fraction):
            return
        self.trained += 1
        if fraction >= 1.0:
            if not self.without:
                log.warning("%s", no_signal_message(step, metrics))
            self.without.append(step)

    def close(self) -> None:
        if self.without:
            log.warning(
                "no learning signal in %d of %d trained steps (the first: step %d; see the warning there)",
                len(self.without),
                self.trained,
                self.without[0],
            )


class MultiTracker:
    def __init__(self, trackers: Sequence[Tracker]):
        self.trackers = list(trackers)

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        for t in self.trackers:
            t.log(metrics, step)

    def close(self) -> None:
        for t in self.trackers:
            t.close()


def make_tracker(
    options: LoggingOptions,
    output_dir: str | Path,
    *,
    run_name: str,
    config: Mapping[str, Any],
    fresh: bool = True,
) -> MultiTracker:
    """metrics.jsonl always (started over when `fresh`, appended to on resume) and the no-signal
    warning; TensorBoard and W&B as `options` say and as installed (a missing package is one
    warning, not a failed run)."""
    output_dir = Path(output_dir)
    trackers: list[Tracker] = [
        JsonlTracker(output_dir / "metrics.jsonl", append=not fresh),
        NoSignalWarning(),
    ]
    if options.tensorboard_dir:
        try:
            trackers.append(TensorBoardTracker(output_dir / options.tensorboard_dir))
        except ImportError as exc:
            log.warning("TensorBoard is off: %s (pip install tensorboard)", exc)
    if options.wandb_project and options.wandb_mode != "disabled":
        try:
            trackers.append(
                WandbTracker(options.wandb_project, options.wandb_mode, run_name, output_dir, config)
            )
        except ImportError:
            log.warning("W&B is off: wandb is not installed (pip install wandb)")
    return MultiTracker(trackers)


def _fmt(value: float) -> str:
    if not math.isfinite(value):
        return str(value)
    if value != 0 and (abs(value) >= 1e4 or abs(value) < 1e-3):
        return f"{value:.2e}"
    return f"{value:.3f}" if abs(value) < 10 else f"{value:.1f}"


# (key, label) in the order a reader scans a step: progress, reward, data, loss, health, time.
CONSOLE_KEYS: tuple[tuple[str, str], ...] = (
    ("rollout/reward_mean", "reward"),
    ("rollout/reward_std", "±"),
    ("rollout/samples", "samples"),
    ("rollout/staleness_max", "lag"),
    ("rollout/dropped", "dropped"),
    ("train/loss", "loss"),
    ("train/kl", "kl"),
    ("train/entropy", "ent"),
    ("train/grad_norm", "gnorm"),
    ("opd/reverse_kl", "opd_kl"),
    ("mismatch/logprob_abs_diff", "mismatch"),
    ("train/weight_version", "v"),
    ("eval/accuracy", "eval_acc"),
    ("perf/step_wall_s", "step_s"),
    ("perf/gen_s", "gen_s"),
    ("perf/train_s", "train_s"),
    ("perf/sync_s", "sync_s"),
    ("perf/wait_s", "wait_s"),
)


def console_line(step: int, steps: int, metrics: Mapping[str, Any]) -> str:
    """`step 3/20 | reward 0.250±0.433 samples 32 ... | step_s 4.1 gen_s 2.0 ...` — one line."""
    parts = [f"step {step}/{steps}"]
    for key, label in CONSOLE_KEYS:
        value = metrics.get(key)
        if not isinstance(value, int | float):
            continue
        if label == "±":
            parts[-1] += f"±{_fmt(float(value))}"
        elif label in ("samples", "v", "dropped", "lag"):
            parts.append(f"{label} {int(value)}")
        else:
            parts.append(f"{label} {_fmt(float(value))}")
    return " ".join(parts)
