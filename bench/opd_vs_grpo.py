"""GRPO alone, OPD alone and GRPO+OPD on the demo's task: steps to 90 % of the teacher's accuracy.

    .venv/bin/python bench/opd_vs_grpo.py                          # 3 arms x 60 steps, eval every 10
    .venv/bin/python bench/opd_vs_grpo.py --arms opd,grpo --steps 100 --eval-every 10
    .venv/bin/python bench/opd_vs_grpo.py --task worked_steps --steps 200 --eval-every 10

`--task sums` (default) is the demo's: single-digit sums whose answers are one or two tokens, so
a per-token teacher has nothing to add over the per-answer reward and the arms look alike.
`--task worked_steps` is where per-token credit matters: "Start with 7, add 5, multiply by 3,
subtract 9. Show each step." answered one line per step (23-29 tokens) and rewarded only on the
final answer, from the worked-steps warm start (`demo-steps-student`, teacher `demo-steps-teacher`:
palaestra/models/warmstart.py) with up to 48 new tokens per answer.

Every arm is a real `palaestra train` run (the Python API, the CLI's code path) of
configs/demo.yaml — the warm-started student on 2 embedded engines behind sglang-router, the
gateway, the math environment's agents, the Megatron trainer, all on a local Ray — with the same
seeds and task order, from the same student weights. Only the objective differs:

* `grpo`: GRPO advantages, no teacher (model.teacher=null, trainer.opd_kl_coef=0);
* `opd`: on-policy distillation alone — advantage_estimator=none, so every token's advantage is
  −β·(log π_student − log π_teacher) and rewards are ignored;
* `grpo+opd`: both (the demo's setting).

The teacher's held-out accuracy is measured first (a 0-step run of the teacher); the target is
`--target` x that. Held-out accuracy is greedy on `--eval-tasks` tasks (default 400), measured
through the stack every `--eval-every` steps, so steps-to-target has that resolution. Prints each
arm's curve, the first evaluated step at target ("not reached within N" otherwise), the ratio of
those counts and each arm's wall time.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from demo_runs import CONFIG, train_demo

from palaestra.config import load_config

ARMS = {
    "grpo": ["model.teacher=null", "trainer.opd_kl_coef=0", "trainer.teacher_mode=null",
             "trainer.teacher_model=null"],
    "opd": ["trainer.advantage_estimator=none"],
    "grpo+opd": [],
}  # fmt: skip


TASKS = {
    "sums": [],
    "worked_steps": ["model.student=demo-steps-student", "model.teacher=demo-steps-teacher",
                     "env.args.kinds=[worked_steps]", "env.args.max_tokens=48", "gateway.default_max_tokens=48"],
}  # fmt: skip


def run(name: str, out: Path, overrides: list[str]) -> tuple[list[tuple[int, float]], float]:
    """(step, held-out accuracy) pairs of one run (step 0: before training), and its wall seconds."""
    started = time.perf_counter()
    rows = train_demo(out, name, overrides).state.rows
    curve = [(int(r["train/step"]), r["eval/accuracy"]) for r in rows if "eval/accuracy" in r]
    return curve, time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arms", default=",".join(ARMS), help="comma-separated subset of grpo, opd, grpo+opd")
    ap.add_argument(
        "--task", choices=sorted(TASKS), default="sums", help="task family (default: %(default)s)"
    )
    ap.add_argument("--steps", type=int, default=60, help="training steps per arm (default: %(default)s)")
    ap.add_argument(
        "--eval-every", type=int, default=10, help="steps between evaluations (default: %(default)s)"
    )
    ap.add_argument(
        "--eval-tasks", type=int, default=400, help="held-out tasks per evaluation (default: %(default)s)"
    )
    ap.add_argument(
        "--target", type=float, default=0.9, help="fraction of the teacher's accuracy (default: %(default)s)"
    )
    ap.add_argument(
        "overrides",
        nargs="*",
        help="more dotted config overrides for every arm, e.g. trainer.megatron_optimizer.lr=2e-4",
    )
    args = ap.parse_args(argv)  # fmt: skip
    task = TASKS[args.task]  # first, so that an arm's own overrides (grpo: no teacher) win
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    unknown = sorted(set(arms) - set(ARMS))
    if unknown:
        ap.error(f"unknown arms {unknown}; choose from {list(ARMS)}")
    results: dict[str, tuple[list[tuple[int, float]], float]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-opd-") as tmp:
        teacher_cfg = load_config(CONFIG, task)
        (teacher_curve, _) = run("teacher", Path(tmp) / "teacher", [*task,
            f"model.student={teacher_cfg.model.teacher}", *ARMS["grpo"], "run.steps=0", f"env.eval_tasks={args.eval_tasks}", *args.overrides])  # fmt: skip
        teacher_acc = teacher_curve[0][1]
        target = args.target * teacher_acc
        print(f"teacher held-out accuracy {teacher_acc:.3f} -> target {target:.3f}", flush=True)
        common = [f"run.steps={args.steps}", f"env.eval_every={args.eval_every}",
                  f"env.eval_tasks={args.eval_tasks}", *args.overrides]  # fmt: skip
        for arm in arms:
            results[arm] = run(arm, Path(tmp) / arm, [*task, *ARMS[arm], *common])
            print(f"{arm}: {' '.join(f'{s}:{a:.2f}' for s, a in results[arm][0])}", flush=True)

    print(f"\n== {CONFIG.name} --task {args.task} {' '.join(args.overrides)}: teacher {teacher_acc:.3f}, "
          f"target {args.target:.0%} of it = {target:.3f}")  # fmt: skip
    reached: dict[str, int | None] = {}
    for arm, (curve, wall) in results.items():
        reached[arm] = next((s for s, a in curve if a >= target), None)
        when = (
            f"{reached[arm]} steps"
            if reached[arm] is not None
            else f"not reached within {curve[-1][0]} steps"
        )
        print(f"{arm:9s} {curve[0][1]:.3f} -> {curve[-1][1]:.3f} (best {max(a for _, a in curve):.3f}); "
              f"target: {when}; {wall:.0f} s")  # fmt: skip
        print(f"          curve {' '.join(f'{s}:{a:.2f}' for s, a in curve)}")
    # The same question at lower bars, where 90 % of the teacher is out of reach in this budget.
    start = min(curve[0][1] for curve, _ in results.values())
    levels = [round(start + 0.05 * i, 2) for i in range(1, 20) if start + 0.05 * i < target + 0.05]
    if levels:
        print("\nfirst evaluated step at or above each accuracy ('-': not reached)")
        print(f"{'accuracy':>9s} " + " ".join(f"{arm:>9s}" for arm in results))
        for level in levels:
            firsts = [next((s for s, a in curve if a >= level), None) for curve, _ in results.values()]
            print(f"{level:9.2f} " + " ".join(f"{'-' if f is None else f:>9}" for f in firsts))
    for a, b in (("opd", "grpo"), ("grpo+opd", "grpo")):
        if a in reached and b in reached:
            sa, sb = reached[a], reached[b]
            if sa is not None and sb is not None:
                print(f"steps to target {a} / {b}: {sa} / {sb} = {sa / sb:.2f} (goal for OPD: <= 0.20)")
            elif sa is not None:  # b did not get there: the ratio is below sa / (its last step)
                last = results[b][0][-1][0]
                print(
                    f"steps to target {a} / {b}: {sa} / not reached within {last} = below {sa / last:.2f} "
                    f"(goal for OPD: <= 0.20)"
                )
            else:
                print(
                    f"steps to target {a} / {b}: {sa or 'not reached'} / {sb or 'not reached'} (ratio undefined)"
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
