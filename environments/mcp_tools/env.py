"""`McpMathEnv` (``--env mcp-math``): math tasks, the tools an MCP server lists, the math reward.

    palaestra rollout --env mcp-math --tasks 4 --env-args '{"server": {"name": "calc",
        "argv": ["python3", "server.py"], "files": {"server.py": "...its source..."}}}'

Each episode creates a sandbox with the run folder mounted, starts the server in it
(`McpTools.start`), runs the `ToolLoop` with the server's tools and grades the last reply with
`palaestra.verifiers.math`. Metrics: the loop's (``failure/*``, ``time/*``, ``tool_calls``) and
``time/mcp_call_s`` (the tool calls' round trips). A server that fails to start, hangs or answers
what cannot be read raises `McpError`: the episode fails with that reason, the run goes on, and
closing the sandbox kills the server.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from palaestra.environments.episode import EpisodeLog, ToolLoop, resolve_backend
from palaestra.environments.math.tasks import MathTask, iter_tasks
from palaestra.environments.mcp_tools.client import McpTools, run_folder
from palaestra.environments.mcp_tools.server import McpServer
from palaestra.sandbox.base import Limits
from palaestra.sdk.environment import Environment, Reward
from palaestra.sdk.session import Session
from palaestra.verifiers.math import averify_math

SYSTEM = "Use the tools to compute. Answer with the final number in \\boxed{}."


class McpMathEnv(Environment):
    name = "mcp-math"

    def __init__(
        self,
        server: McpServer | Mapping[str, Any],
        difficulty: int = 0,
        backend: Any = "local",
        max_turns: int = 4,
        max_tokens: int = 256,
        memory_mb: int = 512,
    ):
        """`server` an `McpServer` or its fields as a dict (JSON `--env-args`); `backend` a
        sandbox spec or `Backend`."""
        self.server = server if isinstance(server, McpServer) else McpServer(**server)
        self.difficulty, self.backend = difficulty, resolve_backend(backend)
        self.max_turns, self.max_tokens = max_turns, max_tokens
        self.limits = Limits(timeout_s=3600, memory_mb=memory_mb)

    def tasks(self, seed: int) -> Iterable[MathTask]:
        return iter_tasks(seed, self.difficulty, ("arithmetic",))

    async def rollout(self, session: Session, task: MathTask) -> Reward:
        log = EpisodeLog()
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task.question}]
        with run_folder() as folder:
            async with log.timed("sandbox"):
                box = await self.backend.create("python", self.limits, mounts=(McpTools.mount(folder),))
            async with box, McpTools.start(box, self.server, folder) as mcp:
                loop = ToolLoop(mcp.tools, self.max_turns, self.max_tokens)
                episode = await loop.run(session, messages, mcp.call, model=self.model, log=log)
        if episode.answer is None:
            log.fail("no_answer")
        result = await averify_math(episode.last_reply, task.answer)
        return Reward(
            result.reward, log.metrics(correct=float(result.correct), **{"time/mcp_call_s": mcp.seconds})
        )
