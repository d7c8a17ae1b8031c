"""What starting a gateway costs, without torch (the default) and with it: one run, ratios.

    .venv/bin/python -m bench.gateway_start [--model tiny] [--rounds 3]

`palaestra gateway serve` marks torch absent before transformers loads the tokenizer
(gateway/cli.py `build_app`); `PALAESTRA_GATEWAY_TORCH=1` starts it as before, with torch imported
through transformers' configuration module. Each round starts one gateway of each kind, in
alternating order, against an address where no engine listens (the context length comes from the
model's config then), and reads, once it answers /health: the wall time from launch, the process's
CPU time (schedstat, every thread), its resident memory, and whether torch's library is mapped.
Printed: each start, the medians per kind, and without / with.
"""

from __future__ import annotations

import os
import tempfile
import time

from bench import common
from palaestra.gateway.cli import TORCH_ENV, gateway_process

KINDS = {"without torch": {}, "with torch": {TORCH_ENV: "1"}}


def start_once(model: str, spool: str, extra_env: dict[str, str]) -> dict[str, float | bool]:
    """One gateway started and stopped: wall to ready, CPU, RSS, torch mapped."""
    env = {k: v for k, v in os.environ.items() if k != TORCH_ENV} | extra_env
    t0 = time.perf_counter()
    with gateway_process(model, "http://127.0.0.1:9", spool, env=env, extra_args=["--insecure-local"]) as gw:
        wall = time.perf_counter() - t0
        pid = gw.pid
        assert pid is not None
        figures = common.process_start_figures(pid)
        with open(f"/proc/{pid}/maps") as maps:
            torch = "libtorch" in maps.read()
    return {"wall s": wall, **figures, "torch mapped": torch}


def main() -> None:
    args = common.start_bench_args(__doc__)
    with tempfile.TemporaryDirectory(prefix="bench-gateway-start-") as work:
        runs = common.alternating_starts(
            list(KINDS),
            args.rounds,
            lambda kind, r: start_once(args.model, os.path.join(work, f"{kind}-{r}"), KINDS[kind]),
        )
    print()
    print(
        common.start_summary(
            f"== starting `palaestra gateway serve --model {args.model}`, medians of {args.rounds}", runs
        )
    )


if __name__ == "__main__":
    main()
