"""Harbor tasks: episodes/s per agent on one example task, local (bubblewrap) vs docker sandboxes,
and the build time and cache hit of a task's environment. One run, ratios.

    .venv/bin/python -m bench.harbor [--task fix-greeting] [--episodes 4] [--agents oracle,openai-tools,claude-code,codex,opencode,mini-swe-agent,terminus]

Every episode is the whole path: a fresh sandbox with a copy of the built environment, the agent's
attempt, /tests uploaded and test.sh run as the verifier. The model's place is taken by a scripted
engine, a labelled TEST DOUBLE (tests/support/servers.py's `ScriptedEngine`): each agent's shell
tool is answered with one call that writes the task's fix (the task's own solution/solve.sh), then
a final text, so every episode scores 1 and the time measured is the agent's and the sandbox's,
not a model's. ``oracle`` calls no model (the SCRIPTED agent running solve.sh): the floor of an
episode. Episodes run one at a time. The build table: the task's environment built into an empty
cache (``--build-task``, default log-errors: a RUN step at build time) and then found in it.
Docker columns need a docker engine (they print "-" where none answers).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import common
from palaestra.environments.harbor.build import build_environment
from palaestra.environments.harbor.env import EXAMPLES, HarborEnv
from palaestra.environments.harbor.task import load_task
from palaestra.models import resolve_model
from palaestra.sandbox import get_backend
from tests.environments.test_harness_env import MARK, ShellScript
from tests.support.servers import ENV_KEY, ScriptedEngine, ThreadServer, gateway_server
from tests.support.sessions import rollouts

DONE = MARK
"""What the fix command prints last (it computes it: the command itself does not hold it)."""


class FixScript(ShellScript):
    """TEST DOUBLE (module docstring): the agent's shell (its tool; terminus: its keystrokes) runs
    `command` whenever the prompt shows the shell and not yet DONE, then a final text (terminus: its
    completion, confirmed); side requests get "ok". Without state, so one script serves every episode."""

    def __call__(self, input_ids: list[int], index: int) -> list[int]:
        prompt = self.tok.decode(input_ids)
        if DONE in prompt:
            text = self.final
        elif self.cue in prompt:
            text = self.call(self.command)
        else:
            text = "ok"
        return self.tok.encode(text, add_special_tokens=False) + [self.end]


def fix_command(task_dir: Path) -> str:
    """The task's solve.sh, run from the shell tool, then DONE."""
    solve = base64.b64encode((task_dir / "solution" / "solve.sh").read_bytes()).decode()
    decode = "import base64, sys; sys.stdout.buffer.write(base64.b64decode(sys.argv[1]))"
    return f"python3 -c '{decode}' {solve} | bash && echo PALAESTRA-$((6*7))"  # no base64 in the image


def episodes_per_s(tok, agent: str, backend: str, task: str, episodes: int, work: Path) -> dict[str, object]:
    env = HarborEnv(agent=agent, backend=backend, tasks=[task], max_turns=6)
    tasks = [t for t, _ in zip(env.tasks(0), range(episodes + 1), strict=False)]
    row: dict[str, object] = {}
    if agent == "oracle":
        first = asyncio.run(env.rollout(None, tasks[0]))  # the build, outside the timing
        started = time.perf_counter()
        rewards = [asyncio.run(env.rollout(None, t)).value for t in tasks[1:]]
    else:
        shape = "opencode" if agent == "openai-tools" else agent  # the same `bash` tool, `command`
        script = FixScript(tok, shape, fix_command(EXAMPLES / task))
        engine = ScriptedEngine(script, stop_ids={script.end})
        with (
            ThreadServer(engine.app()) as eng,
            # a harness told `tiny`'s 32k compacts its ~15k-token prompts, which a script cannot summarise
            gateway_server(eng.url, work / f"spool-{agent}-{backend}", tok, context_length=200_000) as gw,
        ):
            first = rollouts(gw.url, ENV_KEY, env, tasks[:1]).results[0]
            started = time.perf_counter()
            results = rollouts(gw.url, ENV_KEY, env, tasks[1:], concurrency=1).results
            rewards = [r.reward if r.status == "completed" else float("nan") for r in results]
    wall = time.perf_counter() - started
    row["episodes"] = len(rewards)
    row["eps/s"] = len(rewards) / wall
    row["s/ep"] = wall / len(rewards)
    row["reward"] = sum(rewards) / len(rewards)
    row["first"] = getattr(first, "value", getattr(first, "reward", float("nan")))
    return row


def build_times(task_name: str, backend_name: str) -> dict[str, object]:
    task = load_task(EXAMPLES / task_name)
    with tempfile.TemporaryDirectory() as cache:
        os.environ["PALAESTRA_HARBOR_CACHE"] = cache
        backend = get_backend(backend_name)
        started = time.perf_counter()
        cold = asyncio.run(build_environment(task, backend))
        cold_s = time.perf_counter() - started
        started = time.perf_counter()
        warm = asyncio.run(build_environment(task, backend))
        warm_s = time.perf_counter() - started
    return {
        "cold s": cold_s,
        "cold hit": str(cold.cache_hit),
        "warm s": warm_s,
        "warm hit": str(warm.cache_hit),
        "cold/warm": f"{cold_s / warm_s:.0f}x",
    }


def docker_answers() -> bool:
    with contextlib.suppress(Exception):
        import docker

        docker.from_env().ping()
        return True
    return False


def main(argv: list[str] | None = None) -> None:
    ap = common.parser(__doc__)
    ap.add_argument("--task", default="fix-greeting", help="the example task episodes run on")
    ap.add_argument("--build-task", default="log-errors", help="the example task whose build is timed")
    ap.add_argument("--episodes", type=int, default=4, help="timed episodes per agent and backend")
    ap.add_argument(
        "--agents",
        default="oracle,openai-tools,claude-code,codex,opencode,mini-swe-agent,terminus",
        help="comma-separated",
    )
    args = ap.parse_args(argv)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(resolve_model("tiny"))
    backends = ["local", *(["docker"] if docker_answers() else [])]
    with tempfile.TemporaryDirectory(prefix="bench-harbor-") as work:
        os.environ["PALAESTRA_HARBOR_CACHE"] = str(Path(work) / "cache")
        run(args, tok, backends, Path(work))


def run(args: argparse.Namespace, tok: Any, backends: list[str], work: Path) -> None:
    """The two tables of one run (module docstring), its files under `work`."""
    rows: dict[str, dict[str, object]] = {}
    for agent in common.csv(args.agents):
        row: dict[str, object] = {}
        for backend in backends:
            got = episodes_per_s(tok, agent, backend, args.task, args.episodes, work)
            row |= {
                f"{backend} eps/s": got["eps/s"],
                f"{backend} s/ep": got["s/ep"],
                f"{backend} reward": got["reward"],
            }
        if "docker eps/s" in row:
            row["local/docker"] = f"{row['local eps/s'] / row['docker eps/s']:.2f}x"
        rows[agent] = row
    print(
        common.table(
            f"== episodes/s on {args.task}, {args.episodes} timed episodes each, one at a time (load: "
            f"{os.getloadavg()[0]:.2f})",
            [
                (f"{b} {c}", f)
                for b in backends
                for c, f in (("eps/s", ".3f"), ("s/ep", ".2f"), ("reward", ".2f"))
            ]
            + [("local/docker", "s")],
            rows,
            key="agent",
        )
    )
    build = {backend: build_times(args.build_task, backend) for backend in backends}
    print(
        common.table(
            f"== build of {args.build_task}'s environment: into an empty cache, then again (load: "
            f"{os.getloadavg()[0]:.2f})",
            [("cold s", ".2f"), ("cold hit", "s"), ("warm s", ".4f"), ("warm hit", "s"), ("cold/warm", "s")],
            build,
            key="backend",
        )
    )


if __name__ == "__main__":
    main()
