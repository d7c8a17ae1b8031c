"""sync vs one-step-off vs async `palaestra train` on one config, side by side: throughput, reward at
equal wall time, staleness and mismatch, and where the time of a step goes.

    .venv/bin/python -m bench.modes                                  # configs/demo.yaml, 20 steps per mode
    .venv/bin/python -m bench.modes --steps 40 env.tasks_per_step=8
    .venv/bin/python -m bench.modes --config long_horizon            # configs/long_horizon.yaml, 8 steps
    .venv/bin/python -m bench.modes --config long_horizon --steps 12 run.max_staleness=2

Each mode runs the same config (same seeds, same task order, from the same student) through the
Python API of `palaestra train` (engines behind sglang-router, the gateway, the environment's
agents, the Megatron trainer, all on a local Ray); the run's per-step metrics (as in its
metrics.jsonl) are summarised. The two configs:

* `demo` (configs/demo.yaml): the math environment with OPD from the teacher, no held-out
  evaluation; async is scored with the current weights, so TIS corrects its lag (as docs advise).
* `long_horizon` (configs/long_horizon.yaml, the environment in `bench/long_horizon_env.py`):
  episodes of 1 to 40 turns with P(turns >= k) = 1/k, about 20-60 sampled tokens per turn (a
  regex constraint ends each turn), a tool call after each turn that waits 50 ms - 2 s, on the
  tiny preset, TIS on in all three modes. A synchronous step waits for its slowest episode; the
  overlapping modes keep generating while the trainer works, async also across steps (at most
  `run.max_staleness` versions behind).

Printed, per mode, over the training loop (startup and evaluation excluded):

* samples/s and sampled tokens/s of what trained, the ratio to sync, reward per wall second
  (summed reward of the trained samples / loop seconds), the mean rollout reward of the steps each
  mode finished within the shortest mode's loop time (and of its last 5 such steps);
* staleness and what was dropped for it, the rollout-vs-trainer mismatch (`mismatch/*`: mean
  |logprob difference|, KL, the share of tokens whose TIS weight was clipped);
* per step (median of the steps after the first): wall, the trainer waiting for its batch (`wait`:
  generation it could not overlap, and wait / wall), `train` split into `teacher` scoring, `score`
  (old/ref logprob passes) and `update` (forward, backward, optimizer), `drain` (async: the gateway
  drains before a sync), `sync` (weights to the engines); and, overlapping these, `gen` (first
  session start to last finish of the batch's groups), `gateway` (the gateway's own CPU time), the
  slowest group's seconds (`longest`), its share of the step and its longest session's tokens/s.

The reference framework reports 2.3x end to end for async at cluster scale, where generation and
training run on different GPUs. Here two CPU cores are shared by the engines, the gateway, the
environment and the trainer: overlapping mostly divides the same cores, so expect far less.
"""

from __future__ import annotations

import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from bench import common


@dataclass(frozen=True)
class Workload:
    config: Path
    steps: int  # the default --steps
    overrides: tuple[str, ...] = ()  # for every mode
    async_overrides: tuple[str, ...] = ()  # for async only


CONFIGS = {
    "demo": Workload(common.CONFIG, 20, ("env.eval_tasks=0",), ("trainer.tis.enabled=true",)),
    "long_horizon": Workload(common.ROOT / "configs" / "long_horizon.yaml", 8),
}
PHASES = (
    ("wall", "perf/step_wall_s"),
    ("wait", "perf/wait_s"),
    ("teacher", "perf/teacher_s"),
    ("score", "perf/score_s"),
    ("update", "perf/update_s"),
    ("train", "perf/train_s"),
    ("drain", "perf/drain_s"),
    ("sync", "perf/sync_s"),
    ("gen", "perf/gen_s"),
    ("gateway", "perf/gateway_s"),
    ("longest", "perf/longest_group_s"),
)


def run(name: str, work: Workload, mode: str, steps: int, out: Path, extra: list[str]) -> list[dict]:
    overrides = [f"run.mode={mode}", f"run.steps={steps}", *work.overrides]
    if mode == "async":
        overrides += work.async_overrides
    return common.step_rows(common.train_config(work.config, out, f"{name}-{mode}", [*overrides, *extra]))


def throughput(runs: dict[str, list[dict]]) -> dict[str, dict[str, object]]:
    """Per mode: rates, reward at the shortest mode's loop time, staleness, mismatch."""
    loop_s = {mode: common.total(rows, "perf/step_wall_s") for mode, rows in runs.items()}
    horizon = min(loop_s.values())
    base = None
    out = {}
    for mode, rows in runs.items():
        rate = common.total(rows, "rollout/samples") / loop_s[mode]
        base = base or (rate if mode == "sync" else None)
        clock, within = 0.0, []
        for r in rows:
            clock += r["perf/step_wall_s"]
            if clock <= horizon + 1e-9:
                within.append(r)
        reward = sum(r.get("rollout/reward_mean", 0.0) * r.get("rollout/samples", 0.0) for r in rows)
        out[mode] = {
            "loop s": loop_s[mode],
            "samples/s": rate,
            "vs sync": f"{rate / base:.2f}x" if base else "-",
            "tokens/s": common.total(rows, "rollout/sampled_tokens") / loop_s[mode],
            "reward/s": reward / loop_s[mode],
            f"reward@{horizon:.0f}s": common.mean(within, "rollout/reward_mean"),
            "last 5": common.mean(within[-5:], "rollout/reward_mean"),
            "steps@": len(within),
            "lag mean": common.mean(rows, "rollout/staleness_mean"),
            "lag max": max((r.get("rollout/staleness_max", 0.0) for r in rows), default=0.0),
            "dropped": common.total(rows, "rollout/stale_dropped"),
            "|Δlogp|": common.mean(rows, "mismatch/logprob_abs_diff"),
            "mis-KL": common.mean(rows, "mismatch/kl"),
            "TIS clip": common.mean(rows, "mismatch/tis_clip_frac"),
        }
    return out


def per_step(runs: dict[str, list[dict]]) -> dict[str, dict[str, object]]:
    """Per mode: the median seconds of each phase over the steps after the first (which also waits
    for the first batch), and the shares of the step."""
    out = {}
    for mode, rows in runs.items():
        steady = rows[1:] or rows
        med: dict[str, object] = {n: common.median(steady, lambda r, k=k: r.get(k, 0.0)) for n, k in PHASES}
        med["wait/wall"] = common.median(steady, lambda r: r.get("perf/wait_time_ratio", 0.0))
        med["longest/wall"] = common.median(
            steady, lambda r: r.get("perf/longest_group_s", 0.0) / r["perf/step_wall_s"]
        )
        med["longest tok/s"] = common.median(steady, lambda r: r.get("perf/longest_sample_tokens_per_s", 0.0))
        out[mode] = med
    return out


FORMATS = {"loop s": ".1f", "samples/s": ".2f", "vs sync": "s", "tokens/s": ".0f", "reward/s": ".3f",
           "steps@": "d", "lag mean": ".2f", "lag max": ".0f", "dropped": ".0f", "|Δlogp|": ".1e",
           "mis-KL": ".1e", "TIS clip": ".3f"}  # fmt: skip


def report(runs: dict[str, list[dict]], title: str) -> str:
    """The two tables: throughput per mode (`steps@`: the steps within the shortest loop time), and
    the median phases of a step."""
    rates = throughput(runs)
    columns = [(c, FORMATS.get(c, ".3f")) for c in next(iter(rates.values()))]  # reward@T, last 5: .3f
    phases = [(n, ".2f") for n, _ in PHASES] + [
        ("wait/wall", ".2f"),
        ("longest/wall", ".2f"),
        ("longest tok/s", ".1f"),
    ]
    return "\n\n".join([
        common.table(title, columns, rates, key="mode"),
        common.table("per step, median seconds of the steps after the first (gen, gateway, longest overlap "
                     "the others)", phases, per_step(runs), key="mode"),
    ])  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = common.parser(__doc__)
    ap.add_argument(
        "--config", choices=sorted(CONFIGS), default="demo", help="the workload (default: %(default)s)"
    )
    common.add_run_args(ap, steps=None)
    args = ap.parse_args(argv)
    work = CONFIGS[args.config]
    steps = args.steps or work.steps
    os.chdir(common.ROOT)  # an environment may be loaded by import path as bench.* (long_horizon)
    runs: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix=f"bench-modes-{args.config}-") as tmp:
        for mode in common.csv(args.modes):
            t0 = time.perf_counter()
            runs[mode] = run(args.config, work, mode, steps, Path(tmp) / mode, args.overrides)
            print(
                f"{mode}: {len(runs[mode])} steps in {time.perf_counter() - t0:.0f} s (incl. startup)",
                flush=True,
            )

    where = f"{work.config.relative_to(common.ROOT)} {' '.join(args.overrides)}"
    print("\n" + report(runs, f"== {steps} steps per mode, {where}"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
