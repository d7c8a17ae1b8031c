"""What a judge reward adds to a training step, and what an MCP tool call costs beside a native one.

    .venv/bin/python -m bench.judge_mcp                    # both parts
    .venv/bin/python -m bench.judge_mcp --part mcp --calls 200
    .venv/bin/python -m bench.judge_mcp --part judge --steps 3

judge: `palaestra train` of configs/demo.yaml's `tiny` setup on `judged-math`, once per mode (sync,
async) with the rule's reward (``judge: null``) and once with a judge: the `tiny` preset served by
a separate engine of ours (`palaestra engine serve`), called at its URL. Printed per mode: seconds
per step (the mean of `perf/step_wall_s` past the first step) with the rule and with the judge, the
seconds the judge added, their ratio, and the judge's own seconds per episode (`judge/time_s`).

mcp: one local (bubblewrap) sandbox; the median round trip of `calls` tool calls of three kinds:
a native in-process tool (the math environment's calculator), a native sandbox tool (one
`Sandbox.exec`, what code_sandbox's `run_python` costs), and an MCP tool (tests/support/mcp_server.py's
``add`` through `McpTools.call`: the `mcp` client, the unix socket, the bridge, the server's stdio).
Printed: milliseconds each and the MCP call's ratio to each native one.
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
import time
from pathlib import Path

from bench import common

MODES = ("sync", "async")


def judge_part(steps: int, extra: list[str]) -> None:
    from palaestra.engine.cli import engine_process

    with (
        engine_process("tiny", extra_args=["--num-threads", "1"]) as judge_engine,
        tempfile.TemporaryDirectory() as tmp,
    ):
        judge = f"{{url: '{judge_engine.url}', tokenizer: tiny, max_tokens: 16, timeout_s: 120}}"
        print(
            f"{'mode':<6} {'rule s/step':>12} {'judge s/step':>13} {'added s':>8} {'ratio':>6} {'judge s/episode':>16}"
        )
        for mode in MODES:
            seconds = {}
            judge_s = float("nan")
            for name, judge_arg in (("rule", "null"), ("judge", judge)):
                overrides = [f"run.mode={mode}", f"run.steps={steps}", "env.eval_tasks=0", "env.name=judged-math",
                             f"env.args={{difficulty: 1, max_tokens: 12, judge: {judge_arg}}}", *extra]  # fmt: skip
                if mode == "async":
                    overrides.append("trainer.tis.enabled=true")
                rows = common.train_demo(Path(tmp) / f"{mode}-{name}", f"{mode}-{name}", overrides).state.rows
                steps_rows = [r for r in rows if "perf/step_wall_s" in r]
                measured = steps_rows[1:] or steps_rows
                seconds[name] = statistics.fmean(r["perf/step_wall_s"] for r in measured)
                if name == "judge":
                    judge_s = statistics.fmean(
                        r.get("rollout/env_judge/time_s", float("nan")) for r in measured
                    )
            added = seconds["judge"] - seconds["rule"]
            print(f"{mode:<6} {seconds['rule']:>12.2f} {seconds['judge']:>13.2f} {added:>8.2f} "
                  f"{seconds['judge'] / seconds['rule']:>6.2f} {judge_s:>16.3f}")  # fmt: skip


async def mcp_part(calls: int) -> None:
    from palaestra.environments.math.calculator import calculate
    from palaestra.environments.mcp_tools.client import McpTools, run_folder
    from palaestra.environments.mcp_tools.server import McpServer
    from palaestra.sandbox.base import Limits
    from palaestra.sandbox.local import LocalBackend

    source = (common.ROOT / "tests" / "support" / "mcp_server.py").read_text()
    server = McpServer("arith", ("python3", "mcp_server.py"), files={"mcp_server.py": source})

    async def timed(call) -> float:
        samples = []
        for _ in range(calls):
            start = time.perf_counter()
            await call()
            samples.append(time.perf_counter() - start)
        return statistics.median(samples) * 1000

    async def in_process() -> None:
        calculate("2 + 3")

    backend = LocalBackend()
    native = await timed(in_process)
    async with await backend.create("python", Limits(timeout_s=600)) as plain:
        # its own sandbox: the MCP server's bridge holds its sandbox's one exec for the episode
        sandbox = await timed(lambda: plain.exec(["python3", "-c", "print(2 + 3)"]))
    with run_folder() as folder:
        box = await backend.create("python", Limits(timeout_s=600), mounts=(McpTools.mount(folder),))
        async with box, McpTools.start(box, server, folder) as mcp:
            over_mcp = await timed(lambda: mcp.call("add", {"a": 2, "b": 3}))
    print(f"{'tool call':<34} {'median ms':>10} {'MCP / this':>11}")
    for name, ms in (("native, in process (calculator)", native), ("native, one sandbox exec", sandbox),
                     ("MCP (add, via bridge + mcp client)", over_mcp)):  # fmt: skip
        print(f"{name:<34} {ms:>10.3f} {over_mcp / ms:>11.2f}")


def main(argv: list[str] | None = None) -> int:
    ap = common.parser(__doc__)
    ap.add_argument("--part", choices=("judge", "mcp", "both"), default="both")
    ap.add_argument("--steps", type=int, default=3, help="training steps per run (default: %(default)s)")
    ap.add_argument("--calls", type=int, default=100, help="tool calls per kind (default: %(default)s)")
    ap.add_argument("overrides", nargs="*", help="config overrides for the judge runs (key=value)")
    args = ap.parse_args(argv)
    if args.part in ("mcp", "both"):
        asyncio.run(mcp_part(args.calls))
    if args.part in ("judge", "both"):
        judge_part(args.steps, args.overrides)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
