"""sync vs one-step-off vs async `palaestra train` on this machine: throughput, reward at equal wall
time, and where the time goes.

    .venv/bin/python bench/async_vs_sync.py                      # 20 steps per mode, configs/demo.yaml
    .venv/bin/python bench/async_vs_sync.py --steps 40 env.tasks_per_step=8

Each mode runs the same config (same seeds, same task order, from the same student) through the
Python API of `palaestra train` — engines behind sglang-router, the gateway, the math
environment's agents, the Megatron trainer with OPD from the teacher, all on a local Ray — and
the run's per-step metrics (as in its metrics.jsonl) are summarised:

* samples/s: samples trained / the training loop's wall time (startup and evaluation excluded);
* reward at equal wall time: the mean rollout reward of the steps each mode finished within the
  shortest mode's loop time, and of its last 5 such steps;
* per-phase seconds per step, as the trainer's driver sees them: `wait` (the trainer waits for its
  batch: generation it could not overlap), `train` split into `teacher` scoring, `score` (old/ref
  logprob passes) and `update` (forward, backward, optimizer), `drain` (async: the gateway drains
  before a sync), `sync` (weights to the engines); and, overlapping these, `gen` (first session
  start to last finish of the batch's groups) and `gateway` (the gateway's own CPU time:
  rendering, bridging, recording).

The reference framework reports 2.3x end to end for async at cluster scale, where generation and
training run on different GPUs. Here two CPU cores are shared by two engines, the gateway, the
environment and the trainer: overlapping mostly divides the same cores, so expect far less.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from demo_runs import CONFIG, train_demo

MODES = ("sync", "one_step_off", "async")
PHASES = ("wait", "teacher", "score", "update", "drain", "sync", "gen", "gateway")


def run(mode: str, steps: int, out: Path, extra: list[str]) -> list[dict]:
    overrides = [f"run.mode={mode}", f"run.steps={steps}", "env.eval_tasks=0"]
    if mode == "async":  # scored with the current weights: correct the lag with TIS, as docs advise
        overrides += ["trainer.tis.enabled=true"]
    rows = train_demo(out, mode, [*overrides, *extra]).state.rows
    return [r for r in rows if "perf/step_wall_s" in r]


def phase(row: dict, name: str) -> float:
    key = {"wait": "perf/wait_s", "drain": "perf/drain_s", "gen": "perf/gen_s", "gateway": "perf/gateway_s",
           "teacher": "perf/teacher_s", "score": "perf/score_s", "update": "perf/update_s"}.get(name)  # fmt: skip
    if name == "sync":
        key = "perf/sync_s"
    return float(row.get(key, 0.0))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20, help="training steps per mode (default: %(default)s)")
    ap.add_argument("--modes", default=",".join(MODES), help="comma-separated subset (default: all three)")
    ap.add_argument("overrides", nargs="*", help="more dotted config overrides, e.g. env.tasks_per_step=8")
    args = ap.parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    runs: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-async-") as tmp:
        for mode in modes:
            t0 = time.perf_counter()
            runs[mode] = run(mode, args.steps, Path(tmp) / mode, args.overrides)
            print(
                f"{mode}: {len(runs[mode])} steps in {time.perf_counter() - t0:.0f} s (incl. startup)",
                flush=True,
            )

    loop_s = {m: sum(r["perf/step_wall_s"] for r in rows) for m, rows in runs.items()}
    horizon = min(loop_s.values())
    print(f"\n== {args.steps} steps per mode, {CONFIG.name} {' '.join(args.overrides)}")
    print(f"{'mode':13s} {'loop s':>7s} {'samples/s':>9s} {'vs sync':>7s}  reward@{horizon:.0f}s (last 5)")
    base = None
    for mode, rows in runs.items():
        samples = sum(r.get("rollout/samples", 0.0) for r in rows)
        rate = samples / loop_s[mode]
        base = base or (rate if mode == "sync" else None)
        clock, within = 0.0, []
        for r in rows:
            clock += r["perf/step_wall_s"]
            if clock <= horizon + 1e-9:
                within.append(r["rollout/reward_mean"])
        ratio = f"{rate / base:6.2f}x" if base else "      -"
        mean = statistics.fmean(within) if within else float("nan")
        last5 = statistics.fmean(within[-5:]) if within else float("nan")
        print(
            f"{mode:13s} {loop_s[mode]:7.1f} {rate:9.2f} {ratio}  {mean:.3f} ({last5:.3f}) over {len(within)} steps"
        )
    print("\nper step, median seconds (gen and gateway overlap the others)")
    print(f"{'mode':13s} {'wall':>6s} " + " ".join(f"{p:>7s}" for p in PHASES))
    for mode, rows in runs.items():
        steady = rows[1:] or rows  # the first step also waits for the first batch
        med = {p: statistics.median(phase(r, p) for r in steady) for p in PHASES}
        wall = statistics.median(r["perf/step_wall_s"] for r in steady)
        print(f"{mode:13s} {wall:6.2f} " + " ".join(f"{med[p]:7.2f}" for p in PHASES))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
