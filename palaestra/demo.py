"""`make demo`: a weak student learns arithmetic from a strong teacher, through the whole stack.

    .venv/bin/python -m palaestra.demo [section.field=value ...]     # overrides of configs/demo.yaml

1. Builds the `tiny` preset (4M-parameter Qwen2, random weights) and warm-starts, by SFT with the
   trainer itself, a teacher (~98 % greedy on single-digit sums) and a student (the same run
   stopped early, ~30 %). About 2 minutes the first time; cached under ~/.cache/palaestra.
2. Runs `palaestra train configs/demo.yaml`: Ray places 2 embedded engines behind the real
   sglang-router, the gateway, the math environment's agents (openai SDK) and the Megatron
   trainer; GRPO + on-policy distillation from the teacher, 200 sync steps, weights synced to
   both engines after every step. A progress bar shows the reward (one console line per step when
   the output is not a terminal).
3. Prints held-out accuracy before and after, and writes runs/demo/reward_curve.png and
   runs/demo/viewer.html (open it in a browser: every token coloured by loss mask or by the
   student-teacher logprob gap, filters by reward and fork reason).

The same run by hand: `palaestra train configs/demo.yaml`; see docs/training.md.
"""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path

from palaestra.config import ConfigError, load_config
from palaestra.orchestrator.errors import RunFailed
from palaestra.train import train

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "demo.yaml"


def _fresh_name(name: str) -> str:
    """`name`, or `name-2`, `name-3`, ... when runs/<name> already holds a run (a second
    `make demo` keeps the first one's results instead of refusing to start)."""
    candidate, n = name, 1
    while (Path("runs") / candidate / "checkpoints").exists():
        n += 1
        candidate = f"{name}-{n}"
    return candidate


def main(argv: list[str] | None = None) -> int:
    overrides = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in overrides):
        print(__doc__)
        return 0
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    for noisy in ("httpx", "megatron"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        cfg = load_config(CONFIG, overrides)
        if not any(o.startswith(("run.name=", "run.output_dir=", "run.resume=")) for o in overrides):
            cfg.run.name = _fresh_name(cfg.run.name)  # output_dir follows the name
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 2
    started = time.perf_counter()
    print(
        f"palaestra demo: {cfg.model.student} learns from {cfg.model.teacher} on {cfg.env.name} "
        f"({cfg.run.steps} steps of {cfg.env.tasks_per_step}x{cfg.env.samples_per_task} samples, "
        f"{cfg.run.mode}, {cfg.engines.count} engines) -> {cfg.output_dir}",
        flush=True,
    )
    try:
        result = train(cfg)
    except RunFailed as exc:
        print(f"palaestra demo: {exc}", file=sys.stderr)
        return 1
    minutes = (time.perf_counter() - started) / 60
    if result.eval_before and result.eval_after:
        before, after = result.eval_before["accuracy"], result.eval_after["accuracy"]
        print(
            f"\nheld-out accuracy (greedy, {int(result.eval_after['tasks'])} tasks): "
            f"before {before:.3f} -> after {after:.3f} ({after - before:+.3f}) in {minutes:.1f} min"
            + ("" if result.teacher_accuracy is None else f"; the teacher: {result.teacher_accuracy:.3f}"),
            flush=True,
        )
    viewer = (result.output_dir / "viewer.html").resolve()
    print(f"reward curve: {result.output_dir / 'reward_curve.png'}\ntrajectories: file://{viewer}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
