"""Small torch ops under OpenMP settings: what a loaded machine does to the trainer's attention calls.

    .venv/bin/python -m bench.omp_wait            # defaults, OMP_WAIT_POLICY=PASSIVE, OMP_NUM_THREADS=1

Each setting runs in its own process (OpenMP reads its environment once): 96 causal
`scaled_dot_product_attention` calls the way `trainer/packed_attention.py` makes them for a packed
micro-batch (64 sequences of 16 tokens, 32 of 30; 4 query and 2 key/value heads of 64), timed
`--reps` times; printed: the median milliseconds per 96 calls and the ratio to the defaults. On an
idle machine the settings are alike; when other jobs hold the cores, OpenMP's waiting threads
spin for cores that are not there (docs/opd.md).
"""

from __future__ import annotations

import os
import subprocess
import sys

from bench import common

WORKER = """
import statistics, sys, time, torch, torch.nn.functional as F
torch.manual_seed(0)
seqs = [(torch.randn(1, 4, n, 64), torch.randn(1, 2, n, 64), torch.randn(1, 2, n, 64)) for n in [16] * 64 + [30] * 32]
times = []
for _ in range(int(sys.argv[1])):
    t = time.perf_counter()
    for q, k, v in seqs:
        mask = torch.ones(q.shape[2], q.shape[2], dtype=torch.bool).tril_()
        F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    times.append(time.perf_counter() - t)
print(statistics.median(times) * 1e3, torch.get_num_threads())
"""

SETTINGS = {
    "defaults": {},
    "OMP_WAIT_POLICY=PASSIVE": {"OMP_WAIT_POLICY": "PASSIVE"},
    "OMP_NUM_THREADS=1": {"OMP_NUM_THREADS": "1"},
}


def main(argv: list[str] | None = None) -> int:
    ap = common.parser(__doc__)
    ap.add_argument(
        "--reps", type=int, default=10, help="timed repetitions per setting (default: %(default)s)"
    )
    ap.add_argument("--timeout", type=float, default=300, help="seconds per setting (default: %(default)s)")
    args = ap.parse_args(argv)
    base = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "OMP_NUM_THREADS")}
    results: dict[str, float] = {}
    for name, extra in SETTINGS.items():
        try:
            out = subprocess.run(
                [sys.executable, "-c", WORKER, str(args.reps)], env={**base, **extra}, capture_output=True,
                text=True, timeout=args.timeout, check=True,
            )  # fmt: skip
        except subprocess.TimeoutExpired:
            print(f"{name:24s} over {args.timeout:.0f} s for {args.reps} repetitions", flush=True)
            continue
        ms, threads = out.stdout.split()
        results[name] = float(ms)
        print(f"{name:24s} {float(ms):9.1f} ms per 96 calls ({threads} threads)", flush=True)
    if "defaults" in results:
        for name, ms in results.items():
            print(f"{name:24s} / defaults = {ms / results['defaults']:.3f}")
    print(f"(load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
