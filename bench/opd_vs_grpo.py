"""GRPO against on-policy distillation at each granularity, and GRPO+OPD: samples and seconds to target.

    .venv/bin/python -m bench.opd_vs_grpo --task worked_steps --steps 60 --eval-every 10 \
        trainer.megatron_optimizer.lr=3e-4                       # the five arms (docs/opd.md)
    .venv/bin/python -m bench.opd_vs_grpo --arms opd-full,grpo --steps 100
    .venv/bin/python -m bench.opd_vs_grpo --task sums            # the demo's task
    .venv/bin/python -m bench.opd_vs_grpo --task worked_steps_rl --arms grpo-ds,opd-full,opd,grpo+opd \
        --seeds grpo-ds=3,opd-full=3 --target-acc 0.5 --png opd_vs_grpo.png   # both ends measured

`--task worked_steps` is where per-token credit matters: "Start with 7, add 5, multiply by 3,
subtract 9. Show each step." answered one line per step (23-29 tokens) and rewarded only on the
final answer, from the worked-steps warm start (`demo-steps-student`, teacher `demo-steps-teacher`:
environments/math/warmstart.py) with up to 48 new tokens per answer. `--task worked_steps_rl` is
the same task from a student RL can learn from (`demo-steps-student-rl`: the same SFT run stopped
later, at a held-out accuracy of ~0.3) in groups of 8, so that most groups have reward variance.
`--task sums` is the demo's: single-digit sums whose answers are one or two tokens, so a per-token
teacher has nothing to add over the per-answer reward.

Every arm is a real `palaestra train` run (the Python API, the CLI's code path) of
configs/demo.yaml — the warm-started student on 2 embedded engines behind sglang-router, the
gateway, the math environment's agents, the Megatron trainer, all on a local Ray — with the same
seeds and task order, from the same student weights. Only the objective differs:

* `grpo`: GRPO advantages, no teacher (model.teacher=null, trainer.opd.kl_coef=0);
* `grpo-ds`: GRPO with dynamic sampling (trainer.dynamic_sampling: flat groups dropped and the
  step refilled; the RL baseline);
* `opd`, `opd-topk`, `opd-full`: on-policy distillation alone (advantage_estimator=none: rewards
  ignored) at granularity `sampled` (Â_t = −β·(log π_student − log π_teacher) of the sampled
  token), `topk` (the exact reverse KL over the student's top trainer.opd.topk tokens) or `full`
  (over the vocabulary);
* `grpo+opd`: GRPO advantages plus the `full` distillation term.

`--seeds arm=n,...` runs an arm n times (run.seed 0..n-1: another task order and other samples;
the held-out tasks stay the same; 0: its sweep only); `--lr arm=value,...` sets an arm's learning rate, and
`--sweep lr1,lr2,...` first runs each arm once at each of them for `--sweep-steps` steps and keeps
the one with the best last held-out accuracy (the earlier lr on a tie).

The teacher's held-out accuracy is measured first (a 0-step run of the teacher; `--teacher-acc`
gives it instead); the target is `--target` x that, or `--target-acc`, fixed before any arm runs.
Held-out accuracy is greedy on `--eval-tasks` tasks, measured through the stack every
`--eval-every` steps, so steps-to-target has that resolution; `--stop-at-target` ends each seed's
run at its first evaluation at or above the target (the rest of the budget is not spent; an
evaluation that fewer seeds reached prints their count in brackets). Prints each arm's accuracy (mean ±
standard error over its seeds at each evaluation) and reverse-KL curves, the first evaluated step
at target with the samples generated (dynamic sampling's dropped groups included:
`rollout/samples_generated`) and trained up to it and the seconds (the training steps' wall time up
to it, evaluations excluded), each arm's ratio of generated samples to the RL baseline's (`grpo-ds`,
else `grpo`) with its spread over the seeds that reached it, and where a seed missed it
the ratio with each missed seed counted at its budget (samples and seconds to the end of its run: an
upper bound when only baseline seeds missed), and where a step's time goes (generation; the old,
reference and advantage passes; teacher scoring; update; weight sync). `--png`
draws held-out accuracy against samples generated, one line per arm with its seeds' band, the
teacher's level as a line (`make demo-opd`).
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from bench import common
from bench.common import CONFIG, mean_se, train_demo
from palaestra.config import load_config
from palaestra.orchestrator.loop import Hook

OPD = ["trainer.advantage_estimator=none"]
GRPO = ["model.teacher=null", "trainer.opd.kl_coef=0", "trainer.opd.teacher_mode=null",
        "trainer.opd.teacher_model=null"]  # fmt: skip
ARMS = {
    "grpo": GRPO,
    "grpo-ds": [*GRPO, "trainer.dynamic_sampling.enabled=true"],
    "opd": [*OPD, "trainer.opd.granularity=sampled"],
    "opd-topk": [*OPD, "trainer.opd.granularity=topk"],
    "opd-full": [*OPD, "trainer.opd.granularity=full"],
    "grpo+opd": ["trainer.opd.granularity=full"],
}  # fmt: skip
DEFAULT_ARMS = ("grpo", "opd", "opd-topk", "opd-full", "grpo+opd")

STEPS = ["env.args.kinds=[worked_steps]", "env.args.max_tokens=48", "gateway.default_max_tokens=48"]
TASKS = {
    "sums": [],
    "worked_steps": ["model.student=demo-steps-student", "model.teacher=demo-steps-teacher", *STEPS],
    "worked_steps_rl": ["model.student=demo-steps-student-rl", "model.teacher=demo-steps-teacher", *STEPS,
                        "env.samples_per_task=8", "env.tasks_per_step=8"],
}  # fmt: skip

# Where a step's time goes: the step's own timings (orchestrator and trainer), seconds per step.
PROFILE = (
    ("generate", "perf/gen_s"),  # the rollouts, through gateway, router and engines
    # Trainer.step's perf/score_s: the student's pre-update logprobs when they need a pass of their
    # own (top-k ids: opd-topk; else the update's forward gives them: Trainer.separate_old_pass),
    # the reference's logprobs (trainer.kl.coef > 0), the advantages with their per-token inputs and
    # keep_old_actor's copy of the weights
    ("old+ref+adv", "perf/score_s"),
    ("teacher", "perf/teacher_s"),  # teacher scoring at the arm's granularity
    ("update", "perf/update_s"),  # forward + backward + optimizer
    ("sync", "perf/sync_s"),  # weights to the engines
    ("step", "perf/step_wall_s"),  # the whole step, wall
)


@dataclass
class Arm:
    rows: list[dict[str, float]]  # the run's metrics rows (row 0: the evaluation before training)
    wall: float  # the whole run: start-up, steps, evaluations
    per_step: int = 0  # samples per step without dynamic sampling (rows of older runs lack the counts)

    @property
    def curve(self) -> list[tuple[int, float]]:
        """(step, held-out accuracy) at each evaluation (step 0: before training)."""
        return [(int(r["train/step"]), r["eval/accuracy"]) for r in self.rows if "eval/accuracy" in r]

    def seconds_to(self, step: int) -> float:
        """The training steps' wall time up to `step` (evaluations and start-up excluded)."""
        return sum(r.get("perf/step_wall_s", 0.0) for r in self.rows if 0 < r["train/step"] <= step)

    def samples_to(self, step: int, trained: bool = False) -> float:
        """Samples generated (every group looked at, dropped ones included) or trained up to `step`."""
        key = "rollout/samples" if trained else "rollout/samples_generated"
        return sum(r.get(key, self.per_step) for r in self.rows if 0 < r["train/step"] <= step and
                   "perf/step_wall_s" in r)  # fmt: skip

    def reached(self, target: float) -> int | None:
        """The first evaluated step at or above `target` (None: not within the run)."""
        return next((s for s, a in self.curve if a >= target), None)

    @property
    def lr(self) -> float | None:
        """The learning rate the run trained with: its rows' `train/lr` (None: it trained no step),
        so that runs read back with `--load` keep theirs."""
        return next((r["train/lr"] for r in self.rows if "train/lr" in r), None)

    def window_mean(self, key: str, lo: int, hi: int) -> float | None:
        """Mean of `key` over steps lo < step <= hi (None when no row has it)."""
        vals = [r[key] for r in self.rows if lo < r["train/step"] <= hi and key in r]
        return sum(vals) / len(vals) if vals else None


class Reached(Exception):
    """Ends a run at its first evaluation at or above the target (`--stop-at-target`)."""

    def __init__(self, rows: list[dict[str, float]]):
        super().__init__(f"target reached at step {int(rows[-1]['train/step'])}")
        self.rows = rows


def stop_at(target: float | None) -> Hook | None:
    """`train`'s hook that raises `Reached` (with the rows so far) at the end of the first step
    whose evaluation is at or above `target`; None: the run goes to its last step."""
    if target is None:
        return None

    def hook(phase: str, step: int, run) -> None:
        row = run.state.rows[-1] if run.state.rows else {}
        if phase == "step" and row.get("eval/accuracy", -1.0) >= target:
            raise Reached(list(run.state.rows))

    return hook


def run(name: str, out: Path, overrides: list[str], per_step: int = 0, stop: float | None = None) -> Arm:
    """One `palaestra train` run of the demo config; `stop`: end it at that held-out accuracy."""
    started = time.perf_counter()
    try:
        rows = train_demo(out, name, overrides, stop_at(stop)).state.rows
    except Reached as reached:  # the cluster is shut down on the way out, as at a run's end
        rows = reached.rows
    return Arm(rows, time.perf_counter() - started, per_step)


def lr_label(runs: list[Arm], default: str = "lr: the config's") -> str:
    """The learning rate(s) an arm's runs trained with, e.g. `lr 0.0003` (`default` when no run
    recorded one)."""
    lrs = sorted({r.lr for r in runs if r.lr is not None})
    return "lr " + "/".join(f"{lr:g}" for lr in lrs) if lrs else default


def evaluated(runs: list[Arm]) -> list[int]:
    """Every step some seed evaluated (a run stopped at the target ends before the others)."""
    return sorted({s for r in runs for s, _ in r.curve})


def _pm(values: list[float], fmt: str = ".3f") -> str:
    m, se = mean_se(values)
    return f"{m:{fmt}}" if len(values) == 1 else f"{m:{fmt}}±{se:{fmt}}"


def per_arm(text: str, arms: list[str], what: str, cast=int) -> dict[str, object]:
    """`arm=value,...` (or one bare value for every arm) as {arm: value}."""
    out: dict[str, object] = {}
    for part in common.csv(text):
        arm, _, value = part.rpartition("=")
        for a in [arm] if arm else arms:
            if a not in ARMS:
                raise SystemExit(f"{what}: unknown arm {a!r}; choose from {list(ARMS)}")
            try:
                out[a] = cast(value)
            except ValueError:
                raise SystemExit(
                    f"{what}: {value!r} is not a {cast.__name__} (write arm=value,...)"
                ) from None
    return out


@dataclass(frozen=True)
class Cost:
    """One seed's samples generated and training seconds to the target: up to its first evaluation
    at or above it, or (`reached` False) up to the end of its run, its budget, which the seed's
    real cost is above."""

    samples: float
    seconds: float
    reached: bool

    @classmethod
    def of(cls, run: Arm, target: float) -> Cost:
        step = run.reached(target)
        end = step if step is not None else run.curve[-1][0]
        return cls(run.samples_to(end), run.seconds_to(end), step is not None)


def budget_bound(costs: list[Cost], base_costs: list[Cost]) -> str:
    """The ratio of the means with every missed seed counted at its budget, per measure: an upper
    bound when only the baseline missed seeds (its real mean is higher), a lower bound when only
    the arm did; "" when every seed reached the target. Leaving a missed baseline seed out of the
    mean instead would make the baseline look faster than it is."""
    missed, base_missed = sum(not c.reached for c in costs), sum(not c.reached for c in base_costs)
    if not missed and not base_missed:
        return ""
    sign = ">=" if not base_missed else "<=" if not missed else "~"
    parts = []
    for what in ("samples", "seconds"):
        num = statistics.fmean(getattr(c, what) for c in costs)
        den = statistics.fmean(getattr(c, what) for c in base_costs)
        bound = f"{num / den:.3f}" if den > 0 else "inf"
        parts.append(
            f"{what}: ratio {sign} {bound} counting {missed + base_missed} missed seed(s) at their budget"
        )
    caveat = " (no bound: both sides missed seeds)" if missed and base_missed else ""
    return "; " + "; ".join(parts) + caveat


def ratio_line(arm: str, runs: list[Arm], base: str, base_runs: list[Arm], target: float) -> str:
    """Samples generated and seconds to target against the baseline's: the ratio of the means of
    the seeds that reached it and its spread (the lowest and highest ratio over every pair of
    seeds), and where a seed missed it, the ratio with each missed seed counted at its budget."""
    costs = [Cost.of(r, target) for r in runs]
    base_costs = [Cost.of(r, target) for r in base_runs]
    a_n, a_s = [c.samples for c in costs if c.reached], [c.seconds for c in costs if c.reached]
    b_n, b_s = [c.samples for c in base_costs if c.reached], [c.seconds for c in base_costs if c.reached]
    reach = f"{len(a_n)}/{len(runs)} seeds vs {len(b_n)}/{len(base_runs)}"
    bound = budget_bound(costs, base_costs)
    if not a_n:
        return f"{arm:9s} not reached ({reach}){bound}"
    if not b_n:
        return f"{arm:9s} samples {_pm(a_n, '.0f')}, seconds {_pm(a_s, '.0f')}; {base} not reached ({reach}){bound}"
    pairs = [x / y for x in a_n for y in b_n]
    return (f"{arm:9s} samples {_pm(a_n, '.0f')} / {_pm(b_n, '.0f')} = {statistics.fmean(a_n) / statistics.fmean(b_n):.3f} "
            f"(pairs {min(pairs):.3f}-{max(pairs):.3f}); seconds {_pm(a_s, '.0f')} / {_pm(b_s, '.0f')} = "
            f"{statistics.fmean(a_s) / statistics.fmean(b_s):.3f} ({reach}"
            + ("; seeds that missed it are left out" if bound else "")
            + ")" + bound)  # fmt: skip


def plot(path: Path, results: dict[str, list[Arm]], teacher_acc: float, target: float, title: str) -> None:
    """Held-out accuracy against samples generated: per arm the mean over seeds (x: the mean samples
    generated up to each evaluation), a band of ± one standard error, the teacher and the target."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=100)
    for arm, runs in results.items():
        steps = evaluated(runs)
        xs = [statistics.fmean(r.samples_to(s) for r in runs if s in dict(r.curve)) for s in steps]
        stats = [mean_se([dict(r.curve)[s] for r in runs if s in dict(r.curve)]) for s in steps]
        ys = [m for m, _ in stats]
        (line,) = ax.plot(
            xs,
            ys,
            marker="o",
            markersize=3,
            label=f"{arm}, {lr_label(runs, 'lr ?')} ({len(runs)} seed{'s' * (len(runs) > 1)})",
        )
        if len(runs) > 1:
            ax.fill_between(
                xs, [m - e for m, e in stats], [m + e for m, e in stats], color=line.get_color(), alpha=0.2
            )
    ax.axhline(teacher_acc, color="black", linestyle="-", linewidth=1, label=f"teacher {teacher_acc:.2f}")
    ax.axhline(target, color="gray", linestyle="--", linewidth=1, label=f"target {target:.2f}")
    ax.set_xlabel("samples generated")
    ax.set_ylabel("held-out accuracy (greedy)")
    ax.set_ylim(0, 1.02)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8, loc="center right")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = common.parser(__doc__)
    ap.add_argument(
        "--arms", default=",".join(DEFAULT_ARMS), help="comma-separated subset of " + ", ".join(ARMS)
    )
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
    ap.add_argument("--seeds", default="", help="runs per arm, arm=n,... or n for every arm (default: 1)")
    ap.add_argument("--first-seed", type=int, default=0, help="run.seed of each arm's first run (default: 0)")
    ap.add_argument("--lr", default="", help="learning rate per arm, arm=lr,... (default: the config's)")
    ap.add_argument("--sweep", default="", help="learning rates to try per arm first, comma-separated")
    ap.add_argument("--sweep-steps", type=int, default=10, help="steps of a sweep run (default: %(default)s)")
    ap.add_argument(
        "--stop-at-target",
        action="store_true",
        help="end an arm's run at its first evaluation at or above the target (saves the rest of the budget)",
    )
    ap.add_argument("--json", default=None, help="also write every run's metrics rows to this file")
    ap.add_argument("--png", default=None, help="draw accuracy against samples generated into this file")
    ap.add_argument(
        "--load",
        action="append",
        default=[],
        help="runs of an earlier --json to report with this one's (repeatable; --arms '' runs none)",
    )
    ap.add_argument(
        "overrides",
        nargs="*",
        help="more dotted config overrides for every arm, e.g. trainer.megatron_optimizer.lr=3e-4",
    )
    args = ap.parse_args(argv)  # fmt: skip
    task = TASKS[args.task]  # first, so that an arm's own overrides (grpo: no teacher) win
    arms = common.csv(args.arms)
    unknown = sorted(set(arms) - set(ARMS))
    if unknown:
        ap.error(f"unknown arms {unknown}; choose from {list(ARMS)}")
    seeds = {**dict.fromkeys(arms, 1), **per_arm(args.seeds, arms, "--seeds")}
    lrs = per_arm(args.lr, arms, "--lr", float)
    sweep = [float(x) for x in common.csv(args.sweep)]
    shared = [f"run.steps={args.steps}", f"env.eval_every={args.eval_every}",
              f"env.eval_tasks={args.eval_tasks}", *args.overrides]  # fmt: skip
    cfg = load_config(CONFIG, [*task, *shared])
    per_step = cfg.env.tasks_per_step * cfg.env.samples_per_task
    results: dict[str, list[Arm]] = {}
    for path in args.load:  # the arms of earlier runs of this bench
        for arm, runs in json.loads(Path(path).read_text()).items():
            results.setdefault(arm, []).extend(Arm(r["rows"], r["wall"], per_step) for r in runs)
    with tempfile.TemporaryDirectory(prefix="bench-opd-") as tmp:
        teacher_acc = args.teacher_acc
        if teacher_acc is None:
            teacher = run("teacher", Path(tmp) / "teacher", [*task, f"model.student={cfg.model.teacher}",
                          *ARMS["grpo"], "run.steps=0", f"env.eval_tasks={args.eval_tasks}", *args.overrides])  # fmt: skip
            teacher_acc = teacher.curve[0][1]
        target = args.target_acc if args.target_acc is not None else args.target * teacher_acc
        print(f"teacher held-out accuracy {teacher_acc:.3f} -> target {target:.3f}", flush=True)
        for arm in arms:
            if sweep and arm not in lrs:  # a short run per learning rate, the best last accuracy wins
                finals = {}
                for lr in sweep:
                    r = run(f"{arm}-lr{lr:g}", Path(tmp) / f"{arm}-lr{lr:g}", [*task, *ARMS[arm], *shared,
                            f"run.steps={args.sweep_steps}", f"env.eval_every={args.sweep_steps}",
                            f"trainer.megatron_optimizer.lr={lr}"], per_step)  # fmt: skip
                    finals[lr] = r.curve[-1][1]
                    print(f"{arm} lr {lr:g}: {' '.join(f'{s}:{a:.3f}' for s, a in r.curve)}; "
                          f"{r.seconds_to(args.sweep_steps) / args.sweep_steps:.2f} s per step, "
                          f"{r.samples_to(args.sweep_steps):.0f} samples generated ({r.wall:.0f} s)", flush=True)  # fmt: skip
                lrs[arm] = max(sweep, key=lambda lr: (finals[lr], -sweep.index(lr)))
                print(f"{arm} sweep ({args.sweep_steps} steps): " + " ".join(
                      f"lr {lr:g}: {a:.3f}" for lr, a in finals.items()) + f" -> lr {lrs[arm]:g}", flush=True)  # fmt: skip
            lr = [f"trainer.megatron_optimizer.lr={lrs[arm]}"] if arm in lrs else []
            results.setdefault(arm, [])
            for seed in range(args.first_seed, args.first_seed + seeds[arm]):
                r = run(f"{arm}-s{seed}", Path(tmp) / f"{arm}-s{seed}", [*task, *ARMS[arm], *shared, *lr,
                        f"run.seed={seed}"], per_step, target if args.stop_at_target else None)  # fmt: skip
                results[arm].append(r)
                if args.json:  # after every run, so that an interrupted bench keeps what it measured
                    done = {
                        a: [{"rows": r.rows, "wall": r.wall} for r in rs]
                        for a, rs in results.items()
                        if a in arms
                    }
                    Path(args.json).write_text(json.dumps(done))
                print(
                    f"{arm} seed {seed}: {' '.join(f'{s}:{a:.3f}' for s, a in r.curve)} ({r.wall:.0f} s)",
                    flush=True,
                )

    results = {arm: runs for arm, runs in results.items() if runs}  # --seeds arm=0: its sweep only
    label = f"{args.target:.0%} of it" if args.target_acc is None else "absolute"
    print(f"\n== {CONFIG.name} --task {args.task} {' '.join(args.overrides)}: teacher {teacher_acc:.3f}, "
          f"target {target:.3f} ({label}); {per_step} samples per step before dynamic sampling, "
          f"{args.eval_tasks} held-out tasks (one evaluation at the target: standard error "
          f"{(target * (1 - target) / args.eval_tasks) ** 0.5:.3f})")  # fmt: skip
    for arm, runs in results.items():
        given = [o.split("=", 1)[1] for o in args.overrides if o.startswith("trainer.megatron_optimizer.lr=")]
        # what the runs trained with (loaded runs too); else what this command set
        lr = lr_label(
            runs, f"lr {lrs[arm]:g}" if arm in lrs else f"lr {given[-1]}" if given else "lr: the config's"
        )
        acc = [(s, [dict(r.curve)[s] for r in runs if s in dict(r.curve)]) for s in evaluated(runs)]
        print(f"{arm:9s} {len(runs)} seed(s), {lr}; accuracy (mean±se) " + " ".join(
              f"{s}:{_pm(a)}" + (f"({len(a)})" if len(a) < len(runs) else "") for s, a in acc))  # fmt: skip
        for i, r in enumerate(runs):
            s = r.reached(target)
            last = r.curve[-1][0]
            when = (f"step {s}, {r.samples_to(s):.0f} samples generated, {r.samples_to(s, True):.0f} trained, "
                    f"{r.seconds_to(s):.0f} s" if s is not None else
                    f"not reached within {last} steps ({r.samples_to(last):.0f} generated, {r.seconds_to(last):.0f} s)")  # fmt: skip
            print(f"          run {i}: target {when}; run {r.wall:.0f} s")
        r = runs[0]
        curve = r.curve
        for key, what in (("opd/reverse_kl", "k1 on the sampled tokens"),
                          ("opd/teacher/reverse_kl", "the route's: exact D_t for topk/full")):  # fmt: skip
            kl = [(s, r.window_mean(key, p, s)) for (p, _), (s, _) in zip(curve, curve[1:], strict=False)]
            if any(v is not None for _, v in kl):  # the mean over each window between evaluations
                print(f"          seed 0 reverse KL per token ({what}) step 1: {r.window_mean(key, 0, 1):.3f}, then "
                      f"{' '.join(f'{s}:{v:.3f}' for s, v in kl if v is not None)}")  # fmt: skip
        drops = [r.window_mean("rollout/generated_per_trained", 0, r.curve[-1][0]) for r in runs]
        if any(d is not None for d in drops):
            print("          samples generated per sample trained (mean over steps): "
                  + " ".join(f"{d:.2f}" for d in drops if d is not None))  # fmt: skip
    base = next((b for b in ("grpo-ds", "grpo") if b in results), None)
    if base is not None:
        print(f"\nto target, against {base} (generated samples; goal for OPD full: ratio <= 0.20)")
        for arm, runs in results.items():
            if arm != base:
                print(ratio_line(arm, runs, base, results[base], target))
    print("\nseconds per step (mean over the run, seed 0)")
    print(f"{'':9s} " + " ".join(f"{name:>11s}" for name, _ in PROFILE) + f" {'eval+start':>10s}")
    for arm, runs in results.items():
        r = runs[0]
        steps = r.curve[-1][0]
        cells = [r.window_mean(key, 0, steps) for _, key in PROFILE]
        other = r.wall - r.seconds_to(steps)  # start-up, evaluations, shutdown
        print(f"{arm:9s} " + " ".join(f"{'-' if c is None else f'{c:.2f}':>11s}" for c in cells)
              + f" {other:10.0f}")  # fmt: skip
    if args.png:
        plot(Path(args.png), results, teacher_acc, target,
             f"--task {args.task}: {args.steps} steps, {per_step} samples per step, {args.eval_tasks} held-out tasks")  # fmt: skip
        print(f"\nwrote {args.png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
