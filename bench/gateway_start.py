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
import statistics
import tempfile
import time

from bench import common
from bench.gateway import cpu_seconds
from palaestra.gateway.cli import TORCH_ENV, gateway_process
from palaestra.models import resolve_model

KINDS = {"without torch": {}, "with torch": {TORCH_ENV: "1"}}


def start_once(model: str, spool: str, extra_env: dict[str, str]) -> dict[str, float | bool]:
    """One gateway started and stopped: wall to ready, CPU, RSS, torch mapped."""
    env = {k: v for k, v in os.environ.items() if k != TORCH_ENV} | extra_env
    t0 = time.perf_counter()
    with gateway_process(model, "http://127.0.0.1:9", spool, env=env, extra_args=["--insecure-local"]) as gw:
        wall = time.perf_counter() - t0
        pid = gw.pid
        assert pid is not None
        cpu = cpu_seconds(pid)
        with open(f"/proc/{pid}/status") as status:
            rss = int(status.read().split("VmRSS:")[1].split()[0]) / 1024
        with open(f"/proc/{pid}/maps") as maps:
            torch = "libtorch" in maps.read()
    return {"wall s": wall, "cpu s": cpu, "rss MB": rss, "torch": torch}


def main() -> None:
    ap = common.parser(__doc__)
    ap.add_argument("--model", default="tiny", help="preset name or model directory (default: %(default)s)")
    ap.add_argument("--rounds", type=int, default=3, help="starts of each kind (default: %(default)s)")
    args = ap.parse_args()
    if args.rounds < 1:
        ap.error(f"--rounds must be 1 or more; got {args.rounds}")
    resolve_model(args.model)  # a preset built once, before anything is timed
    runs: dict[str, list[dict[str, float | bool]]] = {kind: [] for kind in KINDS}
    with tempfile.TemporaryDirectory(prefix="bench-gateway-start-") as work:
        for r in range(args.rounds):
            order = list(KINDS) if r % 2 == 0 else list(reversed(KINDS))
            for kind in order:
                run = start_once(args.model, os.path.join(work, f"{kind}-{r}"), KINDS[kind])
                runs[kind].append(run)
                print(
                    f"round {r + 1} {kind:13s}: ready in {run['wall s']:.2f} s, CPU {run['cpu s']:.2f} s, "
                    f"RSS {run['rss MB']:.0f} MB, torch mapped: {run['torch']}",
                    flush=True,
                )
    med = {kind: {k: statistics.median(float(r[k]) for r in rs) for k in ("wall s", "cpu s", "rss MB")} for kind, rs in runs.items()}  # fmt: skip
    print(f"\n== starting `palaestra gateway serve --model {args.model}`, medians of {args.rounds}")
    print(f"{'':15s}{'ready s':>9s}{'CPU s':>8s}{'RSS MB':>8s}")
    for kind, m in med.items():
        print(f"{kind:15s}{m['wall s']:9.2f}{m['cpu s']:8.2f}{m['rss MB']:8.0f}")
    a, b = med["without torch"], med["with torch"]
    print(
        f"without / with: ready {a['wall s'] / b['wall s']:.2f}x, CPU {a['cpu s'] / b['cpu s']:.2f}x, "
        f"RSS {a['rss MB'] / b['rss MB']:.2f}x ({b['rss MB'] - a['rss MB']:.0f} MB less)"
    )


if __name__ == "__main__":
    main()
