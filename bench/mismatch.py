"""Train–inference mismatch over a real run: mean |logprob_train − logprob_rollout| per token.

    .venv/bin/python -m bench.mismatch                       # sync, 10 steps of configs/demo.yaml
    .venv/bin/python -m bench.mismatch --steps 20 --modes sync,one_step_off,async

Runs `palaestra train` (the Python API, the same code path as the CLI) with configs/demo.yaml —
2 embedded engines behind sglang-router, the gateway, the math environment, the Megatron trainer
on Ray — and reads every step's `mismatch/logprob_abs_diff` from the run's metrics (as in metrics.jsonl): the
mean over the batch's loss tokens of |log πθ_old(x_t) − log π_rollout(x_t)|, where log πθ_old is
the trainer's forward pass over the exact sampled token ids (before the update) and
log π_rollout is what the engine returned while sampling them. Both are fp32. Printed: the
token-weighted mean over the run, the largest step mean, and `mismatch/kl`.

What to expect per mode: in `sync` the trainer scores the batch with the weights that sampled it
(the current ones), in `one_step_off` with the previous step's (`trainer.keep_old_actor`, on by
default there), which sampled it: the difference is numerical only (goal <= 1e-6). In `async` the
trainer scores with its current weights, which may be newer than those that sampled: the
difference is then the policy lag itself (what TIS/RS correct), printed for contrast.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from bench import common
from bench.common import CONFIG, train_demo

GOAL = 1e-6


def run(mode: str, steps: int, out: Path, extra: list[str]) -> list[dict]:
    overrides = [f"run.mode={mode}", f"run.steps={steps}", "env.eval_tasks=0", *extra]
    return common.step_rows(train_demo(out, f"mismatch-{mode}", overrides), "mismatch/logprob_abs_diff")


def main(argv: list[str] | None = None) -> int:
    ap = common.parser(__doc__)
    common.add_run_args(ap, steps=10, modes=("sync",))
    args = ap.parse_args(argv)
    results = {}
    with tempfile.TemporaryDirectory(prefix="bench-mismatch-") as tmp:
        for mode in common.csv(args.modes):
            started = time.perf_counter()
            rows = run(mode, args.steps, Path(tmp) / mode, args.overrides)
            tokens = [r.get("rollout/sampled_tokens", 1.0) for r in rows]
            diffs = [r["mismatch/logprob_abs_diff"] for r in rows]
            mean = sum(d * t for d, t in zip(diffs, tokens, strict=True)) / sum(tokens)
            kl = sum(r.get("mismatch/kl", 0.0) * t for r, t in zip(rows, tokens, strict=True)) / sum(tokens)
            results[mode] = (mean, max(diffs), kl, int(sum(tokens)), len(rows), time.perf_counter() - started)
    print(f"\n== mean |logprob_train - logprob_rollout| per sampled token ({CONFIG.name}, fp32)")
    for mode, (mean, worst, kl, tokens, steps, wall) in results.items():
        verdict = "meets" if mean <= GOAL else "misses"
        print(
            f"{mode:13s} mean {mean:.3e} ({verdict} the {GOAL:.0e} goal), worst step {worst:.3e}, "
            f"mismatch KL {kl:.3e}; {tokens} tokens over {steps} steps, {wall:.0f} s"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
