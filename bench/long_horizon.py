"""sync vs one-step-off vs async `palaestra train` on a long-horizon agentic workload, side by side.

    .venv/bin/python bench/long_horizon.py                     # 8 steps per mode, configs/long_horizon.yaml
    .venv/bin/python bench/long_horizon.py --steps 12 run.max_staleness=2

The workload (`bench/long_horizon_env.py`): episodes of 1 to 40 turns with P(turns >= k) = 1/k,
about 20-60 sampled tokens per turn (a regex constraint ends each turn), a tool call after each turn that waits 50 ms - 2 s, on the tiny
preset; fixed tasks and seeds, so every mode runs the same episodes. A synchronous step waits for
its slowest episode; the overlapping modes keep generating while the trainer works, async also
across steps (at most `run.max_staleness` versions behind, the same bound for both overlapping
modes, TIS on in all three).

Each mode is one run of the Python API of `palaestra train` (engines behind sglang-router, the
gateway, the environment runner, the Megatron trainer, a local Ray). Printed, per mode, over the
training loop (startup excluded):

* samples/s and sampled tokens/s of what trained, the ratio to sync, reward per wall second
  (summed reward of the trained samples / loop seconds);
* staleness and what was dropped for it, the rollout-vs-trainer mismatch (`mismatch/*`: mean
  |logprob difference|, KL, the share of tokens whose TIS weight was clipped);
* per step (median of the steps after the first): wall, the trainer waiting for its batch
  (`wait`, and `wait_time_ratio` = wait / wall), training, draining, weight sync, generation of the
  batch (`gen`, overlapping), the slowest group's seconds (`longest`), its share of the step and
  its longest session's sampled tokens/s.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from palaestra.config import load_config  # noqa: E402
from palaestra.train import train  # noqa: E402

CONFIG = ROOT / "configs" / "long_horizon.yaml"
MODES = ("sync", "one_step_off", "async")
PHASES = (
    ("wall", "perf/step_wall_s"),
    ("wait", "perf/wait_s"),
    ("train", "perf/train_s"),
    ("drain", "perf/drain_s"),
    ("sync", "perf/sync_s"),
    ("gen", "perf/gen_s"),
    ("longest", "perf/longest_group_s"),
)


def run(mode: str, steps: int, out: Path, extra: list[str]) -> list[dict]:
    settings = [
        f"run.output_dir={out}",
        f"run.name=bench-lh-{mode}",
        f"run.mode={mode}",
        f"run.steps={steps}",
    ]
    cfg = load_config(CONFIG, [*settings, *extra])
    return [r for r in train(cfg).state.rows if "perf/step_wall_s" in r]


def total(rows: list[dict], key: str) -> float:
    return sum(r.get(key, 0.0) for r in rows)


def mean(rows: list[dict], key: str) -> float:
    vals = [r[key] for r in rows if key in r and not math.isnan(r[key])]
    return statistics.fmean(vals) if vals else float("nan")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=8, help="training steps per mode (default: %(default)s)")
    ap.add_argument("--modes", default=",".join(MODES), help="comma-separated subset (default: all three)")
    ap.add_argument("overrides", nargs="*", help="more dotted config overrides, e.g. run.max_staleness=2")
    args = ap.parse_args(argv)
    os.chdir(ROOT)  # the environment is loaded as bench.long_horizon_env from the working directory
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    runs: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-long-horizon-") as tmp:
        for mode in modes:
            t0 = time.perf_counter()
            runs[mode] = run(mode, args.steps, Path(tmp) / mode, args.overrides)
            print(
                f"{mode}: {len(runs[mode])} steps in {time.perf_counter() - t0:.0f} s (incl. startup)",
                flush=True,
            )

    print(f"\n== {args.steps} steps per mode, {CONFIG.relative_to(ROOT)} {' '.join(args.overrides)}")
    print(
        f"{'mode':13s} {'loop s':>7s} {'samples/s':>9s} {'vs sync':>7s} {'tokens/s':>8s} {'reward/s':>8s} "
        f"{'lag mean':>8s} {'lag max':>7s} {'dropped':>7s} {'|Δlogp|':>8s} {'mis-KL':>8s} {'TIS clip':>8s}"
    )
    base = None
    for mode, rows in runs.items():
        loop_s = total(rows, "perf/step_wall_s")
        samples = total(rows, "rollout/samples")
        rate = samples / loop_s
        base = base or (rate if mode == "sync" else None)
        reward = sum(r.get("rollout/reward_mean", 0.0) * r.get("rollout/samples", 0.0) for r in rows)
        ratio = f"{rate / base:6.2f}x" if base else "      -"
        print(
            f"{mode:13s} {loop_s:7.1f} {rate:9.2f} {ratio} {total(rows, 'rollout/sampled_tokens') / loop_s:8.0f} "
            f"{reward / loop_s:8.3f} {mean(rows, 'rollout/staleness_mean'):8.2f} "
            f"{max((r.get('rollout/staleness_max', 0.0) for r in rows), default=0.0):7.0f} "
            f"{total(rows, 'rollout/stale_dropped'):7.0f} {mean(rows, 'mismatch/logprob_abs_diff'):8.1e} "
            f"{mean(rows, 'mismatch/kl'):8.1e} {mean(rows, 'mismatch/tis_clip_frac'):8.3f}"
        )
    print("\nper step, median seconds of the steps after the first (gen and longest overlap the others)")
    names = [n for n, _ in PHASES]
    print(
        f"{'mode':13s} "
        + " ".join(f"{n:>7s}" for n in names)
        + f" {'wait/wall':>9s} {'longest/wall':>12s} {'longest tok/s':>13s}"
    )
    for mode, rows in runs.items():
        steady = rows[1:] or rows  # the first step also waits for the first batch
        med = {n: statistics.median(r.get(k, 0.0) for r in steady) for n, k in PHASES}
        share = statistics.median(r.get("perf/longest_group_s", 0.0) / r["perf/step_wall_s"] for r in steady)
        print(
            f"{mode:13s} " + " ".join(f"{med[n]:7.2f}" for n in names)
            + f" {statistics.median(r.get('perf/wait_time_ratio', 0.0) for r in steady):9.2f} {share:12.2f}"
            + f" {statistics.median(r.get('perf/longest_sample_tokens_per_s', 0.0) for r in steady):13.1f}"
        )  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
