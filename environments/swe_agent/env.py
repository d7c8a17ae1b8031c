"""The swe_agent environment: fix a bug in a repository with the tools ``bash``, ``read_file``,
``str_replace``, ``write_file`` and ``submit`` (OpenAI tools), inside a sandbox that holds the
repository; graded by applying the agent's diff to a fresh copy in a fresh sandbox and running
FAIL_TO_PASS and PASS_TO_PASS (`grading.py`). Reward 1 only if both pass. The turns are
`environments/episode.py`'s `ToolLoop`: a reply without a tool call is answered with a nudge to use
the tools, and only ``submit`` (or ``max_turns``) ends the episode.

    palaestra rollout --env swe --env-args '{"data": "swe.jsonl", "backend": "local"}' --tasks 4

Tasks, the sandbox and grading are `workspace.py`'s `SweWorkspace` (shared with the harness
environment): a SWE-bench-style JSONL (`instance.py`; `palaestra swe generate` writes one), or,
without ``data``, the generated set, made once into ``~/.cache/palaestra/swe/`` (or ``cache_dir``);
each instance validated before its first episode.
"""

from __future__ import annotations

from typing import Any

from palaestra.environments.episode import EpisodeLog, ToolLoop, ToolResult, sandbox_failed
from palaestra.environments.swe_agent.instance import SweInstance
from palaestra.environments.swe_agent.tools import TOOLS, call_tool
from palaestra.environments.swe_agent.workspace import SweWorkspace
from palaestra.sandbox.base import Limits, SandboxError
from palaestra.sdk.environment import Environment, Reward
from palaestra.sdk.session import Session

__all__ = ["SweAgentEnv"]

SYSTEM = (
    "You are a software engineer fixing a bug in a Python repository. The repository is your working "
    "directory. Use the tools to read the code, reproduce the problem, edit files and run the tests "
    "({test_cmd}). Change the library, not the tests. When you are done, call submit."
)
UNPARSED_CALL = "error: your tool call could not be parsed; write it in the tool-call format"
KEEP_GOING = "Use the tools to work on the repository; call submit when you are done."


class SweAgentEnv(Environment):
    name = "swe"

    def __init__(
        self,
        data: str | None = None,
        backend: Any = "local",
        max_turns: int = 20,
        max_tokens: int = 1024,
        temperature: float = 1.0,
        tool_timeout_s: float = 30.0,
        cache_dir: str | None = None,
        generate_seed: int = 0,
        env_cache_dir: str | None = None,
        find_links: list[str] | None = None,
        index: bool = True,
    ):
        """`data` a SWE-bench-style JSONL (default: the generated set); `backend` a sandbox spec or
        a `Backend`; `max_turns` model calls per episode. Instances that need an environment of
        their own (`repo_env.py`) get one built in `env_cache_dir` (default
        ``~/.cache/palaestra/swe/envs``) by pip, from the package index unless `index` is false,
        and from the `find_links` directories."""
        self.loop = ToolLoop(TOOLS, max_turns, max_tokens, temperature, UNPARSED_CALL, KEEP_GOING)
        self.workspace = SweWorkspace.from_args(
            data, backend, cache_dir, generate_seed, env_cache_dir, find_links, index
        )
        self.max_turns, self.max_tokens, self.temperature = max_turns, max_tokens, temperature
        self.tool_timeout_s = tool_timeout_s
        self.limits = Limits(timeout_s=tool_timeout_s, cpu_s=int(tool_timeout_s), memory_mb=1024, pids=128)

    def tasks(self, seed: int) -> list[SweInstance]:
        return self.workspace.tasks(seed)

    async def rollout(self, session: Session, task: SweInstance) -> Reward:
        log = EpisodeLog()
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": SYSTEM.format(test_cmd=task.test_cmd)},
            {"role": "user", "content": task.problem_statement},
        ]
        submitted = False

        async def run_tool(name: str, args: dict[str, Any]) -> ToolResult:
            nonlocal submitted
            async with log.timed("sandbox"):
                text, result = await call_tool(box.sandbox, name, args, self.tool_timeout_s)
            submitted = submitted or name == "submit"
            timed_out = result is not None and result.status == "timeout"
            return ToolResult(text, "sandbox_timeout" if timed_out else None, ends_episode=name == "submit")

        try:  # a sandbox that fails under the episode fails it (never trained), not a 0 to learn from
            box = await self.workspace.start(task, self.limits, log)
            async with box:
                await self.loop.run(session, messages, run_tool, model=self.model, log=log)
                agent_tree = await box.take_out()
        except SandboxError as exc:
            raise sandbox_failed(exc) from exc
        return await self.workspace.grade(task, box.base, agent_tree, log, submitted=float(submitted))
