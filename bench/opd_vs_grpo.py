"""GRPO against on-policy distillation at each granularity, and GRPO+OPD: samples and seconds to target.

    .venv/bin/python -m bench.opd_vs_grpo --task worked_steps --steps 60 --eval-every 10 \
        trainer.megatron_optimizer.lr=3e-4                       # the five arms (docs/opd.md)
    .venv/bin/python -m bench.opd_vs_grpo --arms opd-full,grpo --steps 100
    .venv/bin/python -m bench.opd_vs_grpo --task sums            # the demo's task

`--task worked_steps` is where per-token credit matters: "Start with 7, add 5, multiply by 3,
subtract 9. Show each step." answered one line per step (23-29 tokens) and rewarded only on the
final answer, from the worked-steps warm start (`demo-steps-student`, teacher `demo-steps-teacher`:
environments/math/warmstart.py) with up to 48 new tokens per answer. `--task sums` is the demo's:
single-digit sums whose answers are one or two tokens, so a per-token teacher has nothing to add
over the per-answer reward.

Every arm is a real `palaestra train` run (the Python API, the CLI's code path) of
configs/demo.yaml — the warm-started student on 2 embedded engines behind sglang-router, the
gateway, the math environment's agents, the Megatron trainer, all on a local Ray — with the same
seeds and task order, from the same student weights. Only the objective differs:

* `grpo`: GRPO advantages, no teacher (model.teacher=null, trainer.opd.kl_coef=0);
* `opd`, `opd-topk`, `opd-full`: on-policy distillation alone (advantage_estimator=none: rewards
  ignored) at granularity `sampled` (Â_t = −β·(log π_student − log π_teacher) of the sampled
  token), `topk` (the exact reverse KL over the student's top trainer.opd.topk tokens) or `full`
  (over the vocabulary);
* `grpo+opd`: GRPO advantages plus the `full` distillation term.

The teacher's held-out accuracy is measured first (a 0-step run of the teacher; `--teacher-acc`
gives it instead); the target is `--target` x that. Held-out accuracy is greedy on `--eval-tasks`
tasks, measured through the stack every `--eval-every` steps, so steps-to-target has that
resolution. Prints each arm's accuracy and reverse-KL curves, the first evaluated step at target
as steps, samples (steps x samples per step) and seconds (the training steps' wall time up to it,
evaluations excluded), each OPD arm's ratio to GRPO (a bound when GRPO misses the target within
the budget), and where a step's time goes (generation, teacher scoring, update, weight sync,
evaluation).
"""

from __future__ import annotations

import json
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from bench import common
from bench.common import CONFIG, train_demo
from palaestra.config import load_config

OPD = ["trainer.advantage_estimator=none"]
ARMS = {
    "grpo": ["model.teacher=null", "trainer.opd.kl_coef=0", "trainer.opd.teacher_mode=null",
             "trainer.opd.teacher_model=null"],
    "opd": [*OPD, "trainer.opd.granularity=sampled"],
    "opd-topk": [*OPD, "trainer.opd.granularity=topk"],
    "opd-full": [*OPD, "trainer.opd.granularity=full"],
    "grpo+opd": ["trainer.opd.granularity=full"],
}  # fmt: skip


TASKS = {
    "sums": [],
    "worked_steps": ["model.student=demo-steps-student", "model.teacher=demo-steps-teacher",
                     "env.args.kinds=[worked_steps]", "env.args.max_tokens=48", "gateway.default_max_tokens=48"],
}  # fmt: skip

# Where a step's time goes: the step's own timings (orchestrator and trainer), seconds per step.
PROFILE = (
    ("generate", "perf/gen_s"),  # the rollouts, through gateway, router and engines
    ("old pass", "perf/score_s"),  # the student's pre-update logprobs (and top-k ids), advantages
    ("teacher", "perf/teacher_s"),  # teacher scoring at the arm's granularity
    ("update", "perf/update_s"),  # forward + backward + optimizer
    ("sync", "perf/sync_s"),  # weights to the engines
    ("step", "perf/step_wall_s"),  # the whole step, wall
)


@dataclass
class Arm:
    rows: list[dict[str, float]]  # the run's metrics rows (row 0: the evaluation before training)
    wall: float  # the whole run: start-up, steps, evaluations

    @property
    def curve(self) -> list[tuple[int, float]]:
        """(step, held-out accuracy) at each evaluation (step 0: before training)."""
        return [(int(r["train/step"]), r["eval/accuracy"]) for r in self.rows if "eval/accuracy" in r]

    def seconds_to(self, step: int) -> float:
        """The training steps' wall time up to `step` (evaluations and start-up excluded)."""
        return sum(r.get("perf/step_wall_s", 0.0) for r in self.rows if 0 < r["train/step"] <= step)

    def window_mean(self, key: str, lo: int, hi: int) -> float | None:
        """Mean of `key` over steps lo < step <= hi (None when no row has it)."""
        vals = [r[key] for r in self.rows if lo < r["train/step"] <= hi and key in r]
        return sum(vals) / len(vals) if vals else None


def run(name: str, out: Path, overrides: list[str]) -> Arm:
    started = time.perf_counter()
    rows = train_demo(out, name, overrides).state.rows
    return Arm(rows, time.perf_counter() - started)


def _ratio(what: str, a: float | None, b: float | None, b_bound: float) -> str:
    """a / b, or a bound when b did not reach the target within b_bound."""
    if a is None:
        return f"{what}: not reached / {'not reached' if b is None else f'{b:.0f}'} (ratio undefined)"
    if b is None:
        return f"{what}: {a:.0f} / not reached within {b_bound:.0f} = below {a / b_bound:.3f}"
    return f"{what}: {a:.0f} / {b:.0f} = {a / b:.3f}"


def main(argv: list[str] | None = None) -> int:
    ap = common.parser(__doc__)
    ap.add_argument("--arms", default=",".join(ARMS), help="comma-separated subset of " + ", ".join(ARMS))
    ap.add_argument(
        "--task", choices=sorted(TASKS), default="worked_steps", help="task family (default: %(default)s)"
    )
    ap.add_argument("--steps", type=int, default=60, help="training steps per arm (default: %(default)s)")
    ap.add_argument(
        "--eval-every", type=int, default=10, help="steps between evaluations (default: %(default)s)"
    )
    ap.add_argument(
        "--eval-tasks", type=int, default=200, help="held-out tasks per evaluation (default: %(default)s)"
    )
    ap.add_argument(
        "--target", type=float, default=0.9, help="fraction of the teacher's accuracy (default: %(default)s)"
    )
    ap.add_argument(
        "--target-acc",
        type=float,
        default=None,
        help="an absolute held-out accuracy as the target instead (the teacher is still measured)",
    )
    ap.add_argument(
        "--teacher-acc",
        type=float,
        default=None,
        help="the teacher's held-out accuracy, measured before on the same tasks (skips its 0-step run)",
    )
    ap.add_argument("--json", default=None, help="also write every arm's metrics rows to this file")
    ap.add_argument(
        "overrides",
        nargs="*",
        help="more dotted config overrides for every arm, e.g. trainer.megatron_optimizer.lr=3e-4",
    )
    args = ap.parse_args(argv)  # fmt: skip
    task = TASKS[args.task]  # first, so that an arm's own overrides (grpo: no teacher) win
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    unknown = sorted(set(arms) - set(ARMS))
    if unknown:
        ap.error(f"unknown arms {unknown}; choose from {list(ARMS)}")
    shared = [f"run.steps={args.steps}", f"env.eval_every={args.eval_every}",
              f"env.eval_tasks={args.eval_tasks}", *args.overrides]  # fmt: skip
    cfg = load_config(CONFIG, [*task, *shared])
    per_step = cfg.env.tasks_per_step * cfg.env.samples_per_task
    results: dict[str, Arm] = {}
    with tempfile.TemporaryDirectory(prefix="bench-opd-") as tmp:
        teacher_acc = args.teacher_acc
        if teacher_acc is None:
            teacher = run("teacher", Path(tmp) / "teacher", [*task, f"model.student={cfg.model.teacher}",
                          *ARMS["grpo"], "run.steps=0", f"env.eval_tasks={args.eval_tasks}", *args.overrides])  # fmt: skip
            teacher_acc = teacher.curve[0][1]
        target = args.target_acc if args.target_acc is not None else args.target * teacher_acc
        print(f"teacher held-out accuracy {teacher_acc:.3f} -> target {target:.3f}", flush=True)
        for arm in arms:
            results[arm] = run(arm, Path(tmp) / arm, [*task, *ARMS[arm], *shared])
            print(f"{arm}: {' '.join(f'{s}:{a:.3f}' for s, a in results[arm].curve)}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({a: r.rows for a, r in results.items()}))

    label = f"{args.target:.0%} of it" if args.target_acc is None else "absolute"
    print(f"\n== {CONFIG.name} --task {args.task} {' '.join(args.overrides)}: teacher {teacher_acc:.3f}, "
          f"target {target:.3f} ({label}); {per_step} samples per step, {args.eval_tasks} held-out "
          f"tasks (one task: standard error {(target * (1 - target) / args.eval_tasks) ** 0.5:.3f})")  # fmt: skip
    reached: dict[str, int | None] = {}
    for arm, r in results.items():
        curve = r.curve
        reached[arm] = next((s for s, a in curve if a >= target), None)
        when = (
            f"step {reached[arm]}, {reached[arm] * per_step} samples, {r.seconds_to(reached[arm]):.0f} s"
            if reached[arm] is not None
            else f"not reached within {curve[-1][0]} steps ({curve[-1][0] * per_step} samples, "
            f"{r.seconds_to(curve[-1][0]):.0f} s)"
        )
        print(f"{arm:9s} {curve[0][1]:.3f} -> {curve[-1][1]:.3f} (best {max(a for _, a in curve):.3f}); "
              f"target: {when}; run {r.wall:.0f} s")  # fmt: skip
        print(f"          accuracy {' '.join(f'{s}:{a:.3f}' for s, a in curve)}")
        for key, what in (("opd/reverse_kl", "k1 on the sampled tokens"),
                          ("opd/teacher/reverse_kl", "the route's: exact D_t for topk/full")):  # fmt: skip
            kl = [(s, r.window_mean(key, p, s)) for (p, _), (s, _) in zip(curve, curve[1:], strict=False)]
            if any(v is not None for _, v in kl):  # the mean over each window between evaluations
                print(f"          reverse KL per token ({what}) step 1: {r.window_mean(key, 0, 1):.3f}, then "
                      f"{' '.join(f'{s}:{v:.3f}' for s, v in kl if v is not None)}")  # fmt: skip
    # the same question at lower bars, where the target is out of reach in this budget
    start = min(r.curve[0][1] for r in results.values())
    levels = [round(start + 0.05 * i, 2) for i in range(1, 20) if start + 0.05 * i < target + 0.05]
    if levels:
        print("\nfirst evaluated step at or above each accuracy ('-': not reached)")
        print(f"{'accuracy':>9s} " + " ".join(f"{arm:>9s}" for arm in results))
        for level in levels:
            firsts = [next((s for s, a in r.curve if a >= level), None) for r in results.values()]
            print(f"{level:9.2f} " + " ".join(f"{'-' if f is None else f:>9}" for f in firsts))
    if "grpo" in results:
        g = results["grpo"]
        g_last = g.curve[-1][0]
        print("\nto target, against grpo (goal for OPD: samples ratio <= 0.20)")
        for arm, r in results.items():
            if arm == "grpo":
                continue
            s_a, s_g = reached[arm], reached["grpo"]
            print(f"{arm:9s} " + _ratio(
                "samples", None if s_a is None else s_a * per_step, None if s_g is None else s_g * per_step,
                g_last * per_step) + "; " + _ratio(
                "seconds", None if s_a is None else r.seconds_to(s_a), None if s_g is None else g.seconds_to(s_g),
                g.seconds_to(g_last)))  # fmt: skip
    print("\nseconds per step (mean over the run)")
    print(f"{'':9s} " + " ".join(f"{name:>9s}" for name, _ in PROFILE) + f" {'eval+start':>10s}")
    for arm, r in results.items():
        steps = r.curve[-1][0]
        cells = [r.window_mean(key, 0, steps) for _, key in PROFILE]
        other = r.wall - r.seconds_to(steps)  # start-up, evaluations, shutdown
        print(f"{arm:9s} " + " ".join(f"{'-' if c is None else f'{c:.2f}':>9s}" for c in cells)
              + f" {other:10.0f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
