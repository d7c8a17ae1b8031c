"""Two domains, two teachers: the per-domain panel against either teacher alone, per domain.

    .venv/bin/python -m bench.two_domains                        # 3 arms x 40 steps, eval every 20
    .venv/bin/python -m bench.two_domains --steps 60 --eval-tasks 400
    .venv/bin/python -m bench.two_domains --student demo-mixed-student   # the earlier, weaker student
    .venv/bin/python -m bench.two_domains run.seed=1 --json s1.json        # one seed per run, then:
    .venv/bin/python -m bench.two_domains --load s0.json s1.json s2.json   # the seeds' table, paired

The student (`demo-mixed-student-rl`: tiny after 800 SFT steps of three worked-steps tasks to one
sum, about 0.5 / 0.27 greedy on the two kinds, so RL has reward variance on both) learns two
math task kinds in one run: `arithmetic` ("What is 3 + 4?", answered ``\\boxed{7}``) and
`worked_steps` ("Start with 7, add 5, multiply by 3, ... Show each step.", answered one line per
step, 23-29 tokens). Each kind has its own warm-started teacher: `demo-teacher` (SFT on sums)
and `demo-steps-teacher` (SFT on worked steps). Arms, same seeds, task order and student:

* `panel`: both teachers, each sample routed to its kind's teacher
  (`palaestra.environments.math.routing:by_kind`);
* `sums-teacher`: `demo-teacher` scores every sample;
* `steps-teacher`: `demo-steps-teacher` scores every sample.

Every teacher distils at `full` granularity (the exact reverse KL over the vocabulary, megatron
mode: docs/opd.md), the sharpest per-token signal this trainer has.

Every arm is a real `palaestra train` run of configs/demo.yaml (GRPO + OPD, 2 embedded engines,
router, gateway, Megatron trainer, Ray) with held-out accuracy measured per kind
(`eval/accuracy/<kind>`: greedy, `--eval-tasks` tasks, half of each kind). Prints each arm's
accuracy per kind before and after, and whether the panel beats, on each kind, the arm whose
only teacher is the other kind's.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path

from bench import common
from bench.common import mean_se, train_demo

KINDS = ("arithmetic", "worked_steps")
TEACHERS = {"arithmetic": "demo-teacher", "worked_steps": "demo-steps-teacher"}


def _panel(teachers: dict[str, str], granularity: str = "full") -> str:
    inner = ", ".join(
        f"{name}: {{mode: megatron, model: {model}, granularity: {granularity}}}"
        for name, model in teachers.items()
    )
    return f"trainer.opd.teachers={{{inner}}}"


ARMS = {
    "panel": [_panel(TEACHERS), "trainer.opd.teacher_routing=palaestra.environments.math.routing:by_kind"],
    "sums-teacher": [_panel({"default": TEACHERS["arithmetic"]})],
    "steps-teacher": [_panel({"default": TEACHERS["worked_steps"]})],
}
STUDENT = "demo-mixed-student-rl"
COMMON = [
    "model.teacher=null",
    "trainer.opd.teacher_mode=null",
    "env.args.kinds=[arithmetic,worked_steps]",
    "env.args.max_tokens=48",
    "gateway.default_max_tokens=48",
]


def _se(acc: float, n: int) -> float:
    """Standard error of an accuracy measured on n tasks (binomial)."""
    return (acc * (1 - acc) / max(n, 1)) ** 0.5


def _pm(acc: float, n: int) -> str:
    return f"{acc:.3f} ± {_se(acc, n):.3f}"


def _last(runs: list[dict], arm: str, kind: str | None = None) -> list[float]:
    """Each run's accuracy after its last step on `kind` (None: the two kinds' mean)."""
    kinds = KINDS if kind is None else (kind,)
    return [statistics.fmean(r["arms"][arm][-1][f"eval/accuracy/{k}"] for k in kinds) for r in runs]


SPECIALIST = {"arithmetic": "sums-teacher", "worked_steps": "steps-teacher"}


def summarize(runs: list[dict], names: list[str]) -> str:
    """The table over runs (one per seed: `--json` files): each arm's start and last accuracy per
    kind, run by run and mean ± standard error over runs, and the panel paired by run against each
    specialist on its own kind and against every single teacher on the two-kind mean."""
    arms = [a for a in ARMS if all(a in r["arms"] for r in runs)]
    lines = [f"== two domains over {len(runs)} runs ({', '.join(names)}): accuracy after the last step, "
             "run by run (mean ± standard error over runs)"]  # fmt: skip

    def cell(values: list[float]) -> str:
        m, se = mean_se(values)
        return " / ".join(f"{v:.3f}" for v in values) + f" ({m:.3f} ± {se:.3f})"

    for arm in arms:
        start = " / ".join(
            f"{statistics.fmean(r['arms'][arm][0][f'eval/accuracy/{k}'] for r in runs):.3f}" for k in KINDS
        )
        parts = [f"{k} {cell(_last(runs, arm, k))}" for k in KINDS]
        lines.append(f"{arm:14s} start {start}; " + "; ".join(parts) + f"; mean {cell(_last(runs, arm))}")
    if "panel" in arms:
        lines.append("paired by run, panel minus the other arm (mean ± standard error over runs):")
        for kind, rival in SPECIALIST.items():
            if rival in arms:
                diff = [
                    p - r for p, r in zip(_last(runs, "panel", kind), _last(runs, rival, kind), strict=True)
                ]
                m, se = mean_se(diff)
                lines.append(f"  {kind}, against its specialist {rival}: {m:+.3f} ± {se:.3f}")
        for rival in SPECIALIST.values():
            if rival in arms:
                diff = [p - r for p, r in zip(_last(runs, "panel"), _last(runs, rival), strict=True)]
                m, se = mean_se(diff)
                lines.append(f"  two-kind mean, against {rival} alone: {m:+.3f} ± {se:.3f}")
    return "\n".join(lines)


def run(name: str, out: Path, overrides: list[str]) -> tuple[list[dict[str, float]], float]:
    """The evaluation rows of one run (step 0: before training) and its wall seconds."""
    started = time.perf_counter()
    rows = train_demo(out, name, overrides).state.rows
    evals = [{k: v for k, v in r.items() if k == "train/step" or k.startswith("eval/")} for r in rows]
    return [r for r in evals if "eval/accuracy" in r], time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    ap = common.parser(__doc__)
    ap.add_argument("--arms", default=",".join(ARMS), help="comma-separated subset of " + ", ".join(ARMS))
    ap.add_argument("--steps", type=int, default=40, help="training steps per arm (default: %(default)s)")
    ap.add_argument(
        "--eval-every", type=int, default=20, help="steps between evaluations (default: %(default)s)"
    )
    ap.add_argument(
        "--eval-tasks", type=int, default=200, help="held-out tasks, both kinds (default: %(default)s)"
    )
    ap.add_argument(
        "--student", default=STUDENT, help="the student preset or directory (default: %(default)s)"
    )
    ap.add_argument("--json", default=None, help="also write the curves to this file")
    ap.add_argument(
        "--load",
        nargs="+",
        default=None,
        metavar="JSON",
        help="print the table over earlier runs' --json files",
    )
    ap.add_argument("overrides", nargs="*", help="more dotted config overrides for every arm")
    args = ap.parse_args(argv)  # fmt: skip
    if args.load:
        try:
            runs = [json.loads(Path(f).read_text()) for f in args.load]
        except (OSError, ValueError) as e:
            ap.error(f"--load: {e}")
        print(summarize(runs, [Path(f).name for f in args.load]))
        return 0
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    unknown = sorted(set(arms) - set(ARMS))
    if unknown:
        ap.error(f"unknown arms {unknown}; choose from {list(ARMS)}")
    shared = [*COMMON, f"model.student={args.student}", f"run.steps={args.steps}", f"env.eval_every={args.eval_every}",
              f"env.eval_tasks={args.eval_tasks}", *args.overrides]  # fmt: skip
    results: dict[str, tuple[list[dict[str, float]], float]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-two-domains-") as tmp:
        teachers = {}
        for kind, model in TEACHERS.items():  # each teacher's own accuracy per kind (0 steps)
            rows, _ = run(f"teacher-{kind}", Path(tmp) / f"teacher-{kind}",
                          [*COMMON, f"model.student={model}", "trainer.opd.kl_coef=0", "run.steps=0", f"env.eval_tasks={args.eval_tasks}"])  # fmt: skip
            teachers[model] = rows[0]
            print(
                f"teacher {model}: " + " ".join(f"{k} {rows[0][f'eval/accuracy/{k}']:.3f}" for k in KINDS),
                flush=True,
            )
        for arm in arms:
            results[arm] = run(arm, Path(tmp) / arm, [*ARMS[arm], *shared])
            last = results[arm][0][-1]
            print(f"{arm}: " + " ".join(f"{k} {last[f'eval/accuracy/{k}']:.3f}" for k in KINDS), flush=True)

    n = args.eval_tasks // len(KINDS)  # tasks per kind
    print(f"\n== two domains, {args.steps} steps, {args.eval_tasks} held-out tasks ({n} per kind), greedy; "
          f"± one standard error, sqrt(a(1 - a) / {n})")  # fmt: skip
    header = f"{'':22s}" + "".join(f"{k:>24s}" for k in KINDS) + f"{'wall s':>9s}"
    print(header)
    for model, row in teachers.items():
        print(f"{'teacher ' + model:22s}" + "".join(f"{row[f'eval/accuracy/{k}']:24.3f}" for k in KINDS))
    for arm, (rows, wall) in results.items():
        cells = "".join(
            f"{rows[0][f'eval/accuracy/{k}']:.3f} -> {_pm(rows[-1][f'eval/accuracy/{k}'], n)}".rjust(24)
            for k in KINDS
        )
        print(f"{arm:22s}{cells}{wall:9.0f}")
    # The claim: on each kind, the panel beats the arm whose only teacher is the OTHER kind's.
    other = {"arithmetic": "steps-teacher", "worked_steps": "sums-teacher"}
    if "panel" in results:
        for kind, rival in other.items():
            if rival in results:
                p = results["panel"][0][-1][f"eval/accuracy/{kind}"]
                r = results[rival][0][-1][f"eval/accuracy/{kind}"]
                se = (_se(p, n) ** 2 + _se(r, n) ** 2) ** 0.5
                verdict = "panel better" if p > r else "panel NOT better"
                print(f"{kind}: panel {p:.3f} vs {rival} {r:.3f} ({p - r:+.3f} ± {se:.3f}, "
                      f"{(p - r) / se if se else float('inf'):+.1f} standard errors): {verdict}")  # fmt: skip
        for kind in KINDS:  # the panel against the best single-teacher arm on each kind
            singles = {a: results[a][0][-1][f"eval/accuracy/{kind}"] for a in other.values() if a in results}
            if singles:
                best = max(singles, key=singles.__getitem__)
                p, b = results["panel"][0][-1][f"eval/accuracy/{kind}"], singles[best]
                se = (_se(p, n) ** 2 + _se(b, n) ** 2) ** 0.5
                print(
                    f"{kind}: panel {p:.3f} vs the best single teacher ({best}) {b:.3f} ({p - b:+.3f} ± {se:.3f})"
                )
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "student": args.student,
                    "overrides": args.overrides,
                    "teachers": teachers,
                    "arms": {a: r for a, (r, _) in results.items()},
                    "wall_s": {a: w for a, (_, w) in results.items()},
                },
                indent=1,
            )
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
