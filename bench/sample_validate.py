"""What `Sample.validate` costs at a long session's finish: its mask checks against the Python loops
they replaced, as ratios measured in one run (CPU time, `time.process_time`).

    .venv/bin/python -m bench.sample_validate [--tokens 100000] [--repeat 10]

A sample of `--tokens` response tokens (a random 0/1 loss mask), with and without routed experts
(`_check_routing_shape` then finds the last sampled position too), is validated with the module's
checks (`bytearray` of the mask) and with the loops they replaced (`any(m not in (0, 1))`, the
`enumerate` for the last sampled position), interleaved; prints the best of 7 batches of each.
"""

from __future__ import annotations

import random
import time

import numpy as np

import palaestra.sample as sample_module
from bench import common
from palaestra.sample import Sample

LOOPS = (  # what `validate` ran before: the reference
    lambda mask: not any(m not in (0, 1) for m in mask),
    lambda mask: max((i for i, m in enumerate(mask) if m), default=-1),
)
CHECKS = (sample_module._zeros_and_ones, sample_module._last_sampled)


def best_ms(fn, repeat: int) -> float:
    best = float("inf")
    for _ in range(7):
        t0 = time.process_time()
        for _ in range(repeat):
            fn()
        best = min(best, (time.process_time() - t0) / repeat)
    return best * 1e3


def main() -> None:
    ap = common.parser(__doc__)
    ap.add_argument("--tokens", type=int, default=100_000, help="response tokens of the sample")
    ap.add_argument("--repeat", type=int, default=10, help="validate calls per timed batch")
    args = ap.parse_args()
    rng = random.Random(0)
    n = args.tokens
    mask = [rng.randint(0, 1) for _ in range(n)]

    def sample() -> Sample:
        fields = dict(rollout_logprobs=[0.0] * n, weight_versions=[""] * n)
        return Sample("s", "s", "g", "e", "t", [1] * (10 + n), 10, list(mask), **fields)

    plain, moe = sample(), sample()
    moe.set_routing(np.zeros((10 + n, 1, 1), dtype=np.int64))
    for name, s in (("no routing", plain), ("routed experts", moe)):
        ms = {}
        for label, (zeros_and_ones, last_sampled) in (
            ("loops", LOOPS),
            ("checks", CHECKS),
            ("loops", LOOPS),
        ):
            sample_module._zeros_and_ones, sample_module._last_sampled = zeros_and_ones, last_sampled
            ms.setdefault(label, []).append(best_ms(s.validate, args.repeat))
        sample_module._zeros_and_ones, sample_module._last_sampled = CHECKS
        loops, checks = min(ms["loops"]), ms["checks"][0]
        ratio = loops / checks
        print(
            f"{name}, {n} response tokens: validate {loops:.2f} ms (loops) -> {checks:.2f} ms ({ratio:.1f}x)"
        )


if __name__ == "__main__":
    main()
