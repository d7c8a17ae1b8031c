"""Tool-environment benchmark, one run, ratios: episodes per second of code_sandbox and swe_agent
at concurrency 1 and 16 on the local (bubblewrap) sandbox backend, and where an episode's time
goes (model calls, sandbox work, grading).

    .venv/bin/python -m bench.envs [--code-episodes 32] [--swe-episodes 16] [--backend local]
    .venv/bin/python -m bench.envs --swe-data real.jsonl --find-links ~/.cache/palaestra/swe/packages --no-index

The model is a scripted engine (a test double from tests/support/servers.py that answers /generate
with the token ids of a correct agent's turns: one tool round trip, then the answer; for swe:
read, fix, run the tests, submit), behind the real gateway. So "model" is the gateway round trip
without model compute, and the figures say what the environments and sandboxes cost per episode.
"""

from __future__ import annotations

import asyncio
import json
import tempfile
import time
from pathlib import Path

from transformers import AutoTokenizer

from bench import common
from palaestra.environments.code_sandbox.env import CodeSandboxEnv
from palaestra.environments.episode import resolve_backend
from palaestra.environments.swe_agent.env import SweAgentEnv
from palaestra.environments.swe_agent.generate import generate
from palaestra.environments.swe_agent.snapshot import apply_patch, patch_paths
from palaestra.gateway.app import create_app
from palaestra.gateway.config import GatewayConfig
from palaestra.gateway.parsers import render_tool_call_text
from palaestra.models import resolve_model
from palaestra.sdk import GatewayClient, run_rollouts
from palaestra.sdk.runner import take_tasks
from tests.support.servers import ScriptedEngine, ThreadServer


def call(name: str, **arguments: str) -> str:
    return render_tool_call_text("hermes", name, json.dumps(arguments))


def code_turns(task) -> list[str]:
    return [call("run_python", code=task.reference + "\nprint('ok')\n"), f"```python\n{task.reference}```"]


def swe_turns(instance, whole_files: bool = True) -> list[str]:
    """Read and rewrite each fixed file, run the tests, submit; without `whole_files` (real
    packages' files are long), replace the changed lines only."""
    base = instance.base()
    fixed = apply_patch(base, instance.patch)
    turns = []
    for path in sorted(patch_paths(instance.patch)):
        if whole_files:
            turns.append(call("read_file", path=path))
            turns.append(call("write_file", path=path, content=fixed[path].decode()))
            continue
        before, after = base[path].decode().splitlines(True), fixed[path].decode().splitlines(True)
        i = next(k for k, (a, b) in enumerate(zip(before, after, strict=False)) if a != b)
        old = "".join(before[max(i - 1, 0) : i + 2])
        turns.append(
            call(
                "str_replace",
                path=path,
                old_str=old,
                new_str="".join(after[max(i - 1, 0) : i + 2 + len(after) - len(before)]),
            )
        )
    return [*turns, call("bash", command=f"{instance.test_cmd} 2>&1 | tail -1"), call("submit")]


class Agents:
    """Chooses each session's next scripted turn from its prompt: which task (a marker text) and
    how many assistant turns it already has."""

    def __init__(self, tok, scripts: dict[str, list[str]]):
        self.tok, self.scripts = tok, scripts
        self.end = tok.convert_tokens_to_ids("<|im_end|>")

    def __call__(self, ids: list[int], index: int) -> list[int]:
        prompt = self.tok.decode(ids)
        turn = prompt.count("<|im_start|>assistant") - 1
        marker = next(m for m in self.scripts if m in prompt)
        turns = self.scripts[marker]
        return self.tok.encode(turns[min(turn, len(turns) - 1)], add_special_tokens=False) + [self.end]


async def episodes(gw_url: str, env, tasks, concurrency: int):
    client = GatewayClient(gw_url, "bench")
    try:
        t0 = time.perf_counter()
        summary = await run_rollouts(env, client, tasks, concurrency=concurrency, progress=False)
        return summary, time.perf_counter() - t0
    finally:
        await client.close()


def report(name: str, runs: dict[int, tuple]) -> None:
    rates = {}
    for concurrency, (summary, wall) in runs.items():
        failed = summary.statuses.get("failed", 0)
        rates[concurrency] = len(summary.results) / wall
        phases = {
            p: sum(r.metrics.get(f"time/{p}_s", 0.0) for r in summary.results)
            for p in ("model", "sandbox", "grade")
        }
        total = sum(phases.values()) or 1.0
        split = ", ".join(f"{p} {100 * s / total:.0f}%" for p, s in phases.items())
        print(
            f"{name:5s} concurrency {concurrency:2d}: {len(summary.results)} episodes, {rates[concurrency]:.2f} ep/s, "
            f"reward {summary.reward_mean:.2f}, failed {failed}; episode time: {split} "
            f"({1000 * total / len(summary.results):.0f} ms per episode summed over phases)"
        )
        errors = [r.error for r in summary.results if r.error]
        if errors:
            print(f"{name:5s}   first of {len(errors)} errors: {errors[0][:500]}")
    print(f"{name:5s} speed-up at 16 over 1: {rates[16] / rates[1]:.2f}x")


def main() -> None:
    ap = common.parser(__doc__)
    ap.add_argument("--code-episodes", type=int, default=32)
    ap.add_argument("--swe-episodes", type=int, default=16)
    ap.add_argument("--backend", default="local")
    ap.add_argument(
        "--swe-data",
        help="a JSONL of swe instances (e.g. `palaestra swe generate --real`) instead of generating",
    )
    ap.add_argument(
        "--find-links",
        nargs="*",
        default=[],
        help="for --swe-data: where pip finds the environments' packages",
    )
    ap.add_argument("--no-index", action="store_true", help="for --swe-data: build the environments offline")
    args = ap.parse_args()
    backend = resolve_backend(args.backend)
    tok = AutoTokenizer.from_pretrained(resolve_model("tiny"))
    code = CodeSandboxEnv(difficulty=1, backend=backend)
    code_tasks = list({t.prompt: t for t in take_tasks(code, 4 * args.code_episodes, seed=0)}.values())
    code_tasks = [code_tasks[i % len(code_tasks)] for i in range(args.code_episodes)]
    with tempfile.TemporaryDirectory(prefix="bench-envs-") as tmp:
        out = Path(args.swe_data or Path(tmp) / "swe.jsonl")
        if not args.swe_data:
            t0 = time.perf_counter()
            instances = asyncio.run(generate(out, backend, per_kind=1, repos=["textkit", "ledger"]))
            print(
                f"generated and validated {len(instances)} swe instances in {time.perf_counter() - t0:.0f} s"
            )
        swe = SweAgentEnv(
            data=str(out),
            backend=backend,
            max_tokens=8192,
            find_links=args.find_links,
            index=not args.no_index,
        )  # write_file sends whole files
        # The scripted engine tells sessions apart by their prompt: keep tasks whose prompts differ.
        pool = list({i.problem_statement: i for i in swe.tasks(0)}.values())
        swe_tasks = [pool[i % len(pool)] for i in range(args.swe_episodes)]
        scripts = {t.prompt: code_turns(t) for t in code_tasks}
        scripts |= {i.problem_statement: swe_turns(i, whole_files=not args.swe_data) for i in pool}
        engine = ScriptedEngine(Agents(tok, scripts), stop_ids={tok.convert_tokens_to_ids("<|im_end|>")})
        with ThreadServer(engine.app()) as eng:
            config = GatewayConfig(
                model="tiny",
                engine_url=eng.url,
                spool_dir=tmp + "/spool",
                api_key="bench",
                admin_key="bench-admin",
            )
            with ThreadServer(create_app(config, tokenizer=tok)) as gw:
                for name, env, tasks in (("code", code, code_tasks), ("swe", swe, swe_tasks)):
                    asyncio.run(episodes(gw.url, env, tasks[:2], 2))  # warm: validation, imports
                    runs = {c: asyncio.run(episodes(gw.url, env, tasks, c)) for c in (1, 16)}
                    report(name, runs)


if __name__ == "__main__":
    main()
